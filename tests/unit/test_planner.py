"""The shard planner and source book, without a network: which shard a slot takes, from where, how
deferrals, failures, bans and resumption play out."""
import random
from dataclasses import dataclass

import pytest

from node.worker.planner import MissingBase, Pick, ShardPlanner, SourceBook, Wait, steps_to_fetch


def planner(n=6, todo=None, swarm=False, start=2):
    return ShardPlanner(n, range(n) if todo is None else todo, swarm=swarm, start=start, rng=random.Random(0))


def test_without_peers_slots_take_shards_from_the_origin_in_rotation():
    p = planner()
    picks = [p.take(0.0, {}) for _ in range(6)]
    assert [x.index for x in picks] == [2, 3, 4, 5, 0, 1] and all(x.from_origin for x in picks)
    assert isinstance(p.take(0.0, {}), Wait)
    for x in picks:
        p.done(x)
    assert p.finished


def test_resume_takes_only_what_is_missing():
    p = planner(todo=[1, 4])
    assert {p.take(0, {}).index, p.take(0, {}).index} == {1, 4}


def test_in_a_swarm_one_slot_asks_the_origin_the_others_wait_for_peers():
    p = planner(swarm=True)
    first = p.take(0.0, {})
    assert first == Pick(2, from_origin=True)
    assert p.take(0.0, {}) == Wait(None)  # a second origin fetch would load the origin: wait for news
    # a peer announces shards 0 and 5; 5 is held by two peers, 0 by one: the rarest goes first
    assert p.take(0.0, {0: 1, 5: 2}) == Pick(0, from_origin=False)
    assert p.take(0.0, {0: 1, 5: 2}) == Pick(5, from_origin=False)
    p.done(first)
    assert p.take(0.0, {}).from_origin  # the origin slot is free again


def test_an_origin_deferral_still_lets_peers_serve_the_shard():
    p = planner(swarm=True)
    x = p.take(10.0, {})
    p.deferred(x, 10.0)  # "seeded": fetch it from a peer
    nxt = p.take(10.5, {})
    assert nxt.index != x.index and nxt.from_origin  # the origin is asked for another shard meanwhile
    p.done(nxt)
    assert p.take(10.5, {x.index: 1}) == Pick(x.index, from_origin=False)  # ...and peers may serve it


def test_deferred_origin_shard_comes_back_after_the_window():
    p = planner(n=1, swarm=True, start=0)
    x = p.take(0.0, {})
    p.deferred(x, 0.0)
    assert p.take(1.0, {}) == Wait(2.0)  # tells the slot when to look again
    assert p.take(2.0, {}) == Pick(0, from_origin=True)


def test_busy_peers_back_off_briefly_and_failures_return_the_shard():
    p = planner(n=2, swarm=True, start=0)
    x = p.take(0.0, {1: 1})
    assert x == Pick(1, from_origin=False)
    p.deferred(x, 0.0)  # every holder busy
    o = p.take(0.1, {1: 1})
    assert o == Pick(0, from_origin=True)  # shard 1 waits 0.2 s for its peers
    p.failed(o)
    assert p.take(0.1, {1: 1}) == Pick(0, from_origin=True)
    assert p.take(0.25, {1: 1}) == Pick(1, from_origin=False)


@dataclass(frozen=True)
class Src:
    name: str
    kind: str


def test_source_order_bans_and_the_last_coordinator():
    peer, relay, coord = Src("peer:swarm", "peer"), Src("relay:r", "relay"), Src("coordinator:c", "coordinator")
    book = SourceBook()
    sources = [coord, relay, peer]
    assert book.for_shard(sources) == [peer, relay, coord]  # the origin's uplink is the scarce resource
    book.served("relay:r", 50_000_000, 1.0)
    book.served("coordinator:c", 1_000_000, 1.0)
    assert book.usable([coord, relay])[0] == relay  # listings from the fastest
    assert book.ban(relay, sources) and book.for_shard(sources) == [peer, coord]
    assert book.ban(peer, sources)
    assert not book.ban(coord, sources)  # the last source is never banned
    assert book.for_shard(sources) == [coord]
    book.failed("coordinator:c")
    assert book.score("coordinator:c").failures == 1


@dataclass(frozen=True)
class Entry:
    base_step: int | None


def listing(full_every=5, newest=12, oldest=0):
    """Steps oldest..newest; every `full_every`-th is full, the others xor-deltas on the step before."""
    return {s: Entry(None if s % full_every == 0 else s - 1) for s in range(oldest, newest + 1)}


def test_step_plan_one_step_behind_fetches_only_the_newest_delta():
    assert steps_to_fetch([10, 11], listing()) == [12]


def test_step_plan_far_behind_goes_straight_to_the_newest_full_and_its_deltas():
    assert steps_to_fetch([3], listing()) == [10, 11, 12]
    assert steps_to_fetch([], listing()) == [10, 11, 12]


def test_step_plan_a_few_behind_follows_the_deltas_from_what_is_held():
    assert steps_to_fetch([7], listing(full_every=20)) == [8, 9, 10, 11, 12]


def test_step_plan_asks_nothing_when_up_to_date_or_the_listing_is_older():
    assert steps_to_fetch([12], listing()) == []
    assert steps_to_fetch([14], listing()) == []
    assert steps_to_fetch([3], {}) == []


def test_step_plan_window_fills_every_listed_step_with_its_chain():
    # a verifier holding 12 and 8: the window [9, 12] also needs 9 (on 8, held), 10 is full, 11 on 10
    assert steps_to_fetch([8, 12], listing(), window=3) == [9, 10, 11]
    # nothing held: every window step, each with its bases back to a full one
    assert steps_to_fetch([], listing(), window=3) == [5, 6, 7, 8, 9, 10, 11, 12]


def test_step_plan_a_base_no_longer_listed_is_an_error():
    gone = {s: e for s, e in listing(full_every=20).items() if s >= 9}
    with pytest.raises(MissingBase) as e:
        steps_to_fetch([3], gone)
    assert e.value.step == 8
