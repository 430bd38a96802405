"""Difficulty pools: transitions, persistence, lifting on resume; online filtering; keep rate."""
from __future__ import annotations

import json

import pytest

from node.trainer.buffer import BufferStateError, DifficultyPools, KeepRate, uninformative
from node.trainer.config import BufferConfig


def test_pool_transitions_follow_group_mean_reward():
    pools = DifficultyPools(easy_threshold=0.9, hard_threshold=0.1)
    assert pools.update("p", 0.5) == "normal" and pools.pool_of("p") == "normal"
    assert pools.update("p", 0.95) == "easy" and pools.pool_of("p") == "easy"
    assert pools.update("p", 0.05) == "hard" and pools.pool_of("p") == "hard"
    assert pools.update("p", 0.4) == "normal" and pools.pool_of("p") == "normal"
    pools.update("q", 1.0)
    pools.update("r", 0.0)
    assert pools.counts() == {"easy": 1, "hard": 1}


def test_pools_round_trip_through_json(tmp_path):
    pools = DifficultyPools(0.8, 0.2)
    for i in range(5):
        pools.update(f"e{i}", 0.9)
        pools.update(f"h{i}", 0.1)
    pools.save(tmp_path / "pools.json")
    again = DifficultyPools.load(tmp_path / "pools.json")
    assert again.pool == pools.pool and again.easy_threshold == 0.8 and again.hard_threshold == 0.2


def test_lift_moves_the_configured_share_back_to_normal_deterministically():
    def fresh():
        p = DifficultyPools()
        for i in range(10):
            p.update(f"e{i}", 1.0)
            p.update(f"h{i}", 0.0)
        return p

    a, b = fresh(), fresh()
    assert a.lift(0.3, 0.5, seed=7) == {"easy": 3, "hard": 5}
    b.lift(0.3, 0.5, seed=7)
    assert a.counts() == {"easy": 7, "hard": 5} and a.pool == b.pool


@pytest.mark.parametrize("bad", [
    {"easy_threshold": 1, "hard_threshold": 0, "pool": {"x": "medium"}},
    {"easy_threshold": 1, "hard_threshold": 0, "pool": ["x"]},
    {"pool": {}},
    "not an object",
])
def test_malformed_pool_state_is_rejected(bad):
    with pytest.raises(BufferStateError):
        DifficultyPools.from_json(json.loads(json.dumps(bad)))


def test_uninformative_groups():
    assert uninformative([0.0, 0.0, 0.0])
    assert uninformative([1.0, 1.0])
    assert not uninformative([0.0, 1.0])
    assert not uninformative([0.3, 0.3])  # partial rewards: left to the zero_advantage filter


def test_keep_rate_window_and_persistence():
    k = KeepRate(window=4)
    assert k.value == 1.0
    for kept in (True, False, False, True, True, True):
        k.record(kept)
    assert k.value == pytest.approx(3 / 4)  # only the last 4
    k2 = KeepRate(window=4)
    k2.load_json(k.to_json())
    assert k2.value == k.value
    with pytest.raises(BufferStateError):
        k2.load_json([2])


def test_buffer_config_rejects_inverted_thresholds():
    with pytest.raises(ValueError):
        BufferConfig(easy_threshold=0.2, hard_threshold=0.5)
