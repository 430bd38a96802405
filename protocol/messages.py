"""Pydantic models of every request and response body (docs/PROTOCOL.md, "HTTP API" and "Work and
submissions").

Every model forbids unknown fields and bounds every value: each integer and float has an explicit range
(floats are finite), each string, list and dict a maximum length. A hostile body is rejected with a clear
400 before any work is done on it, and nothing a peer sends can grow into a number or a document that
later breaks a response (a 4,300-digit byte counter once made GET /v1/status fail for good). The same
models parse the coordinator's answers on the worker's side. Field names and shapes are the wire
contract; `node/coordinator/openapi.py` publishes their JSON schemas as GET /openapi.json.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Sequence, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_PROMPT_TOKENS = 32_768
MAX_COMPLETION_TOKENS = 32_768
MAX_PROMPTS_PER_ASSIGNMENT = 256
MAX_GROUP_SIZE = 256
MAX_ROLLOUTS_PER_SUBMISSION = 4096
MAX_COMMITMENT_CHARS = 4 * 1024 * 1024
MAX_ID_CHARS = 128
MAX_TURNS = 16  # model turns of a multi-turn episode
MAX_ENV_TOKENS = 4096  # one environment turn (node/envs/episode.py)
MAX_ENV_STATE_CHARS = 64 * 1024  # a multi-turn problem's answer, as JSON text
MAX_REASON_CHARS = 64
MAX_DETAIL_CHARS = 1024  # an error's human sentence (node/http.py cuts longer ones)
MAX_ADDRS = 64  # p2p bootstrap addresses / relay URLs in a run spec
MAX_ADDR_CHARS = 2048
MAX_TOKENIZER_FILES = 16
MAX_TOKENIZER_FILE_CHARS = 16 * 1024 * 1024  # the coordinator ships files below 16 MiB only
MAX_MODEL_CONFIG_BYTES = 1024 * 1024  # a Hugging Face config.json is a few KiB
MAX_MODEL_CONFIG_DEPTH = 16

MAX_STEP = 2**31 - 1  # policy steps, async levels, token ids: far above any run, a C int
MAX_COUNTER = 2**63 - 1  # byte counters, seeds, Unix milliseconds: an int64
MAX_TOKENS_PER_SECOND = 1e9
MIN_LOGPROB = -1e6  # a sampled token's log-probability is far above this; -inf is refused

TokenId = Annotated[int, Field(ge=0, le=MAX_STEP)]
Seed = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
UnixMs = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
SampleIndex = Annotated[int, Field(ge=0, lt=MAX_GROUP_SIZE)]
ShortStr = Annotated[str, Field(max_length=MAX_ID_CHARS)]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
Reason = Annotated[str, Field(min_length=1, max_length=MAX_REASON_CHARS)]
Addr = Annotated[str, Field(max_length=MAX_ADDR_CHARS)]


def _bounded_json(v: Any) -> Any:
    """A free-form JSON document (the model's config.json): at most MAX_MODEL_CONFIG_DEPTH levels and
    MAX_MODEL_CONFIG_BYTES as JSON, finite numbers, integers within int64."""
    stack = [(v, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_MODEL_CONFIG_DEPTH:
            raise ValueError(f"nested deeper than {MAX_MODEL_CONFIG_DEPTH} levels")
        if isinstance(x, dict):
            stack.extend((y, depth + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, depth + 1) for y in x)
        elif isinstance(x, bool) or x is None or isinstance(x, str):
            pass
        elif isinstance(x, int):
            if not -MAX_COUNTER - 1 <= x <= MAX_COUNTER:
                raise ValueError("an integer is outside int64")
        elif not isinstance(x, float):
            raise ValueError(f"{type(x).__name__} is not a JSON value")
    try:
        size = len(json.dumps(v, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a finite JSON document: {e}") from None
    if size > MAX_MODEL_CONFIG_BYTES:
        raise ValueError(f"{size} bytes as JSON (limit {MAX_MODEL_CONFIG_BYTES})")
    return v


BoundedJson = Annotated[dict[Annotated[str, Field(max_length=MAX_ID_CHARS)], Any],
                        Field(max_length=4096), AfterValidator(_bounded_json)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_M = TypeVar("_M", bound=BaseModel)


class WireError(ValueError):
    """Bytes from a remote party that are not the document they should be. The message names the model and
    the first broken field, never the transport (the caller adds which source sent it)."""


def decode(model: type[_M], body: bytes, *, limit: int) -> _M:
    """The one deserializer between remote bytes and typed objects (every answer a node reads from a
    coordinator, relay or peer comes through here): at most `limit` bytes, refused before parsing; then
    pydantic's JSON parser (native code: nesting is bounded there, so `"[" * 100000` is a validation error,
    not a RecursionError) and the model (extra="forbid", every value bounded). Raises WireError and nothing
    else: RecursionError and MemoryError are caught too, should a parser ever recurse in Python."""
    if len(body) > limit:
        raise WireError(f"{model.__name__}: {len(body)} bytes, more than the {limit}-byte limit")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        loc, msg = (errors[0]["loc"], errors[0]["msg"]) if errors else ((), "invalid")
        where = ".".join(str(x) for x in loc) or "document"
        raise WireError(f"not a valid {model.__name__}: {where}: {msg}"[:300]) from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise WireError(f"not a valid {model.__name__}: {type(e).__name__}") from None


# --- join / heartbeat ------------------------------------------------------------------------------
Port = Annotated[int, Field(ge=1, le=65535)]


class ListenPorts(Wire):
    """The TCP ports a node listens on, for the coordinator's dial-back at join (docs/P2P.md "Reachability").
    Ports only: the coordinator dials the address it saw the join come from, never one a node names."""
    libp2p: Port | None = None
    http: Port | None = None  # the HTTP shard server (p2p.http)


class NodeInfo(Wire):
    name: Annotated[str, Field(max_length=64)] | None = None
    backend: Annotated[str, Field(max_length=32)] | None = None
    device: Annotated[str, Field(max_length=64)] | None = None
    p2p_addrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=8)] = []
    listen_ports: ListenPorts | None = None


class Reachability(Wire):
    """What the coordinator found at join: the address the join came from, and per listed port whether a
    fresh TCP connection to that address and port succeeded (null: not tried, e.g. no port listed, the
    per-address dial-back limit, or an address the coordinator's policy does not dial)."""
    observed_ip: Annotated[str, Field(max_length=45)]  # an IPv4 or IPv6 literal (45 = longest IPv6 text)
    libp2p: bool | None = None
    http: bool | None = None


class JoinRequest(Wire):
    node: NodeInfo | None = None
    pow: Annotated[str, Field(max_length=64)] | None = None  # open runs: proof of work (protocol.admission)
    token: Annotated[str, Field(max_length=2048)] | None = None  # token runs: a join token from the operator


class AdmissionInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    mode: Literal["open", "allowlist", "token"] = "open"
    pow_bits: Annotated[int, Field(ge=0, le=24)] = 0  # bounded: a worker solves what the status asks for
    pow_log2_n: Annotated[int, Field(ge=1, le=16)] = 14  # scrypt's N = 2**pow_log2_n (protocol/admission.py)


class RunInfo(BaseModel):
    """What a client reads from GET /v1/status before its first signed request (the rest is ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    run_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    coordinator_key: HexKey
    admission: AdmissionInfo = AdmissionInfo()
    # Content-Encodings the coordinator takes for a signed request's body ("zstd"); none from one that predates them
    body_encodings: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=8)] = []


class RunSpec(Wire):
    run_id: RunId
    node_id: HexKey
    coordinator_key: HexKey
    task: ShortStr
    async_level: Step
    current_step: Step
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
    model_config_json: BoundedJson  # the HF config.json of the policy (weights come as checkpoints)
    # file name -> text content (small: tokenizer.json etc.)
    tokenizer_files: Annotated[dict[ShortStr, Annotated[str, Field(max_length=MAX_TOKENIZER_FILE_CHARS)]],
                               Field(max_length=MAX_TOKENIZER_FILES)]
    eos_token_id: TokenId
    checkpoint_dtype: Annotated[str, Field(max_length=32)]
    p2p_bootstrap: Annotated[list[Addr], Field(max_length=MAX_ADDRS)] = []
    relays: Annotated[list[Addr], Field(max_length=MAX_ADDRS)] = []
    # Multi-turn tasks (max_turns > 1): the worker runs the task's environment, built from these
    task_kwargs: BoundedJson = {}
    max_turns: Annotated[int, Field(ge=1, le=MAX_TURNS)] = 1
    reachability: Reachability | None = None  # the join's dial-back (NodeInfo.listen_ports)

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, protected_namespaces=())


class HeartbeatRequest(Wire):
    policy_step: Step | None = None
    tokens_per_second: Annotated[float, Field(ge=0, le=MAX_TOKENS_PER_SECOND)] = 0.0
    steps_held: Annotated[list[Step], Field(max_length=64)] = []
    state: Literal["starting", "fetching", "generating", "idle", "stopping"] = "idle"
    bytes_by_source: Annotated[dict[Literal["coordinator", "relay", "peer"], Counter], Field(max_length=3)] = {}


class HeartbeatResponse(Wire):
    current_step: Step
    banned: bool = False


# --- work ------------------------------------------------------------------------------------------
class WorkRequest(Wire):
    policy_step: Step


class Sampling(Wire):
    temperature: Annotated[float, Field(ge=0, le=100)]
    top_p: Annotated[float, Field(ge=0, le=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)]


class PromptWork(Wire):
    prompt_id: ShortStr
    prompt_ids: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
    seeds: Annotated[list[Seed], Field(max_length=MAX_GROUP_SIZE)]
    # Multi-turn tasks only: the problem's answer as JSON text, which the worker's environment needs
    env_state: Annotated[str, Field(max_length=MAX_ENV_STATE_CHARS)] | None = None


class Assignment(Wire):
    assignment_id: ShortStr
    batch_step: Step
    min_policy_step: Step
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
    sampling: Sampling
    deadline_ms: UnixMs
    prompts: Annotated[list[PromptWork], Field(max_length=MAX_PROMPTS_PER_ASSIGNMENT)]


class NoWork(Wire):
    """POST /v1/work's 204 (no work now), its one field sent as the header `X-Prime-Retry-After-Ms`: ask again after
    this many ms, or as soon as a new step is held (node/coordinator/pacing.py says how the coordinator picks it).
    The heartbeat's 200 carries the same header, read through this model: when to send the next heartbeat."""
    retry_after_ms: Annotated[int, Field(ge=100, le=120_000)]


# --- submit ----------------------------------------------------------------------------------------
class ModelTurnWire(Wire):
    """What the model sampled in one turn, with its evidence."""
    completion_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)]
    logprobs: Annotated[list[Annotated[float, Field(ge=MIN_LOGPROB, le=0.0)]], Field(max_length=MAX_COMPLETION_TOKENS)]
    finish_reason: Literal["stop", "length"]
    commitment: Annotated[str, Field(max_length=MAX_COMMITMENT_CHARS)]

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> "ModelTurnWire":
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError("one logprob per completion token is required")
        return self


class EnvTurn(ModelTurnWire):
    """A multi-turn episode's next step: the environment's tokens, then the model's turn after them."""
    env_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ENV_TOKENS)]


def wire_logprobs(logprobs: Sequence[float]) -> list[float]:
    """Logprobs as a worker sends them: each value with 9 significant digits, which give every float32 back exactly
    (float32(sent) == float32(engine's): engines sample in float32, and the verifier and the trainer read float32).
    As Python floats from float32 they print 17 digits: 20.7 of a real submission's 37.5 bytes a token, 13.4 so
    (bench/submit_bytes.py)."""
    return [float("%.9g" % x) for x in logprobs]


class RolloutSubmission(ModelTurnWire):
    """One sample: the model's first turn (top-level fields) and, for multi-turn tasks, the turns after it."""
    prompt_id: ShortStr
    sample_index: SampleIndex
    turns: Annotated[list[EnvTurn], Field(max_length=MAX_TURNS - 1)] = []


class SubmitRequest(Wire):
    assignment_id: ShortStr
    policy_step: Step
    rollouts: Annotated[list[RolloutSubmission], Field(min_length=1, max_length=MAX_ROLLOUTS_PER_SUBMISSION)]


class RolloutRef(Wire):
    prompt_id: ShortStr
    sample_index: SampleIndex


class Rejection(Wire):
    prompt_id: ShortStr
    sample_index: SampleIndex
    reason: Reason


class SubmitResponse(Wire):
    accepted: Annotated[list[RolloutRef], Field(max_length=MAX_ROLLOUTS_PER_SUBMISSION)]
    rejected: Annotated[list[Rejection], Field(max_length=MAX_ROLLOUTS_PER_SUBMISSION)]


# --- the verifier pool (POST /v1/verify/jobs, POST /v1/verify/verdicts; verifier keys only; docs/PROTOCOL.md) -
MAX_JOB_ITEMS = 4096 * MAX_TURNS  # one job is one submission's model turns (one per single-turn rollout)


class VerifyJobsRequest(Wire):
    """A verifier asks for work; `spec` asks for the run facts it needs first (model config, keys)."""
    spec: bool = False


class VerifierSpec(Wire):
    run_id: RunId
    coordinator_key: HexKey
    model_config_json: BoundedJson
    eos_token_id: TokenId
    async_level: Step
    checkpoint_dtype: Annotated[str, Field(max_length=32)]
    relays: Annotated[list[Addr], Field(max_length=MAX_ADDRS)] = []

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, protected_namespaces=())


class ReplayItem(Wire):
    """One rollout to replay, with the seed the coordinator gave for it."""
    prompt_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    completion_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)]
    logprobs: Annotated[list[Annotated[float, Field(ge=MIN_LOGPROB, le=0.0)]], Field(max_length=MAX_COMPLETION_TOKENS)]
    finish_reason: Literal["stop", "length"]
    commitment: Annotated[str, Field(max_length=MAX_COMMITMENT_CHARS)]
    seed: Seed

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> "ReplayItem":
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError("one logprob per completion token is required")
        return self


class VerifyJob(Wire):
    job_id: ShortStr
    policy_step: Step
    sampling: Sampling
    lease_ms: UnixMs  # answer before this (coordinator clock), or the job goes to another verifier
    items: Annotated[list[ReplayItem], Field(min_length=1, max_length=MAX_JOB_ITEMS)]


class VerifyJobsResponse(Wire):
    spec: VerifierSpec | None = None
    job: VerifyJob | None = None


class ReplayVerdict(Wire):
    reason: Annotated[str, Field(pattern=r"^verify_[a-z_]{1,48}$")] | None  # None: the replay passed
    tokens: Counter
    near_ties: Counter
    outlier: bool = False  # failed by one sampled token only (possibly numerical)
    # mean |claimed - recomputed| logprob x T under the job's step: the stale-step audit compares it across steps
    # (node/coordinator/stale_audit.py); None from verifiers that predate it
    fit: Annotated[float, Field(ge=0.0, le=1e6)] | None = None


class VerdictsRequest(Wire):
    job_id: ShortStr
    verdicts: Annotated[list[ReplayVerdict], Field(max_length=MAX_JOB_ITEMS)] = []
    unavailable: bool = False  # the verifier could not get the step's weights: no verdicts, the job is passed over

    @model_validator(mode="after")
    def _verdicts_or_unavailable(self) -> "VerdictsRequest":
        if self.unavailable == bool(self.verdicts):
            raise ValueError("send one verdict per rollout, or unavailable = true and no verdicts")
        return self


class VerdictsResponse(Wire):
    accepted: bool


class ErrorBody(Wire):
    """Every 4xx/5xx answer of the coordinator and the relays (docs/PROTOCOL.md, "HTTP API"): servers build it,
    clients parse it."""

    error: Annotated[str, Field(min_length=1, max_length=MAX_REASON_CHARS)]
    detail: Annotated[str, Field(max_length=MAX_DETAIL_CHARS)]

    @classmethod
    def of(cls, code: str, detail: str) -> "ErrorBody":
        """A server's error: a sentence longer than MAX_DETAIL_CHARS is cut (it never grows with the input)."""
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[:MAX_DETAIL_CHARS - 1] + "…"
        return cls(error=code, detail=detail)

    @classmethod
    def parse(cls, body: bytes) -> "ErrorBody | None":
        """A client's view of an error answer: None when the body is not an ErrorBody (a proxy's page)."""
        try:
            return cls.model_validate_json(body)
        except ValueError:
            return None


# --- public GET answers (documented in GET /openapi.json) -------------------------------------------
MAX_LISTED_STEPS = 4096  # the coordinator keeps its async window plus a delta chain, far fewer
MAX_SHARDS = 99_999


MAX_LISTING_BYTES = 1024 * 1024  # MAX_LISTED_STEPS entries are ~1 MB at most; an honest one is a few KiB


class CheckpointInfo(Wire):
    step: Step
    encoding: ShortStr  # "full" | "xor-delta" | "sparse-delta" (docs/PROTOCOL.md may add encodings)
    base_step: Step | None
    num_shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)]
    total_size: Counter
    compressed_size: Counter
    manifest_hash: HexKey  # sha256 hex of the canonical manifest without its signature

    @model_validator(mode="after")
    def _base_before_step(self) -> "CheckpointInfo":
        # A fetcher follows base steps back to a full one: each must be strictly older, or it would loop.
        if (self.encoding == "full") != (self.base_step is None):
            raise ValueError("base_step is null exactly when encoding is 'full'")
        if self.base_step is not None and self.base_step >= self.step:
            raise ValueError(f"base_step {self.base_step} is not before step {self.step}")
        return self


class CheckpointList(Wire):
    """GET /v1/checkpoints: the steps a node may fetch (committed to the ledger), newest first served.
    `newest` is null while nothing is published."""

    steps: Annotated[list[Step], Field(max_length=MAX_LISTED_STEPS)]
    newest: Step | None
    checkpoints: Annotated[list[CheckpointInfo], Field(max_length=MAX_LISTED_STEPS)]

    @model_validator(mode="after")
    def _one_entry_per_step(self) -> "CheckpointList":
        if len({c.step for c in self.checkpoints}) != len(self.checkpoints):
            raise ValueError("a step is listed twice")
        return self

    def by_step(self) -> dict[int, CheckpointInfo]:
        return {c.step: c for c in self.checkpoints}


class StatusResponse(RunInfo):
    """GET /v1/status. A client relies on these fields (RunInfo is what it parses before joining); the
    rest of the document (nodes, throughput, staleness, verification counts, reward curve, ...) is for
    the dashboard and may grow (parsed, it is dropped: whatever a model keeps is bounded)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    admission: AdmissionInfo
    step: Step
    async_level: Step
    checkpoints: Annotated[list[CheckpointInfo], Field(max_length=MAX_LISTED_STEPS)]
