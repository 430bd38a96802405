"""Prometheus metrics of one coordinator (its own registry, so several can live in one process)."""
from __future__ import annotations

from typing import Callable

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

NODE_STATES = ("online", "offline", "banned", "generating", "fetching", "idle", "starting", "stopping")


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
        self.assignments_issued = Counter("prime_assignments_issued", "assignments handed out", registry=r)
        self.assignments_expired = Counter("prime_assignments_expired", "assignments past their deadline", registry=r)
        self.eval_reward = Gauge("prime_eval_reward", "mean reward of greedy decoding on the held-out prompts, "
                                 "at the newest evaluated step (eval.every_steps)", registry=r)
        self.eval_step = Gauge("prime_eval_step", "policy step of the newest evaluation", registry=r)
        self.verify_jobs = Gauge("prime_verify_jobs", "verifier pool jobs, waiting for a verifier or leased",
                                 ["state"], registry=r)
        self.verify_jobs_rehanded = Counter("prime_verify_jobs_rehanded", "verifier pool jobs handed out again "
                                            "after their lease ran out (a verifier died or was too slow)", registry=r)
        # batch health (node/coordinator/batch_health.py): groups offered to the trainer, usable or not and why
        self.groups_usable = Counter("prime_groups_usable", "groups the trainer took into a batch", registry=r)
        self.groups_unusable = Counter("prime_groups_unusable", "groups the trainer could not use, by reason "
                                       "(all_rewards_zero, all_rewards_equal, stale, rejected, filtered)", ["reason"],
                                       registry=r)
        self.batch_usable = Gauge("prime_batch_groups_usable", "usable groups of the batch being collected", registry=r)
        self.batch_needed = Gauge("prime_batch_groups_needed", "groups a batch needs (run.batch_prompts)", registry=r)
        self.batch_unusable = Gauge("prime_batch_groups_unusable", "unusable groups offered to the batch being "
                                    "collected, by reason", ["reason"], registry=r)
        self.groups_unusable_in_a_row = Gauge("prime_groups_unusable_in_a_row", "unusable groups since the last "
                                              "usable one (run.stall_warn_groups of them: a WARNING)", registry=r)
        self.requests = Counter("prime_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.failed = Gauge("prime_coordinator_failed", "1 when the named background task or thread died and the "
                            "coordinator stopped handing out work (node/coordinator/supervisor.py)", ["component"],
                            registry=r)

    def watch_p2p(self, snapshot: Callable[[], dict]) -> None:
        """Export the libp2p host's counters (node/p2p/stats.py `P2PStats.snapshot`), read at each scrape.
        Per reason only: per-peer counts go to the log, one line per peer (a label per peer id would grow with
        the swarm)."""
        self.registry.register(_P2PCollector(snapshot))

    def watch_nodes(self, by_state: Callable[[], dict[str, int]], max_age_s: float = 1.0) -> None:
        """Export `prime_nodes{state}` from `by_state()` (the ledger's node summary), read at a scrape and at
        most once per `max_age_s` however often /metrics is scraped."""
        self.registry.register(_NodesCollector(by_state, max_age_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _P2PCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []  # no samples at registration: the host may not be serving yet

    def collect(self):
        snap = self.snapshot()
        for name, key, doc in (
                ("prime_p2p_announcements_dropped", "announcements_dropped", "gossip announcements dropped, by reason"),
                ("prime_p2p_announcements_received", "announcements_received", "gossip announcements delivered, by kind"),
                ("prime_p2p_requests_refused", "requests_refused", "shard requests refused, by reason"),
                ("prime_p2p_streams_aborted", "streams_aborted", "shard streams cut, by reason")):
            family = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in sorted(snap.get(key, {}).items()):
                family.add_metric([str(reason)], n)
            yield family
        yield CounterMetricFamily("prime_p2p_bytes_served", "shard bytes served to peers", value=snap.get("bytes_served", 0))
        yield CounterMetricFamily("prime_p2p_bytes_fetched", "shard bytes fetched from peers",
                                  value=snap.get("bytes_fetched", 0))


class _NodesCollector:
    def __init__(self, by_state: Callable[[], dict[str, int]], max_age_s: float):
        self.by_state, self.max_age_s = by_state, max_age_s
        self._cached: tuple[float, dict[str, int]] | None = None

    def describe(self):
        return []  # no samples at registration: the ledger is read at a scrape

    def collect(self):
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.max_age_s:
            self._cached = (now, self.by_state())
        family = GaugeMetricFamily("prime_nodes", "nodes by state", labels=["state"])
        by_state = self._cached[1]
        for state in (*NODE_STATES, *sorted(set(by_state) - set(NODE_STATES))):  # e.g. "joined": not yet heard from
            family.add_metric([state], by_state.get(state, 0))
        yield family
