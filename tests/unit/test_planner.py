"""The shard planner and source book, without a network: which shard a slot takes, from where, how
deferrals, failures, bans and resumption play out."""
import random
from dataclasses import dataclass

from node.worker.planner import Pick, ShardPlanner, SourceBook, Wait


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
