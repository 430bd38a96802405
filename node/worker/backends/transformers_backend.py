"""Batched generation with Hugging Face transformers (CPU or CUDA), replayable by the verifier.

A hand-written decode loop (left padding + attention mask + KV cache) samples every step with
`verify.sampler.sample_step` (seeded Gumbel-max) instead of `model.generate`'s samplers, and records
the LM head's input at each step for the activation commitment (`verify.commitment`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from node.model_loading import MODEL_LOADS
from protocol.checkpoint import load_payload
from verify.commitment import capture_final_hidden, make_commitments
from verify.rollouts import left_pad, resolve_device, resolve_dtype
from verify.sampler import sample_step

from .adapter import LoraAdapter
from .base import GenRequest, GenResult, check_generate_args

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TransformersBackend:
    """`InferenceBackend` on a transformers causal LM.

    model: a model directory (HF config + safetensors) or an already loaded `PreTrainedModel`
    (which is moved to `device`/`dtype` in place). `max_batch_size` bounds one decode batch.
    """
    def __init__(self, model: str | Path | PreTrainedModel, *, dtype: str | torch.dtype = "float32",
                 device: str = "auto", max_batch_size: int = 64):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            with MODEL_LOADS:  # one load at a time in a process (node/model_loading.py)
                model = AutoModelForCausalLM.from_pretrained(str(model), dtype=self.dtype, use_safetensors=True)
        # transformers wraps PreTrainedModel.to in functools.wraps, which typeshed types as unbound
        self.model = model.to(self.device, self.dtype).eval()  # type: ignore[arg-type]
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_batch_size = max_batch_size
        self.policy_step = -1
        self.base: str | None = None  # manifest hash of the full checkpoint loaded, which adapters may apply to
        self._adapter_hooks: list[torch.utils.hooks.RemovableHandle] = []

    def load_payload(self, payload: str | Path, step: int, *, base: str | None = None) -> None:
        """`base`: the manifest hash when the payload is a full checkpoint that adapters may pin (None: merged)."""
        self.load_state_dict(load_payload(payload), step, base=base)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor], step: int, *, base: str | None = None) -> None:
        """Copy new weights into the existing parameters (dtype converted); refuse a different layout."""
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise ValueError(f"state has {len(unknown)} unknown tensors, e.g. {unknown[0]!r}")
        loaded_ptrs = {own[k].data_ptr() for k in state}
        # Tied weights (e.g. lm_head = embed_tokens) are saved once: absent keys must share storage.
        missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
        if missing:
            raise ValueError(f"state lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
            own[name].copy_(tensor)
        self._drop_adapter()  # an adapter belongs to the weights it was loaded on
        self.base = base
        self.policy_step = step

    def load_adapter(self, adapter: LoraAdapter, step: int) -> None:
        """Generate with `adapter` unmerged on the loaded base from now on: each adapted linear layer's output gets
        `alpha / rank * B @ A x` added by a forward hook, in float32 (the base weights stay untouched, so the next
        adapter or full payload loads as before). Refused (CheckpointError "base_mismatch") unless the loaded base is
        the checkpoint the adapter pins. Hooks rather than peft's wrapping: peft renames the wrapped weights
        (`...q_proj.base_layer.weight`), which the next full payload would then no longer load into."""
        from protocol.checkpoint import CheckpointError

        adapter.check_base(self.base)
        modules = dict(self.model.named_modules())
        hooks = []
        for name, (a, b) in adapter.pairs.items():
            layer = modules.get(name)
            if not isinstance(layer, torch.nn.Linear) or (b.shape[0], a.shape[1]) != tuple(layer.weight.shape):
                raise CheckpointError("bad_adapter", f"step {step}'s adapter for {name!r} fits no linear layer of "
                                                     f"this model")
            hooks.append((layer, a.to(self.device, torch.float32), b.to(self.device, torch.float32)))
        self._drop_adapter()
        for layer, a, b in hooks:
            self._adapter_hooks.append(layer.register_forward_hook(_lora_hook(a, b, adapter.scale)))
        self.policy_step = step

    def _drop_adapter(self) -> None:
        for h in self._adapter_hooks:
            h.remove()
        self._adapter_hooks = []

    def generate(self, requests: list[GenRequest], *, temperature: float, top_p: float, max_tokens: int,
                 eos_token_id: int) -> list[GenResult]:
        check_generate_args(requests, temperature, top_p, max_tokens, self.vocab_size)
        results: list[GenResult] = []
        for i in range(0, len(requests), self.max_batch_size):
            results += self._generate_batch(requests[i:i + self.max_batch_size], temperature, top_p,
                                            max_tokens, eos_token_id)
        return results

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenRequest], temperature: float, top_p: float, max_tokens: int,
                        eos_token_id: int) -> list[GenResult]:
        from transformers import DynamicCache

        dev = self.device
        # The samples of one prompt share its prefill: each distinct prompt runs once and its KV cache is
        # copied to every row that decodes from it (a group of G samples: 1 prompt prefill instead of G).
        keys = [tuple(r.prompt_ids) for r in requests]
        distinct = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        owner = torch.tensor([distinct[k] for k in keys], dtype=torch.int64, device=dev)
        ids, mask, pos = left_pad(list(distinct), pad_id=eos_token_id, device=dev)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev)
        b = len(requests)
        tokens_out = torch.empty((b, max_tokens), dtype=torch.int64, device=dev)
        logprobs_out = torch.empty((b, max_tokens), dtype=torch.float32, device=dev)
        hidden_steps: list[torch.Tensor] = []
        lengths = torch.full((b,), max_tokens, dtype=torch.int64, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        cache = DynamicCache(config=self.model.config)
        with capture_final_hidden(self.model) as captured:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1][owner]
            captured.append(captured.pop()[owner])
            # transformers annotates torch.LongTensor, which no tensor is statically
            cache.reorder_cache(owner)  # type: ignore[arg-type]
            mask, pos = mask[owner], pos[owner]
            for step in range(max_tokens):
                # The hidden state that produced token `step` (the head saw only the last position).
                hidden_steps.append(captured.pop()[:, -1])
                captured.clear()
                positions = torch.full((b,), step, dtype=torch.int64, device=dev)
                tok, lp = sample_step(logits, seeds, positions, temperature, top_p)
                tokens_out[:, step] = tok
                logprobs_out[:, step] = lp
                newly = (~done) & (tok == eos_token_id)
                lengths[newly] = step + 1
                done |= newly
                if step + 1 == max_tokens or bool(done.all()):
                    break
                # Finished rows keep decoding (their outputs are ignored): cheaper than reshuffling the cache.
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                                 past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1]
        hidden = torch.stack(hidden_steps, dim=1)  # [B, steps, H]
        tokens_cpu, lps_cpu, lengths_cpu = tokens_out.cpu(), logprobs_out.cpu(), lengths.cpu().tolist()
        done_cpu = done.cpu().tolist()
        commitments = make_commitments([hidden[i, :lengths_cpu[i]] for i in range(b)])  # the batch's chunks at once
        return [GenResult(completion_ids=tokens_cpu[i, :n].tolist(), logprobs=lps_cpu[i, :n].tolist(),
                          finish_reason="stop" if done_cpu[i] else "length", commitment=commitments[i])
                for i, n in enumerate(lengths_cpu)]


def _lora_hook(a: torch.Tensor, b: torch.Tensor, scale: float):
    """A forward hook adding `scale * B @ A x` to a linear layer's output, computed in float32 (as the protocol's merge
    computes B @ A) and added in the layer's dtype."""
    def hook(_module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out + ((args[0].to(torch.float32) @ a.T) @ b.T * scale).to(out.dtype)
    return hook
