"""Run a causal LM on a micro-batch and return each sample's per-token logprobs.

A packed row goes to the model with an explicit 4-D mask [B, 1, T, T] and explicit `position_ids`.
transformers 5.23 (`masking_utils._preprocess_mask_arguments`) passes a 4-D mask through untouched
to the attention function: `sdpa` accepts a bool mask (True = attend) and `eager` adds the mask to
the scores, so eager gets a float mask of 0 / dtype-min. The vocabulary projection runs only on the
positions that predict a completion token (not on every prompt token).
"""
from __future__ import annotations

import torch

from node.trainer.packing import MicroBatch, Row


def attention_mask_4d(rows: list[Row], length: int, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] mask: q may see k iff same block, k ≤ q, and k is prompt or q's own completion."""
    masks = []
    for row in rows:
        n = len(row)
        pad = length - n
        # Padding tokens get their own unique blocks so they only see themselves (no empty softmax rows).
        block = torch.tensor(row.block + [-(i + 2) for i in range(pad)])
        part = torch.tensor(row.part + [-1] * pad)
        same_block = block[:, None] == block[None, :]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        visible_part = (part[None, :] == -1) | (part[None, :] == part[:, None])
        masks.append(same_block & causal & visible_part)
    allowed = torch.stack(masks)[:, None]
    if attn_implementation == "eager":
        out = torch.zeros(allowed.shape, dtype=dtype)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def micro_batch_tensors(mb: MicroBatch, attn_implementation: str, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    length = max(len(r) for r in mb.rows)
    input_ids = torch.zeros(len(mb.rows), length, dtype=torch.long)
    position_ids = torch.zeros(len(mb.rows), length, dtype=torch.long)
    for b, r in enumerate(mb.rows):
        input_ids[b, : len(r)] = torch.tensor(r.input_ids)
        position_ids[b, : len(r)] = torch.tensor(r.position_ids)
    if mb.custom_mask:
        mask = attention_mask_4d(mb.rows, length, attn_implementation, dtype)
    else:  # padded layout: the model's own causal mask plus a 2-D padding mask
        mask = torch.zeros(len(mb.rows), length, dtype=torch.long)
        for b, r in enumerate(mb.rows):
            mask[b, : len(r)] = 1
    return {"input_ids": input_ids.to(device), "position_ids": position_ids.to(device),
            "attention_mask": mask.to(device)}


def micro_batch_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sample of `mb` (in slice order): the model's logprob of each completion token, [T_i]."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    batch = micro_batch_tensors(mb, attn, dtype, device)
    hidden = model.get_decoder()(**batch, use_cache=False).last_hidden_state  # [B, T, H]
    slices = [s for r in mb.rows for s in r.slices]
    rows_idx = torch.tensor([s.row for s in slices for _ in s.pred_index], device=device)
    pos_idx = torch.tensor([p for s in slices for p in s.pred_index], device=device)
    targets = torch.tensor([t for s in slices for t in s.sample.completion_ids], device=device)
    logits = model.get_output_embeddings()(hidden[rows_idx, pos_idx]).float() / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return list(torch.split(lp, [len(s.pred_index) for s in slices]))


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int],
                      temperature: float = 1.0) -> torch.Tensor:
    """Reference path: one unpacked sequence through the model's ordinary forward. [len(completion)]"""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)
    return lp.gather(-1, torch.tensor(completion_ids, device=device)[:, None]).squeeze(-1)
