"""Advantages (DR-GRPO, std normalisation, length penalties, custom) and rollout filters."""
from __future__ import annotations

import math

import pytest

from node.trainer.advantages import AdvantageInputs, AdvantageOutputs, drgrpo_advantages, resolve_advantage
from node.trainer.config import AdvantageConfig, FiltersConfig
from node.trainer.filters import apply_filters, build_filters, repetition_fraction
from node.trainer.types import Rollout


def _r(reward: float, n: int = 3, lp: float = -1.0, ids: list[int] | None = None, turns: int = 1) -> Rollout:
    ids = ids if ids is not None else list(range(5, 5 + n))
    return Rollout(completion_ids=ids, inference_logprobs=[lp] * len(ids), reward=reward, turns=turns)


def test_drgrpo_is_reward_minus_group_mean():
    out = drgrpo_advantages(AdvantageInputs([_r(1.0), _r(0.0), _r(0.5), _r(0.5)]))
    assert out.advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalisation():
    out = drgrpo_advantages(AdvantageInputs([_r(1.0), _r(0.0)]), std_normalize=True)
    assert out.advantages == pytest.approx([1.0, -1.0], rel=1e-5)  # std 0.5
    flat = drgrpo_advantages(AdvantageInputs([_r(0.3), _r(0.3)]), std_normalize=True)
    assert flat.advantages == [0.0, 0.0]  # eps keeps a zero-variance group finite


def test_token_length_penalty_prefers_shorter_and_keeps_mean():
    fn = resolve_advantage(AdvantageConfig(length_penalty="tokens", length_penalty_coef=0.1))
    rollouts = [_r(1.0, n=2), _r(1.0, n=6), _r(0.0, n=4)]
    adv = fn(rollouts)
    base = [1 / 3, 1 / 3, -2 / 3]
    # mean length 4: penalties 0.1·(2−4)/4 = −0.05 and 0.1·(6−4)/4 = +0.05
    assert adv == pytest.approx([base[0] + 0.05, base[1] - 0.05, base[2]])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_turns_length_penalty():
    fn = resolve_advantage(AdvantageConfig(length_penalty="turns", length_penalty_coef=0.2))
    adv = fn([_r(0.5, turns=1), _r(0.5, turns=3)])
    assert adv == pytest.approx([0.2 * 1 / 2, -0.2 * 1 / 2])  # mean 2 turns


def test_custom_advantage_by_import_path_with_kwargs():
    fn = resolve_advantage(AdvantageConfig(type="custom", import_path="tests.unit.test_trainer_advantages_filters:"
                                           "scaled_rewards", kwargs={"scale": 2.0}))
    assert fn([_r(0.25), _r(1.0)]) == [0.5, 2.0]


def test_custom_advantage_must_return_one_finite_value_per_rollout():
    fn = resolve_advantage(AdvantageConfig(type="custom", import_path="tests.unit.test_trainer_advantages_filters:"
                                           "broken_advantage"))
    with pytest.raises(ValueError):
        fn([_r(0.25), _r(1.0)])


def scaled_rewards(inputs: AdvantageInputs, *, scale: float) -> AdvantageOutputs:
    return AdvantageOutputs([scale * r.reward for r in inputs.rollouts])


def broken_advantage(inputs: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs([math.nan])


def test_gibberish_filter_by_mean_logprob():
    f = build_filters(FiltersConfig(enabled=["gibberish"], gibberish_min_mean_logprob=-5.0))["gibberish"]
    assert f(_r(0.0, lp=-6.0), 0.0) is True
    assert f(_r(0.0, lp=-4.0), 0.0) is False


def test_repetition_fraction_and_filter():
    assert repetition_fraction([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)  # (1,2),(2,1) then 3 repeats
    assert repetition_fraction([1, 2, 3], 4) == 0.0
    cfg = FiltersConfig(enabled=["repetition"], repetition_ngram=2, repetition_threshold=0.5, repetition_min_tokens=6)
    f = build_filters(cfg)["repetition"]
    assert f(_r(0.0, ids=[7, 8] * 5), 0.0) is True
    assert f(_r(0.0, ids=[7, 8, 7, 8]), 0.0) is False  # below min_tokens: never judged
    assert f(_r(0.0, ids=list(range(5, 15))), 0.0) is False


def test_zero_advantage_filter_and_counts():
    filters = build_filters(FiltersConfig(enabled=["zero_advantage", "gibberish"], gibberish_min_mean_logprob=-5))
    rollouts = [_r(1.0), _r(0.5), _r(0.0, lp=-9.0), _r(0.5)]
    kept, dropped = apply_filters(filters, rollouts, [0.5, 0.0, -0.5, 1e-12])
    assert kept == [0]
    assert dropped == {"zero_advantage": 2, "gibberish": 1}


def test_setting_enabled_replaces_default_filters_wholesale():
    assert list(build_filters(FiltersConfig())) == ["gibberish", "repetition"]
    assert list(build_filters(FiltersConfig(enabled=["zero_advantage"]))) == ["zero_advantage"]
    assert build_filters(FiltersConfig(enabled=[])) == {}
    with pytest.raises(ValueError):
        FiltersConfig(enabled=["nonsense"])
