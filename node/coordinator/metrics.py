"""Prometheus metrics of one coordinator (its own registry, so several can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class CoordinatorMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.step = Gauge("prime_step", "newest published policy step", registry=r)
        self.trainer_busy = Gauge("prime_trainer_busy_seconds", "seconds the trainer spent working", registry=r)
        self.trainer_idle = Gauge("prime_trainer_idle_seconds", "seconds the trainer waited for data", registry=r)
        self.accepted = Counter("prime_rollouts_accepted", "rollouts accepted", registry=r)
        self.rejected = Counter("prime_rollouts_rejected", "rollouts rejected, by reason", ["reason"], registry=r)
        self.verified = Counter("prime_rollouts_verified", "rollouts replayed by the verifier", registry=r)
        self.staleness = Histogram("prime_rollout_staleness", "staleness (steps) of accepted groups",
                                   buckets=(0, 1, 2, 3, 4, 8), registry=r)
        self.bytes_served = Counter("prime_checkpoint_bytes_served", "checkpoint bytes served over HTTP", registry=r)
        self.nodes = Gauge("prime_nodes", "nodes by state", ["state"], registry=r)
        self.assignments_issued = Counter("prime_assignments_issued", "assignments handed out", registry=r)
        self.assignments_expired = Counter("prime_assignments_expired", "assignments past their deadline", registry=r)
        self.eval_reward = Gauge("prime_eval_reward", "mean reward of greedy decoding on the held-out prompts, "
                                 "at the newest evaluated step (eval.every_steps)", registry=r)
        self.eval_step = Gauge("prime_eval_step", "policy step of the newest evaluation", registry=r)
        self.requests = Counter("prime_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
