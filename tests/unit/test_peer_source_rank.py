"""The worker's peer source ranks a NATed holder it already holds a direct connection to with the reachable ones
(node/worker/peers.py, node/p2p/host.py holder_rank), between real libp2p hosts on 127.0.0.1. Before, a home
that keeps a connection to us (nat.py's keeper) or a hole-punched one still ranked below every reachable
holder, so it was asked only when they all failed: in the WAN lab the NATed homes' share of the serving came
from the origin's first copies alone (docs/P2P.md, Reachability). A relay circuit is not such a connection."""
import pytest

from node.p2p.host import P2PNode
from node.p2p.nat import is_circuit
from node.worker.peers import PeerSource
from protocol.identity import Identity
from tests import p2p_helpers
from tests.p2p_helpers import p2p_config, running, until

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]

RUN = "run-rank"
H = "cd" * 32
SHARDS = {i: bytes([i]) * (32 * 1024 + i) for i in range(4)}
FETCHES = 24  # at even odds the home is never picked first in 24 tries once in 16 million runs


def node(*, serve: bool = False, relay_reserve: bool = False, **settings) -> P2PNode:
    source = (lambda step, index: SHARDS.get(index) if step == 1 else None) if serve else None
    return P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True, **settings), run_id=RUN,
                   shard_source=source, nat_interval_s=0.2, relay_reserve=relay_reserve)


def learn_have(of: P2PNode, at: P2PNode, addrs) -> None:
    p2p_helpers.learn_have(of, at, addrs, run_id=RUN, manifest_hash=H, indices=SHARDS)


async def test_a_natted_holder_with_an_open_direct_connection_ranks_with_the_reachable_ones():
    async with running(node(), node(serve=True), node(serve=True, listen=False)) as (me, public, home):
        learn_have(public, me, public.listen_addrs)  # reachable: a direct address
        learn_have(home, me, [])  # NATed: announces nothing it can be dialled at ...
        await home.connect(me.listen_addrs)  # ... but keeps a connection open to us (nat.py's keeper)
        direct = await until("the home's connection", me.direct_peers)
        assert home.peer_id in direct
        assert me.holder_rank(home.peer_id) == 2  # what the rank knows from announcements alone
        assert me.holder_rank(home.peer_id, direct=direct) == me.holder_rank(public.peer_id, direct=direct) == 0

        source = PeerSource(me)
        for i in range(FETCHES):
            assert await source.shard(1, i % len(SHARDS), 1 << 20, manifest_hash=H) == SHARDS[i % len(SHARDS)]
        served = {n: x.stats.snapshot()["bytes_served"] for n, x in (("public", public), ("home", home))}
        # Random within a rank: both serve. Before, the public holder was asked first every time (home: 0).
        assert served["home"] > 0 and served["public"] > 0, served


async def test_a_relay_circuit_is_not_a_direct_connection():
    async with running(node(relay_hop=True), node(serve=True, listen=False, relay_reserve=True), node(listen=False)) as (
            relay, home_a, home_b):
        await home_a.connect(relay.listen_addrs)
        await home_b.connect(relay.listen_addrs)
        home_a.apply_reachability("127.0.0.1", False, None)
        await until("a relay circuit in home A's announcement", lambda: any(map(is_circuit, home_a.announce_addrs)))
        learn_have(home_a, home_b, home_a.announce_addrs)
        assert await home_b.fetch_shard(home_a.peer_id, 1, 0, 1 << 20, manifest_hash=H) == SHARDS[0]
        assert home_a.peer_id in await home_b.connected_peers()  # over the circuit ...
        direct = await home_b.direct_peers()
        assert relay.peer_id in direct and home_a.peer_id not in direct, direct  # ... which is not direct
        assert home_b.holder_rank(home_a.peer_id, direct=direct) == 1
