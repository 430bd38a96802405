"""One typed config tree, loaded from TOML with `--set a.b=value` overrides.

Every section forbids unknown keys, so a typo is a clear error at start-up rather than a silently
ignored setting. Role-specific sections live beside their role (trainer/worker/p2p config.py).
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from node.p2p.config import P2PConfig
from node.trainer.config import TrainerConfig
from node.worker.config import WorkerConfig
from protocol.errors import PrimeNodeError
from protocol.identity import parse_public_key


class ConfigError(PrimeNodeError):
    pass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = pick a free port
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    rate_limit_per_second: float = Field(50.0, gt=0)
    rate_limit_burst: int = Field(200, ge=1)
    log_format: str = Field("plain", pattern="^(plain|json)$")
    # A connection is closed when its request headers have not all arrived within header_timeout_s of
    # the connection (or of the previous answer: an idle keep-alive connection is closed after it too),
    # and a request is answered 408 when its body has not arrived within body_timeout_s: a slow sender
    # cannot hold a connection or a handler for long.
    header_timeout_s: float = Field(10.0, gt=0, le=600)
    body_timeout_s: float = Field(60.0, gt=0, le=3600)
    # Connection limits (node/http.py ConnectionLimits): connections open at once from one client address
    # (more: 429 + Retry-After before the request is read; nodes behind one NAT share it, and the demo, whose
    # nodes all come from 127.0.0.1, raises it); a response the client takes slower than min_send_rate
    # bytes/s, once send_grace_s of credit is used up, is cut (a never-reader: ~send_grace_s after its
    # buffers fill; an honest 20 Mbit/s home uplink is ~150x the floor).
    max_connections_per_address: int = Field(32, ge=1, le=1_000_000)
    min_send_rate: int = Field(16 * 1024, ge=1024, le=1 << 30)
    send_grace_s: float = Field(10.0, gt=0, le=600)
    # Request body bytes read at once over all connections (a request reserves its Content-Length before
    # its body is read, after its key, clock and rate limit passed); above it: 503 + Retry-After.
    max_body_bytes_in_flight: int = Field(64 * 1024 * 1024, ge=1024)
    # When a background task or the training thread dies (node/coordinator/supervisor.py) the coordinator
    # stops handing out work (503 with the reason) and, with exit_on_failure, exits with status 1 so that a
    # process manager restarts it (a restart resumes from the ledger). false: it stays up, failed, showing why.
    exit_on_failure: bool = True
    # On stop, how long to wait for the training thread to finish the step in progress before the trainer's
    # other ranks (trainer.ranks > 1) are killed; a step cut short is redone after a restart.
    stop_timeout_s: float = Field(5.0, gt=0, le=3600)
    # Training, evaluation, publishing and the coordinator's own replays run in a child process, the engine
    # (node/coordinator/engine.py, docs/ARCHITECTURE.md "Processes"): the process that serves HTTP runs nothing
    # of torch, so a training step never holds the GIL that requests wait on. The default because of what that
    # GIL costs: bench/load.py at 1,000 simulated nodes with training, p99 4,268 ms in one process against 611 and
    # 44.6 ms (two runs) with the engine, API-process CPU 2.50 against 0.87 ms per request (docs/BENCHMARKS.md,
    # "Training in its own process"); the price, one more Python importing torch, ~8 s of CPU at start on 2 cores.
    # false: one process (needed for a model directory the torch-free tokenizer refuses: node/coordinator/run_model.py).
    # With a verifier pool (verification.verifier_keys) the API process hands the pool its jobs, and the engine
    # replays what no pool verifier could do.
    engine_process: bool = True
    # The engine process's niceness (added to this process's), from its Ready on: requests are served first and
    # training takes the CPU they leave (the restore, θ_0 and the warm start, before any request, run un-niced).
    # On a box with fewer cores than runnable threads, an engine at the API's priority made p99 no better than one
    # process (bench/load.py --layout, docs/ARCHITECTURE.md "Processes").
    engine_nice: int = Field(10, ge=0, le=19)
    # How often all idle nodes together ask for work: a 204 from POST /v1/work tells a node to wait
    # (idle nodes / this) seconds, 0.25-60 s (node/coordinator/pacing.py); a new step wakes it at once.
    idle_work_requests_per_s: float = Field(200.0, ge=1.0, le=1_000_000.0)
    # How often all nodes together heartbeat: the answer tells a node when to send the next one, (nodes / this)
    # seconds within 5-30 s, and a node counts as online for three of those periods.
    heartbeats_per_s: float = Field(200.0, ge=1.0, le=1_000_000.0)


class StorageConfig(_Section):
    dir: str = "prime-node-data"
    # The ledger keeps this many newest rejection rows (status shows the newest 20); older ones are folded
    # into per-reason totals, so a flood of refused work cannot grow it without bound (issue #25).
    keep_rejections: int = Field(1000, ge=20, le=10_000_000)


class RunConfig(_Section):
    run_id: str = Field("local", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    async_level: int = Field(2, ge=0, le=16)
    batch_prompts: int = Field(8, ge=1)  # prompts (groups) per training batch
    group_size: int = Field(4, ge=1, le=256)  # G samples per prompt
    prompts_per_assignment: int = Field(2, ge=1)
    assignment_deadline_seconds: float = Field(120.0, gt=0)
    max_steps: int = Field(0, ge=0)  # 0 = run until stopped
    seed: int = 0
    stream_groups: bool = False  # k = 0 periodic asynchrony: train on groups as they arrive
    max_assignments_per_node: int = Field(2, ge=1, le=1024)  # in flight at once (more: 429, wait for one to end)
    # A declined assignment (submitted with a policy step outside the window) keeps one of the node's
    # max_assignments_per_node slots this long (never past its own deadline): declining is not a free way to
    # cycle work (docs/PROTOCOL.md, "Declined work"). 0 = the slot comes back at once.
    decline_hold_seconds: float = Field(30.0, ge=0, le=86_400)
    # A batch that cannot fill says why (docs/OPERATIONS.md, "The run is not stepping"): after this many
    # groups in a row that the trainer could not use (all rewards equal, stale, rejected, filtered), one
    # WARNING names the likely cause, repeated at most every stall_warn_interval_s while the streak lasts.
    # 0 = 4 x batch_prompts (four batches' worth: a hard task early in training drops many groups, and still steps).
    stall_warn_groups: int = Field(0, ge=0, le=10_000_000)
    stall_warn_interval_s: float = Field(60.0, ge=1, le=86_400)


class ModelConfig(_Section):
    path: str = ""  # a Hugging Face model directory; empty = build the tiny local model
    tiny_hidden_size: int = Field(64, ge=8)
    tiny_layers: int = Field(2, ge=1)
    tiny_heads: int = Field(4, ge=1)
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")


class TaskConfig(_Section):
    name: str = "reverse-text"  # a built-in task name or "package.module:Class"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(32, ge=1, le=32768)


class VerificationConfig(_Section):
    # Share of submissions replayed against the claimed weights, drawn in secret after the submission is
    # recorded; a node's first `new_node_submissions` are replayed at `new_node_fraction` (0 = no replays).
    fraction: float = Field(1.0, ge=0, le=1)
    new_node_submissions: int = Field(8, ge=0)
    new_node_fraction: float = Field(1.0, ge=0, le=1)
    reputation_start: float = Field(1.0, ge=-1e6, le=1e6)
    reputation_penalty: float = Field(0.25, ge=0, le=1e6)  # a structurally impossible rollout
    reputation_reward: float = Field(0.01, ge=0, le=1e6)  # a clean submission
    expiry_penalty: float = Field(0.05, ge=0, le=1e6)  # an assignment left to expire
    # A submission made stale by steps published while it was generated (an honest node's mishap: two clean
    # submissions pay it back). Claiming a step that was never published costs reputation_penalty.
    decline_penalty: float = Field(0.02, ge=0, le=1e6)
    ban_below: float = Field(0.0, ge=-1e6, le=1e6)  # (a verified forgery bans at once)
    # A replayed rollout off by one token alone (verify.rollouts.Thresholds.logprob_outlier_max): its group is
    # voided and the node pays this per such rollout; the rest of its submission goes on. Honest bf16 nodes do
    # this about once in 500 rollouts (bench/bf16_token_tail.py), 0.26 per 128-rollout submission: 0.005 against
    # the 0.01 a clean submission earns. A node doing it 4x as often, or lying on one token of many rollouts,
    # runs out of reputation.
    outlier_penalty: float = Field(0.02, ge=0, le=1e6)
    # Steering: a node whose replayed tokens are more often than this not the sampler's first choice by
    # more than noise (verify.rollouts.NEAR_TIE_MARGIN; honest <= 0.4 %) is banned, once it has this many
    # replayed tokens (bench/near_ties.py, docs/SECURITY.md).
    near_tie_max_rate: float = Field(0.02, ge=0, le=1)
    near_tie_min_tokens: int = Field(2000, ge=1)
    # Stale-step audit (node/coordinator/stale_audit.py): this share of verified submissions is replayed against
    # the claimed step - 1 too (one more replay per audited rollout); a node whose rollouts fit step - 1 better
    # in at least the sign test's threshold of a window of `stale_audit_window` is banned (verify_stale_step).
    # An honest node is flagged with probability <= stale_audit_alpha per window. 0 = off. A ban is for good and
    # a swarm audits many windows (10,000 nodes x 100 windows at 2.6e-4 each, the 16 / 1e-3 setting, would ban
    # ~260 honest nodes whose steps barely differ), so the default asks 30 of 32 (1.2e-7 per window): a stale node
    # is caught after ~32 audited rollouts instead of ~16 (~256 verified rollouts at the default fraction).
    stale_audit_fraction: float = Field(0.125, ge=0, le=1)
    stale_audit_window: int = Field(32, ge=8, le=1024)
    stale_audit_alpha: float = Field(1e-6, ge=1e-9, le=0.05)
    # The verifier pool (`prime-node verifier`): trusted processes whose keys are listed here replay the
    # chosen submissions instead of the coordinator; none listed = the coordinator replays in-process.
    verifier_keys: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(default_factory=list,
                                                                                  max_length=256)
    job_lease_seconds: float = Field(60.0, gt=0, le=3600)  # a job not answered by then goes to another verifier
    # A job a pool verifier answers `unavailable` (it cannot get the step) goes to another verifier; after this
    # many refusals, or when no other verifier takes it within a lease, the coordinator replays it itself:
    # never passed over to training (a forger cannot dodge replay by claiming a step a verifier lacks).
    unavailable_tries: int = Field(2, ge=1, le=16)
    pool: int = Field(0, ge=0, le=8)  # demo only: how many verifier processes `prime-node demo` starts


class DistributionConfig(_Section):
    origin_upload_limit: int = Field(0, ge=0)  # bytes/s for all uploads together; 0 = unlimited
    shard_size: int = Field(32 * 1024 * 1024, ge=4096)
    compression_level: int = Field(1, ge=1, le=22)
    full_every: int = Field(10, ge=1)  # a full checkpoint every N steps (and at step 0)
    relays: list[str] = Field(default_factory=list)
    # Super-seeding: a shard the origin began sending to a swarm node less than this many seconds ago
    # is refused (429 "seeded") to other swarm nodes, who get it from peers. 0 = off.
    super_seed_seconds: float = Field(10.0, ge=0)


class AdmissionConfig(_Section):
    """Who may join (docs/PROTOCOL.md, "Admission"). In every mode at most `joins_per_address_per_minute` joins
    per client address (429 above it)."""

    mode: str = Field("open", pattern="^(open|allowlist|token)$")
    # open: a new key's proof of work (protocol/admission.py), memory-hard: 2**pow_bits scrypt tries on average,
    # each of N = 2**pow_log2_n (r = 8: 128 KiB x 2**(pow_log2_n - 7)). Defaults: ~1.3 s of one core to join,
    # one ~40 ms, 16 MiB scrypt for the coordinator to check (at most 2 checks at once). 0 bits = no proof.
    pow_bits: int = Field(5, ge=0, le=24)
    pow_log2_n: int = Field(14, ge=1, le=16)
    joins_per_address_per_minute: int = Field(10, ge=1, le=1_000_000)
    allowlist: list[str] = Field(default_factory=list)  # allowlist: node ids (hex public keys)

    @field_validator("allowlist")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        try:
            for k in keys:
                parse_public_key(k)  # raises ValueError for anything but a public key
            return [k.lower() for k in keys]
        except ValueError as e:
            raise ValueError(f"admission.allowlist: {e}") from None


class EvalConfig(_Section):
    """Evaluation during training (node/coordinator/evaluation.py): every `every_steps` published steps
    (and for θ_0) the coordinator decodes `prompts` held-out prompts greedily with its current policy and
    scores them with the task's reward; 0 = off."""
    every_steps: int = Field(0, ge=0, le=1_000_000)
    prompts: int = Field(64, ge=1, le=4096)  # held out: a seed stream of the task that training never draws
    batch_size: int = Field(64, ge=1, le=4096)  # prompts decoded together


class DemoConfig(_Section):
    nodes: int = Field(2, ge=1, le=64)
    steps: int = Field(20, ge=1)


class Config(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    verification: VerificationConfig = Field(default_factory=VerificationConfig)
    distribution: DistributionConfig = Field(default_factory=DistributionConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    p2p: P2PConfig = Field(default_factory=P2PConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)


def coordinator_warnings(cfg: Config) -> list[str]:
    """Settings that run but hurt honest nodes: the coordinator logs each at start."""
    out = []
    replays = cfg.verification.fraction > 0 or (cfg.verification.new_node_fraction > 0
                                                and cfg.verification.new_node_submissions > 0)
    if replays and cfg.trainer.broadcast_dtype == "float32":
        out.append("trainer.broadcast_dtype = float32: nodes generating in bf16 (vLLM on GPUs, worker.dtype = "
                   "bfloat16) round the published weights themselves and the verifier does not, so as training "
                   "moves the weights their honest rollouts fail replay as forgeries (16 of 512 three steps on, "
                   "docs/BENCHMARKS.md). Keep it only if every node runs fp32; the default is bfloat16")
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value); the value is read as a TOML literal, else a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected dotted.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: empty key segment")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    parsed = [parse_override(item)[0] for item in overrides]
    if ["task", "name"] in parsed and not any(p[:2] == ["task", "kwargs"] for p in parsed):
        # a task's kwargs belong to the task named beside them: another task starts from its defaults
        data.get("task", {}).pop("kwargs", None)
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"invalid config: {problems}") from None


def dump_toml(cfg: BaseModel) -> str:
    """Serialise a config tree back to TOML (for child processes of the demo)."""
    lines: list[str] = []

    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        if isinstance(v, dict):  # unset (None) keys are left out: they mean "the default"
            return "{" + ", ".join(f"{k} = {lit(x)}" for k, x in v.items() if x is not None) + "}"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    for section, values in cfg.model_dump().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is not None:
                lines.append(f"{k} = {lit(v)}")
        lines.append("")
    return "\n".join(lines)
