"""Batch health: how many groups of the batch being collected the trainer could use, and why the others not.

A run whose every group is unusable (a real instruct model on an exact-match task: every reward 0) accepts
rollouts forever and never steps; this is what makes it say so, on /v1/status (`batch_health`), /metrics,
the dashboard, the demo's progress line and, after `run.stall_warn_groups` unusable groups in a row, one
WARNING naming the likely cause, repeated at most every `run.stall_warn_interval_s`.

Written by the training thread (usable / unusable groups as it offers them to the trainer) and by the
status builder (groups voided by verification, read from the ledger counts it fetches anyway); a lock
keeps the two apart. State is a fixed set of counters: nothing grows with the run.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

from node.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("prime_node.training")

# Why a group was not used. Order: the first ones are the commonest, and the tie-break for the warning.
ALL_ZERO, ALL_EQUAL, STALE, REJECTED, FILTERED = "all_rewards_zero", "all_rewards_equal", "stale", "rejected", "filtered"
REASONS = (ALL_ZERO, ALL_EQUAL, STALE, REJECTED, FILTERED)

# The likely cause of a streak, by its commonest reason (docs/OPERATIONS.md, "The run is not stepping").
CAUSES = {
    ALL_ZERO: "every reward is 0: check the task's answer format against what the model writes "
              "(a verbose answer to an exact-match task scores 0), or warm-start the model (trainer.warm_start_steps)",
    ALL_EQUAL: "every group scores the same: the task is too easy or the reward is constant; advantages are zero",
    STALE: "groups arrive from policies older than the async window: nodes are too slow or too far behind "
           "(check their throughput and checkpoint downloads, or raise run.async_level)",
    REJECTED: "verification voids the groups: see verification.rejected_by_reason and recent_rejections "
              "(nodes on other weights or sampling settings, or cheating)",
    FILTERED: "the trainer's rollout filters (trainer.filters.enabled) drop every rollout of the groups: "
              "check their thresholds against what the model writes",
}

# Short words for one-line displays (the demo's progress line).
SHORT = {ALL_ZERO: "all rewards 0", ALL_EQUAL: "all rewards equal", STALE: "stale", REJECTED: "rejected",
         FILTERED: "filtered"}


def drop_reason(rewards: list[float]) -> str:
    """Why the trainer dropped a group with these rewards: equal rewards (the difficulty filter, or the
    zero-advantage filter on a constant reward) or, with rewards that differ, its rollout filters.
    At or below 0 counts as 0, at or above 1 as equal: the difficulty filter's floor and ceiling."""
    if not rewards:
        return FILTERED
    lo, hi = min(rewards), max(rewards)
    if hi <= 0:
        return ALL_ZERO
    if lo >= 1 or hi - lo <= 1e-9:
        return ALL_EQUAL
    return FILTERED


class BatchHealth:
    def __init__(self, *, needed: int, warn_after: int, warn_interval_s: float, metrics: CoordinatorMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.needed = needed
        self.warn_after = warn_after
        self.warn_interval_s = warn_interval_s
        self.metrics = metrics
        self.clock = clock
        self._lock = threading.Lock()
        self.batch = 1
        self.usable = 0
        self.unusable: Counter[str] = Counter()  # this batch
        self.run_usable = 0
        self.run_unusable: Counter[str] = Counter()
        self.in_a_row = 0
        self.streak: Counter[str] = Counter()  # reasons of the current streak
        self._last_warned: float | None = None
        self._voided_seen: int | None = None  # the ledger's void-group count already accounted for
        metrics.batch_needed.set(needed)
        metrics.groups_usable.inc(0)
        for r in REASONS:  # every reason shows on /metrics from the start, at 0
            metrics.groups_unusable.labels(r).inc(0)
            metrics.batch_unusable.labels(r).set(0)

    def begin_batch(self, step: int) -> None:
        """The trainer starts collecting batch `step`: its counts start at 0 (the streak goes on)."""
        with self._lock:
            self.batch, self.usable = step, 0
            self.unusable.clear()
            self.metrics.batch_usable.set(0)
            for r in REASONS:
                self.metrics.batch_unusable.labels(r).set(0)

    def record_usable(self) -> None:
        with self._lock:
            self.usable += 1
            self.run_usable += 1
            self.in_a_row = 0
            self.streak.clear()
            self.metrics.groups_usable.inc()
            self.metrics.batch_usable.set(self.usable)
            self.metrics.groups_unusable_in_a_row.set(0)
        # the rate limit outlives the streak: a run that keeps falling into long streaks warns at most once
        # per interval too

    def record_unusable(self, reason: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self.unusable[reason] += n
            self.run_unusable[reason] += n
            self.in_a_row += n
            self.streak[reason] += n
            self.metrics.groups_unusable.labels(reason).inc(n)
            self.metrics.batch_unusable.labels(reason).set(self.unusable[reason])
            self.metrics.groups_unusable_in_a_row.set(self.in_a_row)
            message = self._due_warning()
        if message:
            log.warning("%s", message)

    def observe_voided(self, total_voided: int) -> None:
        """The ledger's count of groups voided by verification (ever); what is new since the last call (the
        first call only sets the baseline) counts as rejected."""
        with self._lock:
            seen, self._voided_seen = self._voided_seen, total_voided
        if seen is not None and total_voided > seen:
            self.record_unusable(REJECTED, total_voided - seen)

    def _due_warning(self) -> str | None:
        """Under the lock: the warning text when the streak is long enough and the last warning is older than
        the interval (then it counts as given)."""
        if self.in_a_row < self.warn_after:
            return None
        now = self.clock()
        if self._last_warned is not None and now - self._last_warned < self.warn_interval_s:
            return None
        self._last_warned = now
        return self._warning_text()

    def _warning_text(self) -> str:
        cause = max(REASONS, key=lambda r: (self.streak[r], -REASONS.index(r)))
        reasons = ", ".join(f"{r} {n}" for r, n in self.streak.most_common())
        return (f"batch {self.batch} cannot fill: the last {self.in_a_row} groups were unusable ({reasons}); "
                f"{self.usable} of {self.needed} usable groups so far. Likely cause: {CAUSES[cause]}")

    def snapshot(self) -> dict:
        """For /v1/status: this batch's counts, the run's, the streak and the warning (None below the threshold)."""
        with self._lock:
            return {
                "batch": self.batch, "needed": self.needed, "usable": self.usable,
                "unusable": {r: self.unusable[r] for r in REASONS},
                "unusable_in_a_row": self.in_a_row, "warn_after": self.warn_after,
                "warning": self._warning_text() if self.in_a_row >= self.warn_after else None,
                "run_usable": self.run_usable, "run_unusable": {r: self.run_unusable[r] for r in REASONS},
            }
