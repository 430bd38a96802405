"""Inference backends for worker nodes: one contract (`base.InferenceBackend`), two engines.

`transformers` (CPU/CUDA, always available) and `vllm` (CUDA, the `gpu` extra). Both sample with
`verify.sampler` and commit with `verify.commitment`, so a verifier can replay their output.
Engines are imported lazily: `load_backend("vllm", ...)` is the only place vllm gets imported.
"""
from __future__ import annotations

from .base import GenRequest, GenResult, InferenceBackend

__all__ = ["GenRequest", "GenResult", "InferenceBackend", "load_backend"]


def load_backend(name: str, model, **kwargs) -> InferenceBackend:
    """Build the backend called `name` ("transformers" | "vllm") for a model directory or module."""
    if name == "transformers":
        from .transformers_backend import TransformersBackend

        return TransformersBackend(model, **kwargs)
    if name == "vllm":
        from .vllm_backend import VLLMBackend

        return VLLMBackend(model, **kwargs)
    raise ValueError(f"unknown inference backend {name!r} (expected 'transformers' or 'vllm')")
