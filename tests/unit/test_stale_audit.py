"""The stale-step audit's decider (node/coordinator/stale_audit.py): a one-sided sign test over disjoint windows of
audited rollouts, each counting 1 when the rollout fits the claimed step - 1 better than the claimed step.

Fits are drawn here from the distributions measured on real LoRA rollouts at a 1.0 % per-step change
(tests/integration/test_stale_audit_lora.py: mean logprob deviation 0.016 under the generating step, 0.052 under the
other), and at the worst case for an honest node: two steps too close to tell apart, each the better fit at random.
"""
from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from node.config import VerificationConfig
from node.coordinator.stale_audit import StaleAudit, false_alarm_rate, sign_threshold


def _fits(rng: random.Random, n: int, stale: bool, *, gap: float = 0.036, spread: float = 0.5,
          ) -> list[tuple[float, float]]:
    """n rollouts' (fit under the claimed step, fit under step - 1): the generating step's fit ~ 0.016, the
    other's that plus `gap` plus noise of `spread` x gap (gap 0: indistinguishable steps, noise 0.01). spread 0.5
    makes the other step the better fit of 2.3 % of rollouts, as measured (2 of 63 honest, 1 of 63 stale)."""
    out = []
    for _ in range(n):
        own = abs(rng.gauss(0.016, 0.01))
        other = abs(own + gap + rng.gauss(0.0, max(spread * gap, 0.01 if gap == 0 else 0.0)))
        out.append((other, own) if stale else (own, other))
    return out


def test_threshold_is_the_exact_binomial_tail():
    for window in (8, 16, 32, 64):
        for alpha in (1e-2, 1e-3, 1e-4):
            k = sign_threshold(window, alpha)
            assert false_alarm_rate(window, k) <= alpha < false_alarm_rate(window, k - 1)
    assert sign_threshold(16, 1e-3) == 15  # P(>= 15 of 16 fair flips) = 17 / 65536 = 2.6e-4
    assert math.isclose(StaleAudit(16, 1e-3).false_alarm_rate(), 17 / 65536)
    assert sign_threshold(8, 1e-3) == 9  # all 8 of 8 is 1 / 256 > 1e-3: such a window never flags


def test_honest_noise_never_flags_over_many_windows():
    rng = random.Random(1)
    audit = StaleAudit(16, 1e-3)
    for i in range(2_000):  # 2,000 nodes x 64 audited rollouts = 8,000 windows
        for s in range(0, 64, 8):
            assert not audit.record(f"n{i}", _fits(rng, 8, stale=False)), (i, s)


def test_indistinguishable_steps_flag_at_most_at_the_stated_rate():
    """The worst case for an honest node: step - 1 fits better half the time. 40,000 windows: the number flagged
    is within the binomial's spread of the exact rate (2.6e-4: ~10.4 expected), never far above alpha."""
    rng = random.Random(2)
    audit = StaleAudit(16, 1e-3)
    flagged = sum(audit.record("n", _fits(rng, 16, stale=False, gap=0.0)) for _ in range(40_000))
    expected = 40_000 * audit.false_alarm_rate()
    assert flagged <= expected + 4 * math.sqrt(expected) + 1 and flagged <= 40_000 * 1e-3, flagged


@pytest.mark.parametrize("spread, bound", [(0.5, 64), (1.0, 512)])
def test_a_stale_node_is_flagged_within_a_bounded_number_of_rollouts(spread, bound):
    """Audited 8 rollouts (one submission) at a time, every one of 500 stale nodes is flagged within `bound`
    audited rollouts: at the measured separation (older step the better fit of ~98 % of a stale node's rollouts;
    flagged by its first window of 16 ~95 % of the time) and at a much weaker one (84 %: ~25 % per window)."""
    rng = random.Random(3)
    total, worst = 0, 0
    for i in range(500):
        audit, seen = StaleAudit(16, 1e-3), 8
        while not audit.record("n", _fits(rng, 8, stale=True, spread=spread)):
            seen += 8
            assert seen <= bound, f"stale node {i} not flagged after {seen} audited rollouts (spread {spread})"
        total, worst = total + seen, max(worst, seen)
    print(f"spread {spread}: stale nodes flagged after {total / 500:.1f} audited rollouts on average, {worst} at most")


def test_ties_and_missing_fits_are_no_evidence_and_flagging_forgets_the_node():
    audit = StaleAudit(16, 1e-3)
    assert not audit.record("n", [(0.1, 0.1)] * 100 + [(None, 0.0), (0.1, None)] * 50)
    assert not audit.record("n", [(0.05, 0.01)] * 14)  # 14 counted: the window is not full yet
    assert audit.record("n", [(0.05, 0.01), (0.01, 0.05)])  # 15 of 16 older-better: flagged
    assert audit.nodes() == 0
    assert not audit.record("n", [(0.05, 0.01)] * 15)  # a fresh window after the flag


def test_state_is_bounded_by_max_nodes_least_recently_audited_first():
    audit = StaleAudit(16, 1e-3, max_nodes=3)
    for n in "abcd":
        audit.record(n, [(0.05, 0.01)] * 10)
    assert audit.nodes() == 3
    assert not audit.record("a", [(0.05, 0.01)] * 10)  # "a" was forgotten: its 10 + 10 are not one window of 16
    audit.record("c", [(0.05, 0.01)])
    audit.record("e", [(0.05, 0.01)])  # "b" and "d" went before "c" (audited later)
    assert audit.record("c", [(0.05, 0.01)] * 5)


def test_bad_arguments_and_config_bounds():
    with pytest.raises(ValueError):
        StaleAudit(16, 0.0)
    with pytest.raises(ValueError):
        StaleAudit(0, 1e-3)
    cfg = VerificationConfig()
    assert 0 < cfg.stale_audit_fraction < 1 and cfg.stale_audit_window >= 16
    for bad in ({"stale_audit_window": 4}, {"stale_audit_alpha": 0.5}, {"stale_audit_fraction": 1.5},
                {"stale_audit_windw": 16}):
        with pytest.raises(ValidationError):
            VerificationConfig(**bad)
