"""NATed nodes serve too (node/p2p/nat.py), between real libp2p hosts on 127.0.0.1: an outbound-only node keeps
connections to reachable peers and serves over them; it reserves a slot on a relay (circuit relay v2 hop) and
another outbound-only node fetches from it through that relay; the relay's limits hold; a peer that is not our
relay cannot open connections to us over STOP streams."""
import asyncio
import time

import pytest

from node.p2p.errors import P2PError, PeerUnavailable, ShardPeerGone
from node.p2p.host import P2PNode
from node.p2p.nat import is_circuit
from protocol.identity import Identity
from tests import p2p_helpers
from tests.p2p_helpers import p2p_config, running, until

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]

RUN = "run-nat"
H = "ab" * 32
SHARDS = {i: bytes([i]) * (64 * 1024 + i) for i in range(6)}


def node(*, shard_source=None, relay_reserve: bool = True, **settings) -> P2PNode:
    """A host on 127.0.0.1 (`listen=False`: outbound-only) with `settings` (P2PConfig fields), its NAT keeper
    checking every 0.2 s."""
    return P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True, **settings), run_id=RUN,
                   shard_source=shard_source, nat_interval_s=0.2, relay_reserve=relay_reserve)


def serving(**kw) -> P2PNode:
    return node(shard_source=lambda step, index: SHARDS.get(index) if step == 1 else None, **kw)



def learn_have(of: P2PNode, at: P2PNode, addrs) -> None:
    """`at` records the signed `have` that `of` would gossip for step 1's SHARDS."""
    p2p_helpers.learn_have(of, at, addrs, run_id=RUN, manifest_hash=H, indices=SHARDS)



async def test_a_home_fetches_from_another_home_through_a_relay():
    async with running(node(relay_hop=True), serving(listen=False), node(listen=False)) as (
            relay, home_a, home_b):
        await home_a.connect(relay.listen_addrs)  # its bootstrap
        home_a.apply_reachability("127.0.0.1", False, None)  # the dial-back found it unreachable
        circuits = await until("a relay circuit in home A's announcement",
                               lambda: [a for a in home_a.announce_addrs if is_circuit(a)])
        assert circuits == [f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{home_a.peer_id}"]
        await home_b.connect(relay.listen_addrs)
        learn_have(home_a, home_b, home_a.announce_addrs)
        assert home_b.peers_with(1, 0, H) == [home_a.peer_id]
        slots = asyncio.Semaphore(4)  # what the fetcher does: no more in flight than a peer serves to one peer

        async def get(i):
            async with slots:
                for attempt in range(4):  # what the fetcher does when a transfer is cut: ask again (a new circuit)
                    try:
                        return await home_b.fetch_shard(home_a.peer_id, 1, i, 1 << 20, manifest_hash=H)
                    except (ShardPeerGone, PeerUnavailable):  # seen only at load 30: a relayed write stalled > 5 s
                        if attempt == 3:
                            raise

        got = await asyncio.gather(*map(get, SHARDS))
        assert got == list(SHARDS.values())
        b, a, r = await home_b.relay_stats(), await home_a.relay_stats(), await relay.relay_stats()
        # one circuit for four parallel fetches (a new one only if a transfer was cut, see above)
        assert 1 <= b["circuits_out"] <= 4, b
        assert a["circuits_in"] == b["circuits_out"] and a["reservations"] == 1, a
        assert r["hop_reservations"] == 1, r
        # what the coordinator's super-seeding reads to give home A first copies (seeding.py): only home A
        assert await relay.relay_reserved_nodes() == [home_a.node_id]
        assert await home_b.relay_reserved_nodes() == []  # not a hop
        assert home_a.stats.snapshot()["bytes_served"] == sum(map(len, SHARDS.values()))


async def test_a_home_asked_before_its_reservation_is_tried_again_once_it_announces_a_circuit():
    """A home's first `have`s go out before its relay reservation (it announces nothing yet); a peer that asked it
    then could not reach it. That failure was remembered for dial_retry_s (60 s) whatever the home announced
    next, so in the WAN lab two homes never fetched from each other for the whole run and were deferred by the
    origin instead (5-13 s a step). Now a failure counts only for the addresses that failed."""
    async with running(node(relay_hop=True), serving(listen=False), node(listen=False)) as (relay, home_a, home_b):
        await home_a.connect(relay.listen_addrs)
        await home_b.connect(relay.listen_addrs)
        learn_have(home_a, home_b, [])  # before its reservation: no address at all
        with pytest.raises(PeerUnavailable, match="announced no address"):
            await home_b.fetch_shard(home_a.peer_id, 1, 0, 1 << 20, manifest_hash=H)
        assert home_b.holder_rank(home_a.peer_id) == 3  # remembered, ranked last ...
        home_a.apply_reachability("127.0.0.1", False, None)
        await until("a relay circuit in home A's announcement", lambda: any(map(is_circuit, home_a.announce_addrs)))
        learn_have(home_a, home_b, home_a.announce_addrs)
        assert home_b.holder_rank(home_a.peer_id) == 1  # ... until it announces somewhere new to reach it
        assert await home_b.fetch_shard(home_a.peer_id, 1, 0, 1 << 20, manifest_hash=H) == SHARDS[0]


async def test_a_home_reserves_on_its_bootstrap_relay_as_soon_as_it_connects():
    """The worker learns it is NATed (the join's dial-back) before it dials the run's bootstrap: the keeper's
    first tick found no relay, and the reservation waited a whole interval (5 s in the CLI; 30 s here)."""
    home = P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True, listen=False), run_id=RUN,
                   nat_interval_s=30.0)
    async with running(node(relay_hop=True), home) as (relay, _):
        home.apply_reachability("127.0.0.1", False, None)  # the keeper starts: nothing to reserve on yet
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await home.connect(relay.listen_addrs)  # then the bootstrap
        await until("a relay circuit announced", lambda: any(map(is_circuit, home.announce_addrs)), deadline_s=10)
        assert time.monotonic() - t0 < 10


async def test_an_unreachable_node_keeps_connections_to_reachable_peers_and_serves_over_them():
    async with running(serving(listen=False, nat_keep_peers=2, relay_reserve=False),
                       node(), node(), node()) as (home, *public):
        for p in public:  # three reachable peers announce holdings at their direct addresses
            learn_have(p, home, p.listen_addrs)
        home.apply_reachability("127.0.0.1", False, None)
        kept = await until("two kept connections", lambda: _connected(home, 2))
        assert len(kept) == 2, kept  # nat_keep_peers, not every announcer
        peer = next(p for p in public if p.peer_id in kept)
        learn_have(home, peer, [])  # the home announces no address at all
        assert await peer.fetch_shard(home.peer_id, 1, 3, 1 << 20, manifest_hash=H) == SHARDS[3]
        other = next(p for p in public if p.peer_id not in kept)  # not connected: nothing to dial, no 3 s wait
        learn_have(home, other, [])
        t0 = time.monotonic()
        with pytest.raises(P2PError, match="announced no address"):
            await other.fetch_shard(home.peer_id, 1, 3, 1 << 20, manifest_hash=H)
        assert time.monotonic() - t0 < 1.0
        await asyncio.gather(*(p.stop() for p in public if p.peer_id in kept))  # they leave: it finds another
        assert await until("a replacement connection", lambda: _connected(home, 1, among={other.peer_id}))


async def _connected(node: P2PNode, n: int, among=None):
    peers = set(await node.connected_peers())
    if among is not None:
        peers &= among
    return sorted(peers) if len(peers) >= n else None


async def test_relay_limits_hold_and_a_refused_reservation_announces_no_circuit():
    async with running(node(relay_hop=True, relay_max_reservations=1, relay_reservation_ttl_s=10),
                       node(listen=False), node(listen=False), node()) as (relay, first, second, plain):
        for home in (first, second):
            await home.connect(relay.listen_addrs)
            home.apply_reachability("127.0.0.1", False, None)
        await until("the first reservation", lambda: any(map(is_circuit, first.announce_addrs)))
        with pytest.raises(P2PError, match="RESOURCE_LIMIT_EXCEEDED"):
            await second.reserve_on(relay.peer_id)  # one slot: taken
        assert not any(map(is_circuit, second.announce_addrs))
        with pytest.raises(P2PError, match="does not relay"):  # a peer without a hop
            await first.reserve_on((await first.connect(plain.listen_addrs))[0])


async def test_only_our_relay_may_open_a_connection_to_us_over_a_stop_stream():
    """py-libp2p's STOP handler upgrades a connection over any peer's STOP stream; ours refuses a peer that holds
    no reservation of ours (before the guard, this peer got a second connection to the target)."""
    async with running(serving(), node(listen=False)) as (target, mallory):
        [peer] = await mallory.connect(target.listen_addrs)
        opened = await mallory._bridge.call(_open_stop, mallory._service, target.peer_id)
        assert opened == "reset", opened
        await until("the refusal counted", lambda: _stop_refused(target))


async def _stop_refused(node):
    return (await node.relay_stats())["stop_refused"] >= 1


async def _open_stop(service, peer: str) -> str:
    import trio
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId, StopMessage
    from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    try:
        stream = await service.host.new_stream(ID.from_base58(peer), [STOP_PROTOCOL_ID])
        with trio.fail_after(5):
            await write_delimited_msg(stream, StopMessage(type=StopMessage.CONNECT,
                                                          peer=PeerId(id=service.host.get_id().to_bytes())))
            resp = await read_delimited_msg(stream, StopMessage)
        return f"answered {resp.status}"
    except trio.TooSlowError:
        return "no answer"
    except Exception:
        return "reset"


async def test_a_peer_can_reserve_only_for_itself():
    """Stock py-libp2p reserved for whatever peer id a RESERVE named: one connection filled every slot with
    made-up ids (before the fix, this test's relay held 5 reservations)."""
    async with running(node(relay_hop=True), node(listen=False)) as (relay, mallory):
        await mallory.connect(relay.listen_addrs)
        answers = await mallory._bridge.call(_reserve_for_others, mallory._service, relay.peer_id, 5)
        stats = await relay.relay_stats()
        assert stats["hop_reservations"] == 1, (answers, stats)  # mallory's own, once (stock: 5 made-up ones)
        assert await relay.relay_reserved_nodes() == [mallory.node_id]  # made-up ids never count as servable
        assert answers == [100] * 5, answers  # each answered OK: a renewal of mallory's own


async def _reserve_for_others(service, relay: str, n: int) -> list[int]:
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, PeerId
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    answers = []
    for _ in range(n):
        other = P2PNode(Identity.generate(), p2p_config(), run_id=RUN).peer_id
        stream = await service.host.new_stream(ID.from_base58(relay), [PROTOCOL_ID])
        await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                     peer=PeerId(id=ID.from_base58(other).to_bytes())))
        answers.append((await read_delimited_msg(stream, HopMessage)).status)
        await stream.close()
    return answers


async def test_a_relayed_connection_is_upgraded_to_a_direct_one_by_hole_punching():
    """DCUtR (nat.py's fixes of py-libp2p's): over a circuit, each side advertises the address the dial-back saw it
    at with its listen port, and the two dial each other; on loopback no NAT is in the way, so this checks the
    wiring (the WAN lab, two homes behind separate NAT routers, checks the punch)."""
    async with running(node(relay_hop=True), serving(), node()) as (
            relay, home_a, home_b):
        for h in (home_a, home_b):
            await h.connect(relay.listen_addrs)
            h.apply_reachability("127.0.0.1", False, None)
        circuits = await until("home A's circuit", lambda: [a for a in home_a.announce_addrs if is_circuit(a)])
        learn_have(home_a, home_b, circuits)
        assert await home_b.fetch_shard(home_a.peer_id, 1, 2, 1 << 20, manifest_hash=H) == SHARDS[2]
        assert (await home_b.relay_stats())["circuits_out"] == 1
        # DCUtR tries 3 times, each up to 3 rounds of 5 s: under a saturated CPU the first tries can miss
        punched = await until("a direct connection", lambda: _punched(home_a, home_b), deadline_s=75)
        assert punched >= 1


async def _punched(*nodes):
    return sum([(await n.relay_stats()).get("hole_punched", 0) for n in nodes])
