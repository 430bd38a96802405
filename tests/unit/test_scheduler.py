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


def test_scarce_work_waits_for_a_node_that_asked_and_is_behind():
    """The far node asked and got nothing; the near node, ahead of it, is held back from the work left (its
    gap), so a node's round trip does not decide its share. Only while scarce, and only for a bounded time."""
    s = make(0, batch=8, per=2)
    t = 100.0
    for i in range(4):  # the near node took all of batch 1
        assert s.assign(0, f"n{i}", "near", now=t) is not None
    assert s.assign(0, "f0", "far", now=t + 0.1) is None  # nothing left: the far node waits
    for i in range(4):
        s.finish(f"n{i}", {x.prompt_id for x in s.inflight[f"n{i}"]})
    s.on_step_published(1, {1: 8})  # batch 2 opens: 8 prompts, the near node is 8 ahead
    assert s.assign(1, "n4", "near", now=t + 0.5) is None  # kept for the far node
    got = [s.assign(1, f"f{i}", "far", now=t + 0.6) for i in (1, 2, 3)]
    assert all(g is not None for g in got)  # the far node came and took it
    assert s.assign(1, "n5", "near", now=t + 0.7) is not None  # now even: the rest is anyone's


def test_fair_hold_is_bounded_and_only_when_scarce():
    s = make(2, batch=8, per=2)
    t = 100.0
    for i in range(8):
        s.assign(0, f"n{i}", "near", now=t)
    assert s.assign(0, "f0", "far", now=t) is not None  # plenty left (3 open batches): no holding back
    s2 = make(0, batch=8, per=2)
    for i in range(4):
        s2.assign(0, f"n{i}", "near", now=t)
    assert s2.assign(0, "f0", "far", now=t + 0.1) is None  # the far node waits, behind by 8 prompts
    s2.finish("n0", set())  # two prompts come back to be handed out again
    assert s2.assign(0, "n9", "near", now=t + 0.2) is None  # held ...
    assert s2.assign(0, "n9", "near", now=t + 0.2 + s2.fair_hold_s + 0.1) is not None  # ... but not for long
    # a node that stopped asking is not waited for
    s3 = make(0, batch=4, per=2)
    s3.assign(0, "n0", "near", now=t)
    s3.assign(0, "n1", "near", now=t)
    assert s3.assign(0, "f0", "far", now=t) is None
    s3.finish("n0", set())
    assert s3.assign(0, "n2", "near", now=t + s3.fair_waiting_s + 0.1) is not None


def test_a_stale_node_that_is_behind_is_waited_for():
    """A far node whose fetch takes longer than the trainer's steps is stale whenever it asks; it fetches on
    that answer, and scarce work is kept for it (bounded) as for any node that asked and got nothing."""
    s = make(0, batch=4, per=2)
    t = 100.0
    s.published_step = 3
    for i in range(2):
        assert s.assign(3, f"n{i}", "near", now=t) is not None  # batch 4, whole, to the near node
    with pytest.raises(StaleNode):
        s.assign(1, "f0", "far", now=t + 0.1)
    assert "far" in s._waiting
    s.on_step_published(4, {})
    s.finish("n0", set())
    assert s.assign(4, "n2", "near", now=t + 0.2) is None  # kept for the far node, 4 prompts behind
    assert s.assign(4, "f1", "far", now=t + 0.5) is not None  # its fetch landed: it takes the work
    # bounded: a stale node that never comes back is not waited for
    s2 = make(0, batch=4, per=2)
    s2.published_step = 3
    s2.assign(3, "n0", "near", now=t)
    with pytest.raises(StaleNode):
        s2.assign(1, "f0", "far", now=t)
    assert s2.assign(3, "n1", "near", now=t + s2.fair_waiting_s + 0.1) is not None


def test_inflight_counts_follow_every_change():
    """The per-batch count of prompts in flight is kept as assignments come and go (not recounted per request):
    after any mix of assign / finish / expire / step published / restore it equals a recount of `inflight`."""
    import random

    rng = random.Random(7)
    s = make(2, batch=6, per=2)
    live: list[str] = []
    for i in range(400):
        op = rng.random()
        if op < 0.5:
            try:
                if s.assign(s.published_step, f"a{i}") is not None:
                    live.append(f"a{i}")
            except StaleNode:
                pass
        elif live and op < 0.75:
            aid = live.pop(rng.randrange(len(live)))
            slots = s.inflight[aid]
            s.finish(aid, {x.prompt_id for x in slots if rng.random() < 0.7})
        elif live and op < 0.9:
            s.expire(live.pop(rng.randrange(len(live))))
        else:
            s.on_step_published(s.published_step + 1, dict(s.waiting_by_batch))
        recount: dict[int, int] = {}
        for slots in s.inflight.values():
            for x in slots:
                recount[x.batch_step] = recount.get(x.batch_step, 0) + 1
        assert s._inflight_by_batch() == recount
    restored = make(2, batch=6, per=2)
    for aid, slots in s.inflight.items():
        restored.add_inflight(aid, list(slots))
    assert restored._inflight_by_batch() == s._inflight_by_batch()
