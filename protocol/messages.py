"""Pydantic models of every request and response body (DESIGN §5, §7).

Every model forbids unknown fields and bounds every list and string, so a hostile body is rejected
with a clear 400 before any work is done on it. Field names and shapes are the wire contract.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PROMPT_TOKENS = 32_768
MAX_COMPLETION_TOKENS = 32_768
MAX_PROMPTS_PER_ASSIGNMENT = 256
MAX_GROUP_SIZE = 256
MAX_ROLLOUTS_PER_SUBMISSION = 4096
MAX_COMMITMENT_CHARS = 4 * 1024 * 1024
MAX_ID_CHARS = 128

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
Step = Annotated[int, Field(ge=0, lt=2**31)]
ShortStr = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- join / heartbeat ------------------------------------------------------------------------------
class NodeInfo(Wire):
    name: Annotated[str, Field(max_length=64)] | None = None
    backend: Annotated[str, Field(max_length=32)] | None = None
    device: Annotated[str, Field(max_length=64)] | None = None
    p2p_addrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=8)] = []


class JoinRequest(Wire):
    node: NodeInfo | None = None
    pow: Annotated[str, Field(max_length=64)] | None = None  # open runs: proof of work (protocol.admission)
    token: Annotated[str, Field(max_length=2048)] | None = None  # token runs: a join token from the operator


class AdmissionInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    mode: Literal["open", "allowlist", "token"] = "open"
    pow_bits: Annotated[int, Field(ge=0, le=64)] = 0


class RunInfo(BaseModel):
    """What a client reads from GET /v1/status before its first signed request (the rest is ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    run_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    coordinator_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    admission: AdmissionInfo = AdmissionInfo()


class RunSpec(Wire):
    run_id: str
    node_id: str
    coordinator_key: str
    task: str
    async_level: int
    current_step: int
    group_size: int
    model_config_json: dict  # the HF config.json of the policy (weights come as checkpoints)
    tokenizer_files: dict[str, str]  # file name -> text content (small: tokenizer.json etc.)
    eos_token_id: int
    checkpoint_dtype: str
    p2p_bootstrap: list[str] = []
    relays: list[str] = []

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class HeartbeatRequest(Wire):
    policy_step: Step | None = None
    tokens_per_second: Annotated[float, Field(ge=0, le=1e9)] = 0.0
    steps_held: Annotated[list[Step], Field(max_length=64)] = []
    state: Literal["starting", "fetching", "generating", "idle", "stopping"] = "idle"
    bytes_by_source: dict[Literal["coordinator", "relay", "peer"], Annotated[int, Field(ge=0)]] = {}


class HeartbeatResponse(Wire):
    current_step: int
    banned: bool = False


# --- work ------------------------------------------------------------------------------------------
class WorkRequest(Wire):
    policy_step: Step


class Sampling(Wire):
    temperature: float
    top_p: float
    max_tokens: int


class PromptWork(Wire):
    prompt_id: ShortStr
    prompt_ids: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
    seeds: Annotated[list[Seed], Field(max_length=MAX_GROUP_SIZE)]


class Assignment(Wire):
    assignment_id: ShortStr
    batch_step: Step
    min_policy_step: Step
    group_size: int
    sampling: Sampling
    deadline_ms: int
    prompts: list[PromptWork]


# --- submit ----------------------------------------------------------------------------------------
class RolloutSubmission(Wire):
    prompt_id: ShortStr
    sample_index: Annotated[int, Field(ge=0, lt=MAX_GROUP_SIZE)]
    completion_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)]
    logprobs: Annotated[list[float], Field(max_length=MAX_COMPLETION_TOKENS)]
    finish_reason: Literal["stop", "length"]
    commitment: Annotated[str, Field(max_length=MAX_COMMITMENT_CHARS)]

    @field_validator("logprobs")
    @classmethod
    def _finite_nonpositive(cls, v: list[float]) -> list[float]:
        for x in v:
            if not (x == x) or x in (float("inf"), float("-inf")) or x > 0.0:
                raise ValueError("logprobs must be finite and <= 0")
        return v

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> "RolloutSubmission":
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError("one logprob per completion token is required")
        return self


class SubmitRequest(Wire):
    assignment_id: ShortStr
    policy_step: Step
    rollouts: Annotated[list[RolloutSubmission], Field(min_length=1, max_length=MAX_ROLLOUTS_PER_SUBMISSION)]


class RolloutRef(Wire):
    prompt_id: str
    sample_index: int


class Rejection(Wire):
    prompt_id: str
    sample_index: int
    reason: str


class SubmitResponse(Wire):
    accepted: list[RolloutRef]
    rejected: list[Rejection]


class ErrorBody(Wire):
    error: str
    detail: str
