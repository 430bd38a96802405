"""Start/stop real libp2p hosts repeatedly in one process: no leaked threads or sockets, clean errors."""
import asyncio
import os
import socket
import threading

import pytest

from node.p2p.config import P2PConfig
from node.p2p.errors import P2PError, P2PNotRunning
from node.p2p.host import P2PNode
from protocol.identity import Identity
from tests.p2p_helpers import p2p_config

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(120)]

RUN = "run-life"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_repeated_start_stop_leaks_no_threads_or_sockets():
    baseline_threads = set(threading.enumerate())
    payload = os.urandom(64 * 1024)
    fds = None
    for cycle in range(4):
        server = P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True), run_id=RUN,
                         shard_source=lambda s, i: payload)
        client = P2PNode(Identity.generate(), p2p_config(listen=False, allow_private_addrs=True), run_id=RUN)
        await server.start()
        await client.start()
        assert len([t for t in threading.enumerate() if t.name.startswith("prime-node-")]) == 2  # one per node
        [peer] = await client.connect(server.listen_addrs)
        assert await client.fetch_shard(peer, 1, 0, max_bytes=1 << 20) == payload
        # Stop in either order.
        first, second = (server, client) if cycle % 2 else (client, server)
        await first.stop()
        await second.stop()
        await second.stop()  # idempotent
        assert set(threading.enumerate()) == baseline_threads, threading.enumerate()
        if fds is None:
            fds = open_fds()  # after the first cycle: lazily created loop/selector fds are in place
        else:
            assert open_fds() <= fds + 2, "sockets leak across start/stop cycles"


async def test_stop_during_an_in_flight_fetch_fails_it_cleanly():
    data = os.urandom(512 * 1024)
    server = P2PNode(Identity.generate(), p2p_config(upload_limit=128 * 1024, allow_private_addrs=True), run_id=RUN,
                     shard_source=lambda s, i: data)
    client = P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True), run_id=RUN)
    async with server, client:
        [peer] = await client.connect(server.listen_addrs)
        fetch = asyncio.ensure_future(client.fetch_shard(peer, 1, 0, max_bytes=1 << 20))
        while not client.stats.bytes_fetched_by_peer():
            await asyncio.sleep(0.01)
        sub = client.subscribe()
        await client.stop()  # the client itself shuts down mid-transfer
        with pytest.raises(P2PNotRunning):
            await fetch
        with pytest.raises(StopAsyncIteration):  # subscriptions end with the node
            await sub.get(timeout=1)
        with pytest.raises(P2PNotRunning):
            await client.fetch_shard(peer, 1, 0, max_bytes=1 << 20)
        with pytest.raises(P2PNotRunning):
            await client.announce_have(1, [0], "ab" * 32)
    assert not [t for t in threading.enumerate() if t.name.startswith("prime-node-")]


async def test_listen_port_in_use_is_a_clean_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = P2PConfig(listen_port=port)
        node = P2PNode(Identity.generate(), cfg, run_id=RUN)
        with pytest.raises(P2PError):
            await node.start()
    assert not [t for t in threading.enumerate() if t.name.startswith("prime-node-")]
    with pytest.raises(P2PNotRunning):
        node.subscribe()


async def test_config_bootstrap_announce_addrs_and_bound_identity():
    ident = Identity.generate()
    async with P2PNode(Identity.generate(), p2p_config(), run_id=RUN) as hub:
        cfg = P2PConfig(listen=False, upload_limit=1000, bootstrap=hub.listen_addrs,
                        announce_addrs=["/ip4/127.0.0.1/tcp/4001"])
        node = P2PNode(ident, cfg, run_id=RUN)
        cfg.bootstrap.clear()  # the host holds its own copy: an edit after construction does not reach it
        async with node:
            assert node.listen_addrs == []
            assert await node.connected_peers() == [hub.peer_id]  # dialled its bootstrap list at start
            assert node.announce_addrs == [f"/ip4/127.0.0.1/tcp/4001/p2p/{node.peer_id}"]
            from node.p2p.keys import node_id_for_peer, parse_peer_id

            assert node_id_for_peer(parse_peer_id(node.peer_id)) == ident.node_id
        # A stale bootstrap entry does not stop a node from starting.
        dead = P2PConfig(bootstrap=[f"/ip4/127.0.0.1/tcp/9/p2p/{hub.peer_id}"], connect_timeout_s=2)
        async with P2PNode(Identity.generate(), dead, run_id=RUN) as lonely:
            assert await lonely.connected_peers() == []


def test_wildcard_listen_addresses_are_not_announced():
    node = P2PNode(Identity.generate(), p2p_config(), run_id=RUN)
    pid = node.peer_id
    node.listen_addrs = [f"/ip4/0.0.0.0/tcp/4001/p2p/{pid}", f"/ip4/127.0.0.1/tcp/4001/p2p/{pid}",
                         f"/ip6/::/tcp/4001/p2p/{pid}"]
    assert node._addrs_to_announce() == [f"/ip4/127.0.0.1/tcp/4001/p2p/{pid}"]
