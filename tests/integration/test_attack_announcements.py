"""Issue #25 findings 6, 8 and 10: hostile peer announcements and addresses, and unbounded per-peer state.

- One libp2p key's far-future `have`s (gossiped to all) must not trim real holder records (real hosts).
- A stranger's address (X-Prime-Shard-Addr, a `have`'s addrs, X-Prime-Holder) that is loopback, link-local or
  private is neither repeated by the coordinator nor dialled by a node unless p2p.allow_private_addrs is on.
  Only 127.0.0.1 is ever connected to here: 169.254.169.254 and 10.x are shown refused before any dial.
- The coordinator's node_bytes and a node's per-peer P2PStats stay bounded however many keys show up.
"""
import asyncio
import contextlib

import aiohttp
import pytest

from node.coordinator.node_bytes import NodeBytes
from node.coordinator.seeding import SeedingGate, SuperSeeder
from node.p2p.addrs import multiaddr_allowed, tcp_endpoint
from node.p2p.announce import MAX_STEP, decode_announcement, encode_have_announcement
from node.p2p.errors import PeerUnavailable
from node.p2p.host import P2PNode
from node.p2p.http_shards import url_of
from node.p2p.peer_table import PeerTable
from node.p2p.shard_store import manifest_hash
from node.p2p.stats import OTHER, P2PStats
from protocol.identity import Identity
from tests.integration.coordinator_harness import RawNode, running_coordinator
from tests.integration.test_p2p_shards import RUN, write_checkpoint
from tests.p2p_helpers import p2p_config

H = "ab" * 32
INTERNAL = ("127.0.0.1", "169.254.169.254", "10.1.2.3")


@contextlib.asynccontextmanager
async def hub_and(coord: Identity, *nodes: P2PNode):
    """A coordinator host (announcing manifests) that every other node dials; gossip meshes formed both ways."""
    hub = P2PNode(coord, p2p_config(allow_private_addrs=True), run_id=RUN, coordinator_key=coord.public_hex,
                  name="hub")
    started = [hub]
    try:
        await hub.start()
        for n in nodes:
            started.append(n)
            await n.start()
            assert await n.connect(hub.listen_addrs) == [hub.peer_id]
        for n in nodes:
            assert await n.wait_for_mesh(hub.peer_id, 5) and await hub.wait_for_mesh(n.peer_id, 5)
        yield hub
    finally:
        await asyncio.gather(*(n.stop() for n in started))


def worker(coord: Identity, name: str, shard_root=None, **settings) -> P2PNode:
    settings.setdefault("allow_private_addrs", True)
    return P2PNode(Identity.generate(), p2p_config(**settings), run_id=RUN, coordinator_key=coord.public_hex,
                   name=name, shard_root=shard_root)


async def next_have(sub, peer: str, timeout: float = 10.0):
    while True:
        ev = await sub.get(timeout=timeout)
        if ev.peer_id == peer and ev.announcement.kind == "have":
            return ev.announcement


# --- finding 6: far-future announcements ---------------------------------------------------------------------------

@pytest.mark.p2p
@pytest.mark.timeout(90)
async def test_far_future_haves_from_one_key_do_not_trim_real_holder_records():
    """A key that never joined gossips `have`s for 10 steps near 2^53 (valid signatures, its own key): the
    observer still knows who holds the real, signed step, and keeps at most 2 of the hostile claims aside."""
    coord = Identity.generate()
    honest, evil, observer = worker(coord, "honest"), worker(coord, "evil"), worker(coord, "observer")
    async with hub_and(coord, honest, evil, observer) as hub:
        sub = observer.subscribe()
        await hub.announce_manifest(5, H)
        await honest.announce_have(5, [0], H)
        await next_have(sub, honest.peer_id)
        assert observer.peers_with(5, 0, H) == [honest.peer_id]
        for i in range(10):
            await evil.announce_have(MAX_STEP - i, [0], "ee" * 32)
        await honest.announce_have(5, [1], H)  # a marker sent after the flood: once here, the flood was too
        await next_have(sub, honest.peer_id)
        assert observer.peers_with(5, 0, H) == [honest.peer_id], "far-future haves trimmed the real step"
        assert observer.peers_with(5, 1, H) == [honest.peer_id]
        assert observer.peers_with(MAX_STEP, 0) == []
        assert observer.table.pending_count() <= 2  # one key holds at most max_pending_per_peer aside
        sub.close()


def _have(identity: Identity, step: int, h: str = H, indices=(0,), addrs=()):
    data = encode_have_announcement(identity, run_id=RUN, step=step, manifest_hash=h, indices=list(indices),
                                    addrs=list(addrs))
    return decode_announcement(data, run_id=RUN, coordinator_key=None, origin_node_id=identity.node_id, max_age_s=60)


def test_haves_are_bounded_by_the_signed_window_and_held_until_signed():
    """Pure PeerTable rules: a `have` ahead of the newest signed step waits (bounded), one far ahead or for
    another manifest than the signed one is dropped, and the window follows the signed steps only."""
    from node.p2p.announce import ManifestAnnouncement

    a, evil = Identity.generate(), Identity.generate()
    t = PeerTable(max_steps=3, allow_private_addrs=True)
    assert t.record_have("A", _have(a, 5)) and t.peers_with(5, 0) == []  # nothing signed yet: held
    assert t.pending_count() == 1
    t.note_manifest(5, H)
    assert t.peers_with(5, 0, H) == ["A"] and t.pending_count() == 0  # released once step 5 is signed
    assert not t.record_have("E", _have(evil, 5, h="cd" * 32))  # not the signed manifest of step 5
    for step in range(10**6, 10**6 + 50):
        assert not t.record_have("E", _have(evil, step))  # far past the newest signed step: dropped
    assert t.record_have("E", _have(evil, 6)) and t.record_have("E", _have(evil, 7))
    assert t.record_have("E", _have(evil, 7, indices=(1,)))
    assert t.pending_count() == 2
    assert t.peers_with(5, 0, H) == ["A"]
    signed = ManifestAnnouncement.model_construct(kind="manifest", run_id=RUN, step=7, manifest_hash="77" * 32,
                                                  ts_ms=1, signer="00" * 32, signature="00" * 64)
    t.record_manifest(signed)  # step 7 signed: E's step-6 claim applies, its step-7 one names another manifest
    assert t.peers_with(6, 0) == ["E"] and t.peers_with(7, 0) == [] and t.pending_count() == 0
    assert t.peers_with(5, 0, H) == ["A"]  # 5..7 is the window
    t.note_manifest(8, "88" * 32)
    assert t.peers_with(5, 0, H) == []  # out of the window now: a signed step moved it
    many = PeerTable(max_pending=8)
    for i in range(100):
        many.record_have(f"P{i}", _have(Identity.generate(), 3))
    assert many.pending_count() == 8


# --- finding 8: internal addresses ---------------------------------------------------------------------------------

def test_internal_addresses_are_refused_unless_allowed():
    for ip in (*INTERNAL, "192.168.1.1", "172.16.0.1", "100.64.0.1", "fe80::1", "::1", "fc00::1", "::ffff:127.0.0.1"):
        v = 6 if ":" in ip else 4
        http = f"/ip{v}/{ip}/tcp/80/http"
        assert url_of(http) is None and not multiaddr_allowed(http, False), ip
        assert not multiaddr_allowed(f"/ip{v}/{ip}/tcp/4001/p2p/12D3KooWx", False), ip
        assert url_of(http, allow_private=True) is not None and multiaddr_allowed(http, True), ip
    assert url_of("/ip4/8.8.8.8/tcp/80/http") == "http://8.8.8.8:80"  # public: usable (never dialled here)
    assert multiaddr_allowed("/ip4/8.8.8.8/tcp/4001/p2p/12D3KooWx", False)
    assert not multiaddr_allowed("/dns4/metadata.internal/tcp/80/http", False)  # resolves to anything
    t = PeerTable()
    t.note_manifest(3, H)
    t.record_have("E", _have(Identity.generate(), 3, addrs=[f"/ip4/{ip}/tcp/80/http" for ip in INTERNAL]))
    t.record_hint("F", 3, H, (0,), "/ip4/169.254.169.254/tcp/80/http")
    assert t.peers_with(3, 0, H) == ["F", "E"] and t.addrs_of("E") == () and t.addrs_of("F") == ()


def test_tcp_endpoint_reads_only_the_exact_forms():
    """node/p2p/addrs.py's one parser of /ip4|ip6/<IP>/tcp/<port>[suffix], which the origin's holder hints
    (seeding.py), a node's hint reader (peers.py) and the HTTP data plane (http_shards.url_of) share."""
    import ipaddress

    assert tcp_endpoint("/ip4/8.8.8.8/tcp/4001") == (ipaddress.ip_address("8.8.8.8"), 4001)
    assert tcp_endpoint("/ip6/2001:4860::8888/tcp/443/http", "/http") == (ipaddress.ip_address("2001:4860::8888"), 443)
    assert tcp_endpoint("/ip4/8.8.8.8/tcp/4001/p2p/12D3KooWx", "[/p2p/<id>]") is not None
    assert tcp_endpoint("/ip4/8.8.8.8/tcp/4001", "[/p2p/<id>]") is not None  # the peer id is optional there
    for bad, suffix in [("/ip4/8.8.8.8/tcp/4001/p2p/12D3KooWx", ""),  # a suffix the caller does not take
                        ("/ip4/8.8.8.8/tcp/80", "/http"), ("/ip4/8.8.8.8/tcp/80/http/x", "/http"),
                        ("/ip4/::1/tcp/80", ""), ("/ip6/8.8.8.8/tcp/80", ""),  # the version must match the IP
                        ("/ip4/8.8.8.800/tcp/80", ""), ("/ip4/8.8.8.8/tcp/0", ""), ("/ip4/8.8.8.8/tcp/65536", ""),
                        ("/dns4/example.com/tcp/80", ""), ("/ip4/8.8.8.8/udp/80", ""), (None, ""), (42, "")]:
        assert tcp_endpoint(bad, suffix) is None, (bad, suffix)
    # the form says nothing of who may be dialled: a loopback endpoint parses, the callers' policies refuse it
    loopback = "/ip4/127.0.0.1/tcp/80/http"
    assert tcp_endpoint(loopback, "/http") is not None and url_of(loopback) is None


@pytest.mark.p2p
@pytest.mark.timeout(90)
async def test_a_loopback_address_in_a_have_is_never_dialled(tmp_path):
    """A holder announces its (real, serving) shard server on 127.0.0.1; a node with allow_private_addrs off
    refuses the address before connecting: nothing reaches the server, and the fetch says why."""
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=2, raw_size=8 * 1024)
    h = manifest_hash(manifest)
    coord = Identity.generate()
    holder = worker(coord, "holder", shard_root=tmp_path, http=True)
    strict = worker(coord, "strict", http=True, allow_private_addrs=False)
    async with hub_and(coord, holder, strict) as hub:
        assert any(a.endswith("/http") for a in holder.announce_addrs)
        sub = strict.subscribe()
        await hub.announce_manifest(3, h)
        await holder.announce_have(3, [0, 1], h)
        await next_have(sub, holder.peer_id)
        assert strict.peers_with(3, 0, h) == [holder.peer_id]  # the claim counts; its addresses do not
        assert strict.table.addrs_of(holder.peer_id) == ()
        with pytest.raises(PeerUnavailable):
            await strict.fetch_shard(holder.peer_id, 3, 0, 1 << 20, manifest_hash=h)
        assert holder.stats.snapshot()["bytes_served"] == 0
        assert holder.peer_id not in await strict.connected_peers()
        sub.close()


async def _get(s: aiohttp.ClientSession, base: str, path: str, node: RawNode, **extra):
    h = node.headers("GET", path, b"")
    del h["Content-Type"]
    async with s.get(base + path, headers={**h, "X-Prime-Swarm": "1", **extra}) as r:
        await r.read()
        return r.status, r.headers.get("X-Prime-Holder")


@pytest.mark.parametrize("ip", INTERNAL)
async def test_the_coordinator_never_repeats_an_internal_shard_addr(tmp_path, ip):
    """A joined node sends X-Prime-Shard-Addr pointing inside the operator's network and takes a shard's
    first copy; a node deferred afterwards is not told that address (X-Prime-Holder) when
    allow_private_addrs is off. The coordinator only stores the header; nothing dials it."""
    path = "/v1/checkpoints/0/shards/0"
    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=5.0",
                                   "p2p.allow_private_addrs=false") as (coord, base):
        async with aiohttp.ClientSession() as s:
            a, b = RawNode(base, s), RawNode(base, s)
            for n in (a, b):
                assert (await n.post("/v1/join", {}))[0] == 200
            assert (await _get(s, base, path, a, **{"X-Prime-Shard-Addr": f"/ip4/{ip}/tcp/80/http"}))[0] == 200
            status, holder = await _get(s, base, path, b)
            assert status == 429 and holder is None, holder


def test_a_node_that_sends_an_internal_address_loses_the_one_it_had():
    gate = SeedingGate(SuperSeeder(5.0), verifier=None, is_member=lambda n: True)
    gate._remember_addr("n", "/ip4/8.8.8.8/tcp/80/http")
    assert gate.shard_addrs["n"] == "/ip4/8.8.8.8/tcp/80/http"
    gate._remember_addr("n", "/ip4/169.254.169.254/tcp/80/http")
    assert "n" not in gate.shard_addrs
    allowed = SeedingGate(SuperSeeder(5.0), verifier=None, is_member=lambda n: True, allow_private_addrs=True)
    allowed._remember_addr("n", "/ip4/127.0.0.1/tcp/80/http")
    assert allowed.shard_addrs["n"] == "/ip4/127.0.0.1/tcp/80/http"


# --- finding 10: bounded per-key and per-peer state -----------------------------------------------------------------

async def test_node_bytes_stay_bounded_after_many_keys(tmp_path):
    """20,000 keys heartbeat once each: the coordinator keeps at most max_nodes rows, forgets rows not heard
    from within the TTL, and the swarm's totals stay whole."""
    nb = NodeBytes(max_nodes=1000, ttl_ms=60_000, sweep_ms=1_000)
    for i in range(20_000):
        nb.record(f"{i:064x}", {"coordinator": 10, "peer": 5}, now_ms=1_000_000)
    assert len(nb) == 1000
    assert nb.totals() == {"coordinator": 200_000, "peer": 100_000}
    nb.record("f" * 64, {"relay": 7}, now_ms=1_000_000 + 120_000)  # two minutes later: the rest expired
    assert len(nb) == 1 and nb.totals()["relay"] == 7 and nb.totals()["coordinator"] == 200_000
    # and the coordinator uses it: heartbeats from many joined keys
    async with running_coordinator(tmp_path) as (coord, base):
        coord.node_bytes.max_nodes = 50
        async with aiohttp.ClientSession() as s:
            nodes = [RawNode(base, s) for _ in range(60)]
            for n in nodes:
                assert (await n.post("/v1/join", {}))[0] == 200
                st, _ = await n.post("/v1/heartbeat", {"policy_step": 0, "bytes_by_source": {"coordinator": 1}})
                assert st == 200
        assert len(coord.node_bytes) == 50
        assert coord.status(max_age_s=0)["checkpoint_bytes_by_source"]["coordinator"] == 60  # the 10 forgotten too


def test_p2p_stats_stay_bounded_after_many_peers():
    """Every fresh key (or HTTP source port) used to add a row to five per-peer counters, all copied on each
    /metrics scrape; now the most recently active 256 are kept and the rest summed under "other"."""
    stats = P2PStats()
    for i in range(10_000):
        stats.add_served(f"peer{i}", 10, shard_done=True)
        stats.count_dropped("bad_signature", peer=f"peer{i}")
    snap = stats.snapshot()
    for key in ("bytes_served_by_peer", "shards_served_by_peer", "announcements_dropped_by_peer"):
        assert len(snap[key]) <= 257, key
    assert sum(snap["bytes_served_by_peer"].values()) == snap["bytes_served"] == 100_000
    assert snap["bytes_served_by_peer"][OTHER] == 10 * (10_000 - 256)
    assert sum(snap["announcements_dropped_by_peer"].values()) == 10_000
    assert "peer9999" in snap["bytes_served_by_peer"]  # the most recent stay named
    totals = stats.totals()  # what /metrics reads: no per-peer tables at all
    assert not any(k.endswith("_by_peer") for k in totals) and totals["bytes_served"] == 100_000
