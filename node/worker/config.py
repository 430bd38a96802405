"""Worker section of the config tree (owned by node/worker). Only pydantic here: imported at start-up."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    storage_dir: str = "prime-node-worker"
    backend: str = Field("transformers", pattern="^(transformers|vllm)$")
    device: str = "auto"
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    heartbeat_seconds: float = Field(5.0, gt=0)
