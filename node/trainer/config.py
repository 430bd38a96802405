"""Trainer section of the config tree (owned by node/trainer). Only pydantic here: imported at start-up."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainerConfig(_Strict):
    mode: str = Field("rl", pattern="^(rl|sft|opd)$")
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=64)
    seed: int = 0
