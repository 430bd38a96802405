"""vLLM inference backend (CUDA, the `gpu` extra). NOT RUN in this repository's CI: vllm is not
installed there; `tests/unit/test_backend_transformers.py::test_vllm_backend_matches_verifier` runs it
where vllm and a GPU exist.

Same contract as the transformers backend, built from three pieces:

1. Decoding: vLLM does the fast part. A custom V1 logits processor (`vllm.v1.sample.logits_processor.
   LogitsProcessor`, registered with `LLM(logits_processors=[...])`) replays our seeded Gumbel-max
   sampler on each row's raw logits and leaves only the chosen token finite; vLLM itself samples
   greedily (temperature 0), so it emits exactly our choice. Per-request seed/temperature/top_p travel
   in `SamplingParams.extra_args`. vLLM's own EOS handling is off (`ignore_eos`); our EOS is a
   `stop_token_ids` entry, which vLLM keeps as the last output token.
2. Evidence: vLLM exposes neither final hidden states nor logprobs under our (temperature, top-p)
   distribution, so one batched prefill of prompt + completion through a transformers copy of the
   same weights (`verify.rollouts.recompute`, the verifier's own code path) yields the logprobs and
   the activation commitment. A prefill costs a few percent of the decode it certifies.
3. Weights: `load_state_dict` updates both copies in place: `LLM.apply_model(lambda m: m.load_weights(...))`
   on the vLLM side (the engine runs in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so no tensor is
   serialised), `copy_` on the transformers side, then the prefix cache is reset.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from verify.commitment import make_commitment
from verify.rollouts import recompute, resolve_dtype
from verify.sampler import check_sampling, check_seed, replay_scores, sample_step

from .base import GenRequest, GenResult, check_generate_args
from .transformers_backend import TransformersBackend

# The engine core must live in this process for apply_model() to touch the model without pickling.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402  (the `gpu` extra; this module is imported lazily)
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # noqa: E402

ARG_SEED, ARG_TEMPERATURE, ARG_TOP_P = "prime_node_seed", "prime_node_temperature", "prime_node_top_p"


class GumbelForcingLogitsProcessor(LogitsProcessor):
    """Forces each opted-in row to the token `verify.sampler.sample_step` picks on its raw logits."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (seed, temperature, top_p, live reference to the request's output token ids)
        self.rows: dict[int, tuple[int, float, float, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        if ARG_SEED in extra:
            check_seed(extra[ARG_SEED])
            check_sampling(extra[ARG_TEMPERATURE], extra[ARG_TOP_P])

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax, so vLLM must apply it even for greedy requests

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:  # order per vLLM: removed, added, moved
            self.rows.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]
            extra = (params.extra_args or {}) if params is not None else {}
            if ARG_SEED in extra:
                self.rows[index] = (extra[ARG_SEED], extra[ARG_TEMPERATURE], extra[ARG_TOP_P], output_ids)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        groups: dict[tuple[float, float], list[int]] = {}
        for row, (_, temperature, top_p, _) in self.rows.items():
            groups.setdefault((temperature, top_p), []).append(row)
        for (temperature, top_p), rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            seeds = torch.tensor([self.rows[r][0] for r in rows], dtype=torch.int64, device=logits.device)
            # Position = index within the completion = tokens already generated for that request.
            positions = torch.tensor([len(self.rows[r][3]) for r in rows], dtype=torch.int64, device=logits.device)
            tokens, _ = sample_step(logits[idx], seeds, positions, temperature, top_p)
            forced = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
            forced[torch.arange(len(rows), device=logits.device), tokens] = 0.0
            logits[idx] = forced
        return logits


class VLLMBackend:
    """`InferenceBackend` on vLLM. `model_dir`: an HF model directory (config + safetensors)."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "bfloat16", device: str = "cuda",
                 gpu_memory_utilization: float = 0.6, max_model_len: int | None = None, evidence_batch: int = 16):
        if not torch.cuda.is_available():
            raise RuntimeError("the vllm backend needs a CUDA GPU; use backend = 'transformers' on CPU")
        self.dtype = resolve_dtype(dtype)
        self.llm = LLM(model=str(model_dir), dtype=str(self.dtype).removeprefix("torch."), seed=0,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enable_prefix_caching=True, logits_processors=[GumbelForcingLogitsProcessor])
        # The evidence model: same weights in transformers, used for one prefill per batch.
        self.evidence = TransformersBackend(model_dir, dtype=self.dtype, device=device)
        self.vocab_size = self.evidence.vocab_size
        self.evidence_batch = evidence_batch
        self.policy_step = -1

    def load_state_dict(self, state: Mapping[str, torch.Tensor], step: int) -> None:
        self.evidence.load_state_dict(state, step)  # validates names and shapes first
        items = list(state.items())
        self.llm.apply_model(lambda model: model.load_weights(weights=iter(items)))
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.policy_step = step

    def generate(self, requests: list[GenRequest], *, temperature: float, top_p: float, max_tokens: int,
                 eos_token_id: int) -> list[GenResult]:
        check_generate_args(requests, temperature, top_p, max_tokens, self.vocab_size)
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                 stop_token_ids=[eos_token_id], detokenize=False,
                                 extra_args={ARG_SEED: r.seed, ARG_TEMPERATURE: temperature, ARG_TOP_P: top_p})
                  for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], params,
                                    use_tqdm=False)
        completions = []
        for out in outputs:
            ids = list(out.outputs[0].token_ids)
            if eos_token_id in ids:  # stop at the first EOS, kept as the last token
                ids = ids[:ids.index(eos_token_id) + 1]
            completions.append(ids)
        results: list[GenResult] = []
        for i in range(0, len(requests), self.evidence_batch):
            results += self._evidence(requests[i:i + self.evidence_batch], completions[i:i + self.evidence_batch],
                                      temperature, top_p, eos_token_id)
        return results

    def _evidence(self, requests: list[GenRequest], completions: list[list[int]], temperature: float, top_p: float,
                  eos_token_id: int) -> list[GenResult]:
        logits, hidden = recompute(self.evidence.model, [r.prompt_ids for r in requests], completions)
        results = []
        for row, (req, comp) in enumerate(zip(requests, completions)):
            n = len(comp)
            rep = replay_scores(logits[row, :n], req.seed, torch.arange(n, device=logits.device), temperature,
                                top_p, torch.tensor(comp, device=logits.device))
            results.append(GenResult(
                completion_ids=comp,
                logprobs=rep.logprob_hi.cpu().tolist(),
                finish_reason="stop" if comp[-1] == eos_token_id else "length",
                commitment=make_commitment(hidden[row, :n]),
            ))
        return results
