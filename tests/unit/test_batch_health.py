"""BatchHealth's bookkeeping and its warning's rate limit, with a clock the test moves (the integration test,
tests/integration/test_batch_health.py, runs it inside a real coordinator)."""
from __future__ import annotations

import logging

from node.coordinator.batch_health import ALL_EQUAL, ALL_ZERO, FILTERED, REJECTED, STALE, BatchHealth, drop_reason
from node.coordinator.metrics import CoordinatorMetrics


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def health(clock, warn_after=3, interval=60.0):
    return BatchHealth(needed=8, warn_after=warn_after, warn_interval_s=interval, metrics=CoordinatorMetrics(),
                       clock=clock)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_drop_reason_names_equal_rewards_and_leaves_the_rest_to_the_filters():
    assert drop_reason([0.0, 0.0, 0.0]) == ALL_ZERO
    assert drop_reason([-1.0, 0.0]) == ALL_ZERO  # the difficulty filter's floor
    assert drop_reason([1.0, 1.0]) == ALL_EQUAL
    assert drop_reason([0.5, 0.5]) == ALL_EQUAL  # the zero-advantage filter on a constant reward
    assert drop_reason([0.0, 1.0]) == FILTERED
    assert drop_reason([]) == FILTERED


def test_a_long_streak_warns_once_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="prime_node.training")
    clock = Clock()
    h = health(clock)
    h.record_unusable(ALL_ZERO, 2)
    assert warnings(caplog) == [] and h.snapshot()["warning"] is None
    h.record_unusable(ALL_ZERO)
    assert len(warnings(caplog)) == 1 and "check the task's answer format" in warnings(caplog)[0]
    for _ in range(500):  # a flood of unusable groups within the interval: no more lines
        h.record_unusable(ALL_ZERO)
    clock.t += 59.9
    h.record_unusable(ALL_ZERO)
    assert len(warnings(caplog)) == 1
    clock.t += 0.2
    h.record_unusable(ALL_ZERO)
    assert len(warnings(caplog)) == 2 and "the last 505 groups" in warnings(caplog)[1]
    assert h.snapshot()["warning"].startswith("batch 1 cannot fill")


def test_a_usable_group_ends_the_streak_but_not_the_rate_limit(caplog):
    caplog.set_level(logging.INFO, logger="prime_node.training")
    clock = Clock()
    h = health(clock)
    h.record_unusable(STALE, 3)
    h.record_usable()
    snap = h.snapshot()
    assert snap["unusable_in_a_row"] == 0 and snap["warning"] is None and snap["usable"] == 1
    h.record_unusable(STALE, 3)  # a new streak within the interval: counted, shown on status, not logged again
    assert len(warnings(caplog)) == 1 and h.snapshot()["warning"] is not None


def test_the_commonest_reason_of_the_streak_names_the_cause():
    h = health(Clock(), warn_after=1)
    h.record_unusable(STALE)
    h.record_unusable(ALL_EQUAL, 2)
    assert "the task is too easy or the reward is constant" in h.snapshot()["warning"]


def test_counts_are_per_batch_and_per_run():
    h = health(Clock(), warn_after=100)
    h.record_unusable(FILTERED, 2)
    h.record_usable()
    h.begin_batch(2)
    h.record_unusable(FILTERED)
    snap = h.snapshot()
    assert snap["batch"] == 2 and snap["usable"] == 0 and snap["unusable"][FILTERED] == 1
    assert snap["run_usable"] == 1 and snap["run_unusable"][FILTERED] == 3 and snap["unusable_in_a_row"] == 1


def test_voided_groups_count_from_the_first_count_seen():
    h = health(Clock(), warn_after=100)
    h.observe_voided(40)  # voided before this coordinator started: the baseline
    assert h.snapshot()["unusable"][REJECTED] == 0
    h.observe_voided(43)
    h.observe_voided(43)
    assert h.snapshot()["unusable"][REJECTED] == 3
    h.observe_voided(10)  # the ledger pruned old groups: a new, lower baseline, nothing counted
    h.observe_voided(11)
    assert h.snapshot()["unusable"][REJECTED] == 4
