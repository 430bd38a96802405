"""The per-peer summary log and the per-forwarder gossip rate limit (pure; fake clocks, no hosts)."""
import logging

from node.peer_log import OTHERS, PeerEventLog
from node.rate_limit import KeyedRateLimit, TokenBucket


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "test.peer_log"]


def test_first_event_at_once_then_one_summary_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="test.peer_log")
    clock = Clock()
    plog = PeerEventLog(logging.getLogger("test.peer_log"), "dropped", interval_s=60, clock=clock)
    plog.note("peerA", "malformed", "not JSON")
    for i in range(10_000):  # a flood within the minute: counted, not logged
        clock.t += 0.001
        plog.note("peerA", "wrong_key" if i % 2 else "malformed", f"#{i}")
    assert len(messages(caplog)) == 1 and "peerA: malformed: not JSON" in messages(caplog)[0]
    plog.flush()  # not due yet
    assert len(messages(caplog)) == 1
    clock.t += 60
    plog.flush()
    [_, summary] = messages(caplog)
    assert "10000 more" in summary and "'malformed': 5000" in summary and "'wrong_key': 5000" in summary
    assert "latest: wrong_key: #9999" in summary
    clock.t += 61
    plog.flush()  # nothing pending: no line, and the peer is forgotten
    assert len(messages(caplog)) == 2 and plog._peers == {}
    plog.note("peerA", "stale")  # a new episode starts with a line of its own
    assert len(messages(caplog)) == 3


def test_a_due_summary_is_written_by_the_next_event_too(caplog):
    caplog.set_level(logging.INFO, logger="test.peer_log")
    clock = Clock()
    plog = PeerEventLog(logging.getLogger("test.peer_log"), "dropped", interval_s=60, clock=clock)
    plog.note("p", "a")
    plog.note("p", "a")
    clock.t += 60
    plog.note("p", "b")
    assert len(messages(caplog)) == 2 and "2 more" in messages(caplog)[1]


def test_tracked_peers_are_bounded(caplog):
    caplog.set_level(logging.INFO, logger="test.peer_log")
    plog = PeerEventLog(logging.getLogger("test.peer_log"), "dropped", max_peers=3, clock=Clock())
    for i in range(1000):  # 1000 peer ids (a Sybil flood): 3 lines + 1 for all the others
        plog.note(f"peer{i}", "malformed")
    assert len(plog._peers) == 4 and OTHERS in plog._peers
    assert len(messages(caplog)) == 4
    assert sum(plog._peers[OTHERS].pending.values()) == 1000 - 4


def test_token_bucket_try_take_never_goes_into_debt():
    b = TokenBucket(10, 20, now=0.0)
    assert sum(b.try_take(1, 0.0) for _ in range(25)) == 20
    assert not b.try_take(1, 0.05)  # half a token back
    assert b.try_take(1, 0.1)
    assert sum(b.try_take(1, 100.0) for _ in range(25)) == 20  # refills to the burst, not beyond


def test_keyed_rate_limit_is_per_key_and_bounded():
    clock = Clock()
    limit = KeyedRateLimit(100, 200, max_keys=2, clock=clock)
    assert sum(limit.allow("a") for _ in range(250)) == 200
    assert sum(limit.allow("b") for _ in range(250)) == 200  # another forwarder has its own budget
    clock.t += 0.5
    assert sum(limit.allow("a") for _ in range(150)) == 50
    limit.allow("c")  # a third key evicts the least recently used ("b")
    assert set(limit._buckets) == {"a", "c"}


def test_what_the_pre_check_admits_never_reaches_gossipsubs_own_limit():
    """py-libp2p's check (n per sliding second) runs later, after validation, with its own
    timestamps, and drops silently with a WARNING per message: it must never fire for what the
    pre-check admitted, and the pre-check must hold the sustained rate."""
    import random

    from node.p2p.service import GOSSIP_BURST_S, GOSSIPSUB_LIMIT_FACTOR

    rng = random.Random(7)
    clock = Clock()
    limit = KeyedRateLimit(10, 10 * GOSSIP_BURST_S, clock=clock)
    theirs: list[float] = []
    admitted = 0
    for i in range(20_000):
        clock.t += rng.expovariate(40) if i % 1000 else 5.0  # a flood at 4x the limit, with pauses
        if limit.allow("p"):
            admitted += 1
            t = clock.t + rng.uniform(0, 0.2)  # their check runs up to 200 ms later
            theirs[:] = [x for x in theirs if x > t - 1.0]
            assert len(theirs) < 10 * GOSSIPSUB_LIMIT_FACTOR
            theirs.append(t)
    elapsed = clock.t - 1000.0
    flooding = elapsed - 19 * 5.0  # minus the pauses
    assert 0.9 * flooding * 10 < admitted <= flooding * 10 + 20 * 20  # the rate holds, and is reached


def test_a_peer_pacing_itself_for_stock_py_libp2p_passes_even_bunched():
    """P2PNode paces its publishes as "at most 8 in any 1 s" (8 at once, 8 more a second later);
    the network may deliver two such bursts together. The minimum limit (10/s) accepts them."""
    from node.p2p.service import GOSSIP_BURST_S

    clock = Clock()
    limit = KeyedRateLimit(10, 10 * GOSSIP_BURST_S, clock=clock)
    assert all(limit.allow("hub") for _ in range(16))  # two bursts arriving at once
    for _ in range(10):
        clock.t += 1.0
        assert all(limit.allow("hub") for _ in range(8))
