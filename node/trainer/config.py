"""Trainer section of the config tree (owned by node/trainer). Only pydantic here: imported at start-up.

Nested sections: `loss`, `advantage`, `filters`, `buffer`, `lora`. Every model forbids unknown keys so a typo in
a TOML file is an error at start-up, not a silently ignored knob.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# "package.module:Name" -- the form every plug-in (loss, advantage, task) is given by.
IMPORT_PATH_PATTERN = r"^$|^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LossConfig(_Strict):
    """Which per-sequence loss the trainer uses in `rl` mode (sft/opd modes pick their own loss)."""

    type: Literal["default", "aipo", "custom"] = "default"
    dppo_mask_low: float = Field(0.2, ge=0)
    dppo_mask_high: float = Field(0.2, ge=0)
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float = Field(1e-3, ge=0)
    is_clip: float = Field(4.0, gt=0)
    aipo_delta: float = Field(4.0, gt=0)
    import_path: str = Field("", pattern=IMPORT_PATH_PATTERN)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _custom_needs_path(self) -> "LossConfig":
        if self.type == "custom" and not self.import_path:
            raise ValueError("loss.type = 'custom' needs loss.import_path ('package.module:function')")
        return self


class AdvantageConfig(_Strict):
    """Per-group advantages: reward minus group mean (DR-GRPO), optionally std-normalised, plus penalties."""

    type: Literal["drgrpo", "custom"] = "drgrpo"
    std_normalize: bool = False
    import_path: str = Field("", pattern=IMPORT_PATH_PATTERN)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    length_penalty: Literal["none", "tokens", "turns"] = "none"
    length_penalty_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _custom_needs_path(self) -> "AdvantageConfig":
        if self.type == "custom" and not self.import_path:
            raise ValueError("advantage.type = 'custom' needs advantage.import_path ('package.module:function')")
        return self


FilterName = Literal["gibberish", "repetition", "zero_advantage"]
DEFAULT_FILTERS: tuple[FilterName, ...] = ("gibberish", "repetition")


class FiltersConfig(_Strict):
    """Rollout filters. Setting `enabled` replaces the default list wholesale (no None values: the
    demo serialises this tree back to TOML, which has no null)."""

    enabled: list[FilterName] = Field(default_factory=lambda: list(DEFAULT_FILTERS))
    gibberish_min_mean_logprob: float = -10.0  # a completion whose mean sampler logprob is below is noise
    repetition_ngram: int = Field(4, ge=1, le=64)
    repetition_threshold: float = Field(0.5, gt=0, le=1)  # fraction of repeated n-grams
    repetition_min_tokens: int = Field(32, ge=1)  # shorter completions are never judged repetitive
    zero_advantage_eps: float = Field(1e-8, ge=0)


class BufferConfig(_Strict):
    """Difficulty pools and online difficulty filtering."""

    easy_threshold: float = 1.0  # group mean reward >= this: the problem moves to the easy pool
    hard_threshold: float = 0.0  # group mean reward <= this: the problem moves to the hard pool
    easy_fraction: float = Field(0.0, ge=0, le=1)  # on resume, this share of easy problems goes back to normal
    hard_fraction: float = Field(0.0, ge=0, le=1)  # same for hard problems
    online_difficulty_filtering: bool = True  # drop groups whose rewards are all 0 or all 1
    keep_rate_window: int = Field(256, ge=1)  # groups remembered for the observed keep rate

    @model_validator(mode="after")
    def _ordered(self) -> "BufferConfig":
        if self.hard_threshold > self.easy_threshold:
            raise ValueError("buffer.hard_threshold must not exceed buffer.easy_threshold")
        return self


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_LORA_TARGETS: tuple[LoraTarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraConfig(_Strict):
    """LoRA adapters on the named projections of a Llama/Qwen2-shaped model (node/trainer/lora.py, peft); the
    base weights are frozen and only the adapters train. rank 0 (the default) = off: full fine-tuning.
    Step 0 is published as full merged weights (W + alpha / rank * B @ A), later steps as the adapter alone
    (node/coordinator/publisher.py; docs/PROTOCOL.md, "lora-adapter")."""

    rank: int = Field(0, ge=0, le=1024)
    # The adapter's update is scaled by alpha / rank: with a fixed alpha a higher rank does not need another lr.
    alpha: int = Field(32, ge=1, le=65536)  # an int, as peft's lora_alpha
    # 0 by default: dropout in the trainer's forward would make its logprobs (the importance ratio's
    # numerator) noisy against the sampler's, which decodes without it.
    dropout: float = Field(0.0, ge=0, lt=1)
    # Attention projections by default; add gate_proj, up_proj, down_proj for the MLP (more bytes, more capacity).
    target_modules: list[LoraTarget] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _unique_targets(self) -> "LoraConfig":
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules names a module twice: {self.target_modules}")
        return self


class TrainerConfig(_Strict):
    mode: str = Field("rl", pattern="^(rl|sft|opd)$")
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=64)
    packing: Literal["shared_prompt", "packed", "padded"] = "shared_prompt"
    # The dtype the weights are published in; nodes and the verifier then hold the same values. "float32" with
    # nodes generating in bf16 (vLLM on GPUs) leaves each weight rounded on the node alone, and the honest noise
    # grows as training moves weights off the bf16 grid: on an H200, 3 AdamW steps on made 16 of 512 honest
    # rollouts fail as forgeries (bench/bf16_token_tail.py; 0 with "bfloat16"). Use it only with fp32 nodes.
    broadcast_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Trainer state snapshots kept on disk. At least 2: a crash after step n+1's snapshot is written
    # and before the ledger records it resumes from step n's, which must still be there.
    keep_states: int = Field(2, ge=2)
    seed: int = 0
    # FSDP2 data-parallel ranks of the coordinator's trainer (node.trainer.distributed), all on this
    # machine: 1 = the plain single-process Trainer.
    ranks: int = Field(1, ge=1, le=64)
    # Where the coordinator trains: "cpu", or "cuda" (one GPU per rank: rank r takes GPU r; NCCL between
    # ranks). Verification replays stay on the CPU; evaluation uses the trainer's model with one rank, and
    # with ranks > 1 an unsharded fp32 CPU copy gathered from every rank (no collective while decoding).
    device: Literal["cpu", "cuda"] = "cpu"
    # Short supervised warm start on the task's reference answers, done before RL step 1 (0 = off).
    warm_start_steps: int = Field(0, ge=0)
    warm_start_lr: float = Field(3e-3, gt=0)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
