"""Super-seeding's X-Prime-Holder hint on the libp2p plane (#26, docs/PROTOCOL.md "Super-seeding").

A step whose shards all went to one node first (a one-shard LoRA adapter step, in bench/lora.py) spreads only if
the nodes the origin defers learn of that holder in time. With `p2p.http = false` the origin used to name a holder
only at an HTTP shard address, and a deferred node dropped anything else: it waited for gossip, was deferred 3 times
and then took the shard from the origin (bench/lora.py: 16 origin copies, 0 bytes from peers). Real components
throughout: the coordinator's HTTP server (super-seeding, the join's dial-back), two libp2p hosts on loopback, the
worker's Fetcher, HttpSource and PeerSource."""
from __future__ import annotations

import contextlib
import time

import aiohttp

from node.checkpoint_dir import CheckpointDir
from node.p2p.config import P2PConfig
from node.p2p.host import P2PNode
from node.p2p.shard_store import CheckpointShards
from node.worker.client import CoordinatorClient
from node.worker.fetcher import Fetcher
from node.worker.peers import PeerSource
from node.worker.sources import HttpSource
from protocol import messages as M
from protocol.identity import Identity
from protocol.signing import sign_request
from tests.integration.coordinator_harness import running_coordinator


async def _joined_node(tmp, name: str, base: str, coord, session, stack, *, http: bool = False,
                       serves_http: bool = True) -> tuple[P2PNode, Fetcher]:
    """A worker's fetch side, joined as node/worker/node.py joins: its listen ports dialled back, then announcing
    what the coordinator reached; libp2p only (`p2p.http = false`) unless `http`, not connected to anyone.
    `serves_http=False`: its HTTP shard server was not reached (as behind NAT): it announces none, and tells the
    origin none, but fetches over HTTP."""
    key, run_id = coord.identity.public_hex, coord.cfg.run.run_id
    identity = Identity.generate()
    store = CheckpointDir(tmp / name)
    p2p = P2PNode(identity, P2PConfig(listen_host="127.0.0.1", http=http, allow_private_addrs=True), run_id=run_id,
                  coordinator_key=key, shard_source=CheckpointShards(store.ckpt_dir))
    await p2p.start()
    stack.push_async_callback(p2p.stop)
    ports = p2p.listen_ports() if serves_http else {**p2p.listen_ports(), "http": None}
    spec = await CoordinatorClient(base, identity, session).join(M.NodeInfo(listen_ports=M.ListenPorts(**ports)))
    assert spec.reachability is not None and spec.reachability.libp2p, spec.reachability
    p2p.apply_reachability(spec.reachability.observed_ip, spec.reachability.libp2p,
                           spec.reachability.http if serves_http else False)
    origin = HttpSource(base, "coordinator", session, swarm=True,
                        signer=lambda m, path: sign_request(identity, m, path, b"", run_id=run_id),
                        shard_addr=lambda: p2p.origin_shard_addrs)
    # on_shards as the worker's (node.py _on_shards): the peer table learns the step's signed manifest
    fetcher = Fetcher(store, [origin, PeerSource(p2p)], key, keep=3, on_new_step=lambda s, p: None,
                      on_shards=lambda step, h, indices: p2p.note_manifest(step, h))
    return p2p, fetcher


async def test_a_libp2p_node_the_origin_defers_fetches_from_the_holder_it_names(tmp_path):
    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=10.0") as (coord, base):
        m = coord.checkpoints.manifest(0)
        assert m is not None
        async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as stack:
            _, first = await _joined_node(tmp_path, "a", base, coord, session, stack)
            _, deferred = await _joined_node(tmp_path, "b", base, coord, session, stack)
            assert await first.sync_once() == 0  # every first copy goes to the one node asking
            assert first.bytes_by_kind["coordinator"] == m.compressed_size
            t0 = time.monotonic()
            assert await deferred.sync_once() == 0
            took = time.monotonic() - t0
    # Named at the libp2p address the dial-back reached, the holder served every shard at once; before, the deferred
    # node got no name it could use, waited out 3 deferrals (2 s apart) and took every shard from the origin.
    assert deferred.bytes_by_kind["peer"] == m.compressed_size, deferred.bytes_by_kind
    assert deferred.bytes_by_kind["coordinator"] == 0
    assert took < 4.0, took


async def test_a_node_that_serves_no_http_fetches_from_the_named_holder_over_http(tmp_path):
    """Behind NAT a node's HTTP shard server is not reached, so it tells the origin no /http address of its own, but
    it fetches over HTTP. The origin named it only the holder's libp2p address, and it took every shard over
    py-libp2p: in the WAN lab 0.6-0.9 s a shard, against two round trips over HTTP (docs/BENCHMARKS.md, "A NATed
    node's peer shards over HTTP"). Now the 429 names both addresses and the shards come over HTTP."""
    from node.aio import client_counts

    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=10.0") as (coord, base):
        m = coord.checkpoints.manifest(0)
        assert m is not None
        async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as stack:
            _, first = await _joined_node(tmp_path, "a", base, coord, session, stack, http=True)
            p2p, deferred = await _joined_node(tmp_path, "b", base, coord, session, stack, http=True,
                                               serves_http=False)
            assert not any(a.endswith("/http") for a in p2p.origin_shard_addrs)
            assert await first.sync_once() == 0
            assert await deferred.sync_once() == 0
            over_http = client_counts(p2p.http_session)["requests"]
    assert deferred.bytes_by_kind["peer"] == m.compressed_size, deferred.bytes_by_kind
    assert over_http == m.num_shards, over_http  # before: 0 (every shard over libp2p)


async def test_a_node_deferred_while_the_first_copy_is_in_flight_is_told_its_holder_when_it_lands(tmp_path):
    """The origin's upload capped so that the first copies take ~0.4 s: node b asks while they are in flight to a. Its
    requests are held until a's copies are out, then answered 429 with a named as the holder, and b takes every
    shard from a at once. Before, the 429 came at once with no holder (the copy was not finished); b, hearing no
    gossip, waited out its 2 s deferral before asking the origin again (in the WAN lab, ~0.7 s of a delta's slowest
    shard went to that wait: docs/BENCHMARKS.md, "Where a delta's fetch goes")."""
    import asyncio

    rate = 2_000_000  # bytes/s: step 0 (0.83 MB in 5 shards) takes ~0.4 s to send
    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=10.0",
                                   f"distribution.origin_upload_limit={rate}") as (coord, base):
        m = coord.checkpoints.manifest(0)
        assert m is not None and 0.2 < m.compressed_size / rate < 0.8, m.compressed_size  # else retune the rate
        async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as stack:
            _, first = await _joined_node(tmp_path, "a", base, coord, session, stack)
            _, deferred = await _joined_node(tmp_path, "b", base, coord, session, stack)
            a = asyncio.create_task(first.sync_once())
            t_end = time.monotonic() + 5
            while not any(c.finished is None for c in coord.seeder._claims.values()):  # a first copy under way
                assert time.monotonic() < t_end and not a.done(), "a's first copies never started"
                await asyncio.sleep(0.002)
            t0 = time.monotonic()
            assert await deferred.sync_once() == 0
            took = time.monotonic() - t0
            assert await a == 0
    assert first.bytes_by_kind["coordinator"] == m.compressed_size
    assert deferred.bytes_by_kind["peer"] == m.compressed_size, deferred.bytes_by_kind
    assert took < 1.9, took  # before: >= 2 s (the node's own deferral), for every shard


async def test_a_node_asking_after_the_first_copies_went_out_is_named_their_holders_with_the_manifest(tmp_path):
    """Node b asks for step 0 after a took every first copy. The origin names a with the manifest
    (X-Prime-Shard-Holder), and b asks the origin for nothing but the listing and the manifest: every shard comes
    from a. Before, b asked the origin for each shard first and learnt the holder from its 429, a round trip later
    (in the WAN lab ~0.25 s of the farthest home's step: docs/BENCHMARKS.md, "Holders named with the manifest")."""
    from node.aio import client_counts, counted_session

    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=10.0") as (coord, base):
        m = coord.checkpoints.manifest(0)
        assert m is not None
        async with aiohttp.ClientSession() as session, counted_session() as b_session, \
                contextlib.AsyncExitStack() as stack:
            _, first = await _joined_node(tmp_path, "a", base, coord, session, stack, http=True)
            _, late = await _joined_node(tmp_path, "b", base, coord, b_session, stack, http=True)
            assert await first.sync_once() == 0
            assert first.bytes_by_kind["coordinator"] == m.compressed_size
            sent0 = client_counts(b_session)["requests"]
            assert await late.sync_once() == 0
            to_origin = client_counts(b_session)["requests"] - sent0
    assert late.bytes_by_kind["peer"] == m.compressed_size, late.bytes_by_kind
    assert to_origin == 2, to_origin  # the listing and the manifest; before: 2 + one 429 a shard (7)


def test_the_origin_repeats_only_libp2p_addresses_its_dial_back_reached():
    """The gate keeps a node's libp2p address only in the form `/ip4/<ip>/tcp/<port>` (its /p2p/ suffix dropped:
    the deferred node derives the peer id from the node id), only if the address policy allows the IP and only if
    the join's dial-back reached that IP and port; an HTTP-plane requester is named the holder's HTTP server."""
    from node.coordinator.reachability import DialBack, NodeReach
    from node.coordinator.seeding import SeedingGate, SuperSeeder

    dial = DialBack()
    dial._remember("n", NodeReach("8.8.8.8", True, True, 8080, 4001))
    gate = SeedingGate(SuperSeeder(5.0), verifier=None, is_member=lambda n: True, verified=dial.http_addr_verified)
    gate._remember_addrs("n", ["/ip4/8.8.8.8/tcp/8080/http", "/ip4/8.8.8.8/tcp/4001/p2p/12D3KooWabc"])
    assert gate.shard_addrs["n"] == "/ip4/8.8.8.8/tcp/8080/http" and gate.libp2p_addrs["n"] == "/ip4/8.8.8.8/tcp/4001"
    gate.seeder.started((0, 0), "n")
    gate.seeder.finished((0, 0), "n")
    # both addresses, the one an older node reads (the first value) chosen as before
    assert gate._holder_header((0, 0), over_http=False).getall("X-Prime-Holder") == [
        "n /ip4/8.8.8.8/tcp/4001", "n /ip4/8.8.8.8/tcp/8080/http"]
    assert gate._holder_header((0, 0), over_http=True).getall("X-Prime-Holder") == [
        "n /ip4/8.8.8.8/tcp/8080/http", "n /ip4/8.8.8.8/tcp/4001"]
    for bad in ("/ip4/8.8.8.8/tcp/4002", "/ip4/1.1.1.1/tcp/4001", "/ip6/8.8.8.8/tcp/4001", "/dns4/x.example/tcp/4001",
                "/ip4/8.8.8.8/tcp/4001/ws"):
        gate._remember_addrs("n", [bad])
        assert "n" not in gate.libp2p_addrs and "n" not in gate.shard_addrs, bad
    dial._remember("m", NodeReach("127.0.0.1", True, None, None, 4001))
    gate._remember_addrs("m", ["/ip4/127.0.0.1/tcp/4001"])  # loopback: only where allow_private_addrs says so
    assert "m" not in gate.libp2p_addrs
    gate.allow_private_addrs = True
    gate._remember_addrs("m", ["/ip4/127.0.0.1/tcp/4001"])
    assert gate.libp2p_addrs["m"] == "/ip4/127.0.0.1/tcp/4001"


def test_a_libp2p_hint_is_kept_with_the_holders_peer_id_and_only_where_the_policy_allows():
    """PeerSource.hint on a real (unstarted) host: the origin's `/ip4/<ip>/tcp/<port>` gets the peer id of the named
    node appended; a private address is kept only with allow_private_addrs; an address that is not a literal IP
    of its protocol's version, or not TCP, is dropped; an /http hint is kept as before."""
    holder = Identity.generate()
    holder_peer = P2PNode(holder, P2PConfig(), run_id="r").peer_id
    h = "ab" * 32
    for allow in (False, True):
        host = P2PNode(Identity.generate(), P2PConfig(allow_private_addrs=allow), run_id="r")
        host.note_manifest(3, h)
        source = PeerSource(host)
        for bad in ("/ip4/::1/tcp/4001", "/dns4/x.example/tcp/4001", "/ip4/8.8.8.8/udp/4001", "/ip4/8.8.8.8/tcp/0"):
            source.hint(3, h, 0, holder.public_hex, bad)
        assert host.table.addrs_of(holder_peer) == ()
        source.hint(3, h, 0, holder.public_hex, "/ip4/127.0.0.1/tcp/4001")
        assert host.table.addrs_of(holder_peer) == (("/ip4/127.0.0.1/tcp/4001/p2p/" + holder_peer,) if allow else ())
        source.hint(3, h, 1, holder.public_hex, "/ip4/8.8.8.8/tcp/4001")
        source.hint(3, h, 1, holder.public_hex, "/ip4/8.8.8.8/tcp/8080/http")
        assert host.table.addrs_of(holder_peer)[-2:] == ("/ip4/8.8.8.8/tcp/4001/p2p/" + holder_peer,
                                                         "/ip4/8.8.8.8/tcp/8080/http")
        assert source.holders(3, 1, h) == 1
