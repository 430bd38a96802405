"""The async window and admission control of node/coordinator/scheduler.py."""
import pytest

from node.coordinator.scheduler import Scheduler, StaleNode, min_policy_for_batch


def make(k: int, batch: int = 4, per: int = 2) -> Scheduler:
    return Scheduler(async_level=k, batch_prompts=batch, group_size=2, prompts_per_assignment=per,
                     make_prompt=lambda i: (f"p{i}", [1, 2, i]))


def test_window_bounds():
    assert [min_policy_for_batch(n, 2) for n in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert [min_policy_for_batch(n, 0) for n in (1, 2, 3)] == [0, 1, 2]
    s = make(2)
    s.published_step = 5
    assert list(s.open_batches()) == [6, 7, 8]
    assert s.pick_batch(5) == 6
    with pytest.raises(StaleNode):
        s.pick_batch(2)  # θ_2 may work for batches ≤ 5, none of which is open
    with pytest.raises(ValueError):
        s.pick_batch(6)


def test_admission_stops_at_quota_and_rolls_to_next_batch():
    s = make(1)
    got = [s.assign(0, f"a{i}") for i in range(4)]
    assert [b for b, _ in got] == [1, 1, 2, 2] and all(len(slots) == 2 for _, slots in got)
    assert s.assign(0, "a4") is None  # batches 1 and 2 are fully handed out
    s.finish("a0", {"p0", "p1"})
    s.finish("a1", {"p2"})  # p3 was rejected: re-issued with the same seeds
    b, slots = s.assign(0, "a5")
    assert b == 1 and [x.prompt_id for x in slots] == ["p3"]


def test_dropped_groups_are_replaced_while_the_batch_is_collected():
    s = make(0)
    for i in range(2):
        s.assign(0, f"a{i}")
        s.finish(f"a{i}", {f"p{j}" for j in range(4)})
    assert s.assign(0, "x") is None
    s.forget_waiting({1: 3})  # the trainer dropped three groups of batch 1
    b, slots = s.assign(0, "a2")
    assert b == 1 and len(slots) == 2
    s.keep_rate = 0.5  # filters keep half: oversample
    assert s.quota() == 8
