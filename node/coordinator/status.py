"""GET /v1/status: one JSON document that the dashboard and the demo's summary read.

Composed from what each component says of itself: the training loop's TrainerSnapshot, the verifier pool's
PoolSnapshot, the ledger's queries, the byte table's totals. Building it changes nothing: the Prometheus
gauges are read by the components' own collectors at a scrape (node/coordinator/metrics.py), never set here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from node.coordinator.ledger import NodeRow, now_ms
from node.http import BODY_ENCODING

if TYPE_CHECKING:
    from node.coordinator.service import Coordinator

CURVE_POINTS = 1000  # a long run's reward curve is thinned to this many points (the newest always kept)
LISTED_NODES = 200  # the node table lists the most recently seen nodes; counts cover all of them
LISTED_SINCE_MS = 10 * 60_000  # ...that did work, or were seen in the last ten minutes


@dataclass(frozen=True)
class TrainerSnapshot:
    """The training loop as /v1/status shows it: TrainingLoop.snapshot() in this process, or the engine
    process's last Snapshot message (node/coordinator/engine_client.py)."""

    busy: bool
    busy_seconds: float
    idle_seconds: float
    error: str | None  # why the training thread died, if it did
    last_metrics: dict
    batch_health: dict  # batch_health.BatchHealth.snapshot()
    eval_curve: list[dict] | None  # None: eval.every_steps = 0

    @property
    def idle_fraction(self) -> float:
        total = self.busy_seconds + self.idle_seconds
        return self.idle_seconds / total if total > 0 else 0.0


def thin(rows: list, limit: int) -> list:
    if len(rows) <= limit:
        return rows
    stride = -(-len(rows) // limit)
    return rows[-1::-stride][::-1]


def node_state(n: NodeRow, t: int, online_ms: int) -> str:
    if n.banned:
        return "banned"
    if t - n.last_seen_ms > online_ms:
        return "offline"
    return n.state or "online"


def build_status(c: Coordinator) -> dict:
    t = now_ms()
    tl = c.training.snapshot()
    published = c.published_step
    steps = c.ledger.steps()
    online_ms = c.online_ms()  # three heartbeat periods, which the coordinator paces (node/coordinator/pacing.py)
    summary = c.ledger.node_summary(t - online_ms, published)
    nodes = c.ledger.recent_nodes(t - LISTED_SINCE_MS, LISTED_NODES)
    hist: Counter[int] = Counter()
    for row in steps:
        for s, n in row.metrics.get("staleness_hist", {}).items():
            hist[int(s)] += n
    bytes_by_source = c.node_bytes.totals()
    counts = c.ledger.counts()
    verdicts = c.ledger.verdict_counts()
    return {
        "run_id": c.cfg.run.run_id,
        "coordinator_key": c.identity.public_hex,
        "admission": {"mode": c.cfg.admission.mode, "pow_bits": c.cfg.admission.pow_bits,
                      "pow_log2_n": c.cfg.admission.pow_log2_n},
        "body_encodings": [BODY_ENCODING],  # a signed request's body may be sent compressed so (docs/PROTOCOL.md)
        "step": published,
        # null, or which background task or thread died and why: no work is handed out (supervisor.py)
        "failed": c.failure.as_json() if c.failure is not None else None,
        "async_level": c.k,
        "window": {"training_batch": published + 1,
                   "open_batches": list(c.scheduler.open_batches()),
                   "min_policy_step": max(0, published - c.k)},
        "trainer": {"busy": tl.busy, "busy_seconds": round(tl.busy_seconds, 3),
                    "idle_seconds": round(tl.idle_seconds, 3), "idle_fraction": round(tl.idle_fraction, 4),
                    "error": tl.error, "last_metrics": tl.last_metrics},
        "nodes": [{
            "node_id": n.node_id, "short_id": n.node_id[:8], "state": node_state(n, t, online_ms),
            "policy_step": n.policy_step, "tokens_per_s": round(n.tokens_per_s, 1),
            "accepted": n.accepted, "rejected": n.rejected, "reputation": round(n.reputation, 3),
            "last_seen_ms": n.last_seen_ms,
            # the join's dial-back of its libp2p port (reachability.py): null = not tried or not since we started
            "reachable": c.dialback.reachable(n.node_id),
            # holds a reservation on our relay hop: peers reach it through us, so it gets first copies too
            "relayed": n.node_id in c.relay_reserved,
        } for n in nodes],
        "nodes_total": summary["total"],
        "nodes_by_state": summary["by_state"],
        "nodes_with_newest": summary["with_newest"],
        "throughput": {"tokens_per_s": round(summary["tokens_per_s"], 1)},
        "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
        # the batch being collected: usable groups vs needed, the unusable ones by reason, the streak of
        # unusable ones and, past run.stall_warn_groups, the warning with its likely cause (batch_health.py)
        "batch_health": tl.batch_health,
        "verification": {"accepted": counts["accepted_rollouts"], "rejected": counts["rejected_rollouts"],
                         "rejected_by_reason": c.ledger.rejection_counts(),
                         "undecided_submissions": c.verdicts.pending(),
                         "groups_by_verdict": verdicts,
                         **({"pool": asdict(c.verifier_board.snapshot())} if c.verifier_board is not None else {})},
        "reward_curve": [{"step": r.step, "reward": r.metrics.get("reward_mean")}
                         for r in thin([r for r in steps if r.step > 0], CURVE_POINTS)],
        # optional: present when eval.every_steps > 0 (node/coordinator/evaluation.py)
        **({"eval_curve": [{"step": e["step"], "reward": e["reward"], "n": e["n"]}
                           for e in thin(tl.eval_curve, CURVE_POINTS)]}
           if tl.eval_curve is not None else {}),
        "step_log": [{"step": r.step, "published_ms": r.published_ms, "encoding": r.encoding,
                      "compressed_bytes": r.compressed_bytes, "loss_tokens": r.metrics.get("loss_tokens", 0),
                      "idle_seconds": r.metrics.get("idle_seconds", 0.0), "busy_seconds": r.metrics.get("busy_seconds", 0.0),
                      "publish_seconds": r.metrics.get("publish_seconds", 0.0), "max_staleness": r.metrics.get("max_staleness", 0)}
                     for r in steps[-200:]],
        "checkpoints": c.checkpoints.listing(),
        # node-reported counters: each is bounded on the wire, their sum is clamped to what JSON readers take
        "checkpoint_bytes_by_source": {k: min(bytes_by_source.get(k, 0), 2**63 - 1)
                                       for k in ("coordinator", "relay", "peer")},
        "bytes_served": int(sum(c.bytes_by_source.values())),
        "recent_rejections": [{"at_ms": r.at_ms, "node": r.node_id[:8], "reason": r.reason,
                               "prompt_id": r.prompt_id, "sample_index": r.sample_index}
                              for r in c.ledger.recent_rejections(20)],
        "uptime_s": round((t - c.started_ms) / 1000, 1),
    }

