"""Worker section of the config tree (owned by node/worker). Only pydantic here: imported at start-up."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VllmSettings(BaseModel):
    """Engine settings of the `vllm` backend (unset: chosen for the device)."""

    model_config = ConfigDict(extra="forbid")

    # Share of GPU memory for weights + KV cache (CUDA; unset: 0.85). Ignored when kv_cache_gib is set.
    gpu_memory_utilization: float | None = Field(None, gt=0, le=0.98)
    # KV cache size. Unset: 1 GiB on the CPU, where vLLM's share-of-host-memory rule counts this whole
    # process (and any other engine in it) against the share and fails; from gpu_memory_utilization on CUDA.
    kv_cache_gib: float | None = Field(None, gt=0, le=4096)
    max_model_len: int | None = Field(None, ge=16)  # unset: the model's own limit
    enforce_eager: bool | None = None  # unset: eager on the CPU (starts faster), CUDA graphs on GPUs
    max_num_seqs: int = Field(256, ge=1, le=4096)  # sequences decoded together
    # The largest LoRA rank the engine serves with worker.lora_serving = "adapter" (one of the ranks vLLM accepts). vLLM
    # sizes its adapter buffers for it and its CPU ops pad every token's adapter to it, so it costs speed (rank 16: 0.42x
    # merged's tokens/s on the CPU, 32: 0.33x). 32 covers runs up to trainer.lora.rank 32, and rank-16 runs warm-started
    # by a version that sent adapters stacked at twice the rank. A run's adapter of a higher rank is refused in one line.
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = 32


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    storage_dir: str = "prime-node-worker"
    backend: str = Field("transformers", pattern="^(transformers|vllm)$")
    device: str = Field("auto", pattern="^(auto|cpu|cuda(:[0-9]+)?)$")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    heartbeat_seconds: float = Field(5.0, gt=0)
    join_token: str | None = Field(None, max_length=2048)  # for runs with admission.mode = "token"
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    # How a LoRA run's adapter steps (docs/PROTOCOL.md, "lora-adapter") reach the engine. "merged": the fetcher's
    # merged weights are loaded like any full checkpoint (a full weight reload per step). "adapter": the engine keeps
    # the pinned base and applies each step's verified adapter unmerged (vLLM's own LoRA support; a forward hook in the
    # transformers backend): a swap of megabytes, at some cost per generated token (docs/BENCHMARKS.md, "LoRA swap").
    lora_serving: Literal["merged", "adapter"] = "merged"
