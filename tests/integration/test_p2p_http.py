"""Shard bytes between nodes over HTTP (node/p2p/http_shards.py) and the origin naming a shard's first
holder, against real aiohttp servers and real libp2p hosts on 127.0.0.1: the happy path, a dead HTTP
address (libp2p carries the shard), hostile servers (oversize, trickle, redirect, short body, errors) and
hostile requests (bad numbers, bad hash, not held, busy)."""
import asyncio
import contextlib
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from node.p2p.announce import decode_announcement, encode_have_announcement
from node.p2p.errors import ShardBusy, ShardFetchTimeout, ShardNotFound, ShardPeerGone, ShardProtocolError, ShardTooLarge
from node.p2p.http_shards import (HAVE_BITS, HAVE_TTL_S, PATH, HttpShardServer, decode_have, encode_have, fetch_shard_http,
                                  http_addr, pick_url, url_of)
from node.p2p.peer_table import PeerTable
from node.p2p.shard_store import CheckpointShards, DirectoryShardStore, manifest_hash
from node.p2p.stats import P2PStats
from tests.integration.coordinator_harness import RawNode, running_coordinator
from tests.integration.test_p2p_shards import RUN, node, running, write_checkpoint

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]
KIB = 1024


@contextlib.asynccontextmanager
async def holder_serving(handler):
    """A stand-in peer HTTP shard server answering every shard request with `handler`; yields its base URL."""
    app = web.Application()
    app.router.add_get(PATH, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def record_have(table: PeerTable, holder, step: int, indices: list[int], h: str, addrs: list[str]) -> None:
    """What a verified gossip `have` from `holder` does to a node's table (signed with its key)."""
    data = encode_have_announcement(holder.identity, run_id=RUN, step=step, manifest_hash=h, indices=indices,
                                    addrs=addrs)
    ann = decode_announcement(data, run_id=RUN, coordinator_key=None, origin_node_id=holder.node_id, max_age_s=60)
    table.note_manifest(step, h)  # the node's fetcher verified this manifest: peers' haves for it count
    assert table.record_have(holder.peer_id, ann)


def test_only_literal_ip_http_addresses_are_dialled():
    assert url_of("/ip4/127.0.0.1/tcp/8080/http", allow_private=True) == "http://127.0.0.1:8080"
    assert url_of("/ip6/::1/tcp/8080/http", allow_private=True) == "http://[::1]:8080"
    assert http_addr("127.0.0.1", 9) == "/ip4/127.0.0.1/tcp/9/http"
    for bad in ("/dns4/example.org/tcp/80/http", "/ip4/127.0.0.1/tcp/0/http", "/ip4/127.0.0.1/tcp/70000/http",
                "/ip4/::1/tcp/80/http", "/ip4/224.0.0.1/tcp/80/http", "/ip4/0.0.0.0/tcp/80/http",
                "/ip4/127.0.0.1/tcp/80/http/x", "/ip4/127.0.0.1/tcp/80", "/ip4/1.2.3/tcp/80/http", 7, None):
        assert url_of(bad, allow_private=True) is None, bad
    assert pick_url(["/ip4/127.0.0.1/tcp/1/p2p/x", "/dns4/a/tcp/1/http", "/ip4/127.0.0.1/tcp/2/http"],
                    allow_private=True) == "http://127.0.0.1:2"
    assert url_of("/ip4/127.0.0.1/tcp/8080/http") is None  # loopback only when allowed (test_attack_announcements)


def test_a_hint_from_the_origin_adds_one_holder():
    t = PeerTable(allow_private_addrs=True)
    t.note_manifest(3, "ab" * 32)
    t.record_hint("peerA", 3, "ab" * 32, (5,), "/ip4/127.0.0.1/tcp/9/http")
    assert t.peers_with(3, 5, "ab" * 32) == ["peerA"] and t.peers_with(3, 4, "ab" * 32) == []
    assert t.addrs_of("peerA") == ("/ip4/127.0.0.1/tcp/9/http",)


def test_the_have_bitfield_round_trips_and_refuses_what_is_not_one():
    for held in ([], [0], [7, 8], [0, 5, 36], list(range(100)), [HAVE_BITS - 1]):
        assert decode_have(encode_have(held)) == held
    assert encode_have([0, 9]) == "gEA=" and decode_have("gEA=") == [0, 9]  # shard i is bit 7 - i % 8 of byte i // 8
    assert decode_have(encode_have([3, HAVE_BITS, 99_999])) == [3]  # past the bitfield: not told
    too_long = encode_have([HAVE_BITS - 1]) + "AAAA"
    for bad in ("not base64!", "gEA", " gEA=", "gEA=\n", too_long, "A" * 100_000, None, 7):
        assert decode_have(bad) is None, bad


def test_a_store_tells_only_the_verified_shard_files_of_that_manifest(tmp_path):
    manifest, _ = write_checkpoint(tmp_path, 3, n_shards=4, raw_size=8 * KIB)
    h = manifest_hash(manifest)
    shards = tmp_path / "3" / "shards"
    (shards / "00002.zst").rename(shards / "00002.zst.part")  # still downloading
    for stray in ("00009.zst.tmp", "abcde.zst", "0007.zst", "000010.zst", "notes.txt"):
        (shards / stray).write_bytes(b"x")
    assert DirectoryShardStore(tmp_path).held(3, h) == {0, 1, 3}
    assert DirectoryShardStore(tmp_path).held(3, "cd" * 32) == set()  # another checkpoint under step 3
    assert DirectoryShardStore(tmp_path).held(4, h) == set()  # no such step
    assert CheckpointShards(tmp_path).held(3, h) == {0, 1, 3}


async def test_one_fetch_over_http_tells_the_holders_whole_set(tmp_path):
    """A node that knew one shard of a holder (the origin's hint) learns the rest from that fetch's answer."""
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=6, raw_size=32 * KIB)
    h = manifest_hash(manifest)
    async with running(node(shard_root=tmp_path, http=True), node(listen=False, http=True)) as (server, client):
        [http] = [a for a in server.announce_addrs if a.endswith("/http")]
        client.note_manifest(3, h)
        client.table.record_hint(server.peer_id, 3, h, (0,), http)
        assert client.table.peers_with(3, 5, h) == []
        assert await client.fetch_shard(server.peer_id, 3, 0, 1 << 20, manifest_hash=h) == shards[0]
        assert all(client.table.peers_with(3, i, h) == [server.peer_id] for i in range(6))
        assert client.table.peers_with(3, 6, h) == []


async def test_a_holder_that_claims_shards_it_does_not_serve_costs_one_refusal_per_shard(tmp_path):
    """A liar claims every shard (its bitfield, or gossip) and answers 404: the swarm source gets each shard
    from the honest holder and stops asking the liar for the shards it refused."""
    from node.worker.peers import PeerSource

    manifest, shards = write_checkpoint(tmp_path / "honest", 3, n_shards=4, raw_size=32 * KIB)
    h = manifest_hash(manifest)
    async with running(node(shard_root=tmp_path / "honest", http=True), node(shard_root=tmp_path / "empty", http=True),
                       node(listen=False, http=True)) as (honest, liar, client):
        client.note_manifest(3, h)
        for holder in (honest, liar):
            [http] = [a for a in holder.announce_addrs if a.endswith("/http")]
            client.table.record_hint(holder.peer_id, 3, h, range(4), http)
        source = PeerSource(client)
        for _ in range(3):  # the holder is picked at random: the liar is asked each shard at most once
            for i in range(4):
                assert await source.shard(3, i, 1 << 20, manifest_hash=h) == shards[i]
        refused = liar.stats.snapshot()["requests_refused"].get("not_found", 0)
        still_claimed = sum(liar.peer_id in client.table.peers_with(3, i, h) for i in range(4))
        assert refused + still_claimed == 4 and refused <= 4


async def test_shards_travel_over_http_between_nodes_and_libp2p_takes_over_from_a_dead_address(tmp_path):
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=6, raw_size=512 * KIB)  # ~400 KiB each, compressed
    h = manifest_hash(manifest)
    async with running(node(shard_root=tmp_path, http=True), node(listen=False, http=True)) as (server, client):
        http = [a for a in server.announce_addrs if a.endswith("/http")]
        assert len(http) == 1 and url_of(http[0], allow_private=True) is not None
        [peer] = await client.connect(server.listen_addrs)
        record_have(client.table, server, 3, list(range(6)), h, server.announce_addrs)
        got = [await client.fetch_shard(peer, 3, i, 1 << 20, manifest_hash=h) for i in range(3)]
        assert got == shards[:3]
        served = server.stats.snapshot()["bytes_served_by_peer"]
        assert list(served) == ["http:127.0.0.1"] and served["http:127.0.0.1"] == sum(map(len, shards[:3]))
        # the same holder now announces an HTTP address where nothing listens: libp2p carries the shard
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = http_addr("127.0.0.1", sock.getsockname()[1])
        record_have(client.table, server, 3, list(range(6)), h,
                    [a for a in server.announce_addrs if not a.endswith("/http")] + [dead])
        assert await client.fetch_shard(peer, 3, 4, 1 << 20, manifest_hash=h) == shards[4]
        assert peer in client._http_failed
        assert server.stats.snapshot()["bytes_served_by_peer"].get(client.peer_id) == len(shards[4])  # libp2p


async def test_a_request_for_a_shard_on_its_way_here_waits_for_it(tmp_path, monkeypatch):
    """The origin names a first copy's holder once it has sent the last byte; the holder has yet to receive and verify
    it. Asked in that moment, the holder's server used to answer "not here" at once, and the asker went back to the
    origin (~0.3 s in the WAN lab). Now a request for a shard of a step being downloaded here (a partial step of that
    manifest) waits for it, at most ARRIVAL_WAIT_S; a step not downloading here is answered at once, and at most
    `max_concurrent` requests wait (hostile: a flood of requests for shards that never come holds nothing more)."""
    import node.p2p.http_shards as hs

    ckpt = tmp_path / "checkpoints"
    manifest, shards = write_checkpoint(ckpt, 3, n_shards=2, raw_size=64 * KIB)
    partial = ckpt / ".partial-3"
    (ckpt / "3").rename(partial)
    for f in (partial / "shards").iterdir():
        f.unlink()
    h = manifest_hash(manifest)
    monkeypatch.setattr(hs, "ARRIVAL_WAIT_S", 1.5, raising=False)
    server = HttpShardServer(CheckpointShards(ckpt), stats=P2PStats(), max_concurrent=2, max_bytes=1 << 20,
                             read_timeout_s=2)
    port = await server.start("127.0.0.1")
    base = f"http://127.0.0.1:{port}"

    async def get(path: str) -> tuple[int, bytes, float]:
        t0 = time.monotonic()
        async with s.get(base + path) as r:
            return r.status, await r.read(), time.monotonic() - t0

    async def lands(i: int, after_s: float) -> None:  # as the fetcher commits a verified shard: a rename
        await asyncio.sleep(after_s)
        (partial / "shards" / f"{i:05d}.tmp").write_bytes(shards[i])
        (partial / "shards" / f"{i:05d}.tmp").rename(partial / "shards" / f"{i:05d}.zst")

    try:
        async with aiohttp.ClientSession() as s:
            landing = asyncio.create_task(lands(1, 0.2))
            status, body, took = await get(f"/v1/p2p/shards/3/1?manifest={h}")
            await landing
            assert status == 200 and body == shards[1] and 0.15 < took < 1.4, (status, took)  # before: 404 at once
            status, _, took = await get(f"/v1/p2p/shards/3/0?manifest={h}")  # never comes: "not here" after the wait
            assert status == 404 and 1.45 < took < 5, (status, took)
            status, _, took = await get(f"/v1/p2p/shards/4/0?manifest={h}")  # a step not downloading here: at once
            assert status == 404 and took < 0.75, took
            status, _, took = await get(f"/v1/p2p/shards/3/0?manifest={'cd' * 32}")  # another manifest: at once
            assert status == 404 and took < 0.75, took
            flood = await asyncio.gather(*(get(f"/v1/p2p/shards/3/0?manifest={h}") for _ in range(6)))
            quick = [t for st, _, t in flood if st == 404 and t < 0.75]
            assert len(quick) == 4 and all(st == 404 for st, _, _ in flood), flood  # 2 waited, 4 answered at once
            # the step completes while a request waits (its last shard lands and the partial directory becomes the
            # step at once): the request is answered from the complete step
            waiting = asyncio.create_task(get(f"/v1/p2p/shards/3/0?manifest={h}"))
            await asyncio.sleep(0.15)
            (partial / "shards" / "00000.zst").write_bytes(shards[0])
            partial.rename(ckpt / "3")
            status, body, took = await waiting
            assert status == 200 and body == shards[0] and took < 1.4, (status, took)
            assert server.waiting == 0
    finally:
        await server.stop()


async def test_the_http_shard_server_refuses_bad_requests_without_a_500(tmp_path):
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=2, raw_size=64 * KIB)
    h = manifest_hash(manifest)
    from node.p2p.shard_store import DirectoryShardStore

    server = HttpShardServer(DirectoryShardStore(tmp_path), stats=P2PStats(), max_concurrent=1,
                             max_bytes=1 << 20, read_timeout_s=2)
    port = await server.start("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async def status(path: str) -> int:
                async with s.get(base + path, allow_redirects=False) as r:
                    await r.read()
                    return r.status

            assert await status(f"/v1/p2p/shards/3/1?manifest={h}") == 200
            assert await status(f"/v1/p2p/shards/3/7?manifest={h}") == 404  # not held
            assert await status(f"/v1/p2p/shards/3/1?manifest={'cd' * 32}") == 404  # another manifest
            for path, held in ((f"/v1/p2p/shards/3/1?manifest={h}", [0, 1]), (f"/v1/p2p/shards/3/7?manifest={h}", [0, 1]),
                               (f"/v1/p2p/shards/3/1?manifest={'cd' * 32}", [])):
                async with s.get(base + path) as r:  # every answer says what this server holds of that checkpoint
                    assert decode_have(r.headers["X-Prime-Have"]) == held
            for bad in (f"/v1/p2p/shards/3/1", f"/v1/p2p/shards/3/1?manifest=../../x", f"/v1/p2p/shards/-1/1?manifest={h}",
                        f"/v1/p2p/shards/3/100000?manifest={h}", f"/v1/p2p/shards/99999999999999999999/1?manifest={h}",
                        f"/v1/p2p/shards/3/%C2%B2?manifest={h}"):
                assert await status(bad) == 400, bad
            assert await status(f"/v1/p2p/shards/3/..%2f..%2fmanifest.json?manifest={h}") in (400, 404)
            server.active = 1  # every slot taken
            assert await status(f"/v1/p2p/shards/3/1?manifest={h}") == 429
            async with s.get(base + f"/v1/p2p/shards/3/1?manifest={h}") as r:
                assert r.status == 429 and decode_have(r.headers["X-Prime-Have"]) == [0, 1]
            listings = 0
            real_held = server.store.held

            def counted_held(*a):
                nonlocal listings
                listings += 1
                return real_held(*a)

            server.store.held = counted_held
            t0 = time.monotonic()
            for _ in range(100):  # a flood of refused requests: the directory is listed once per HAVE_TTL_S at most
                assert await status(f"/v1/p2p/shards/3/1?manifest={h}") == 429
            assert listings <= (time.monotonic() - t0) / HAVE_TTL_S + 1
    finally:
        await server.stop()


@pytest.mark.parametrize("behaviour, error", [
    ("oversize", ShardTooLarge), ("chunked", ShardTooLarge), ("redirect", ShardProtocolError),
    ("error", ShardProtocolError), ("busy", ShardBusy), ("missing", ShardNotFound), ("short", ShardPeerGone),
    ("trickle", ShardFetchTimeout),
])
async def test_a_hostile_http_holder_costs_a_clear_error(behaviour, error):
    async def handler(request: web.Request) -> web.StreamResponse:
        if behaviour == "redirect":
            raise web.HTTPFound("http://127.0.0.1:1/elsewhere")
        if behaviour in ("error", "busy", "missing"):
            return web.Response(status={"error": 500, "busy": 429, "missing": 404}[behaviour])
        resp = web.StreamResponse()
        if behaviour != "chunked":
            resp.content_length = {"oversize": 10 << 20, "short": 1000, "trickle": 1000}[behaviour]
        await resp.prepare(request)
        if behaviour == "short":
            await resp.write(b"x" * 10)
            request.transport.close()
        elif behaviour == "trickle":
            await resp.write(b"x")
            await asyncio.sleep(2)  # far past the 0.5 s read timeout; short so cleanup does not wait long
        elif behaviour == "chunked":
            await resp.write(b"x" * 100)
        return resp

    async with holder_serving(handler) as url, aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        with pytest.raises(error):
            await fetch_shard_http(s, url, peer="p", step=3, index=1, manifest_hash="ab" * 32, max_bytes=1 << 20,
                                   stats=P2PStats(), read_timeout_s=0.5, connect_timeout_s=2)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("have", ["!!", "A" * 8000, encode_have([HAVE_BITS - 1]) + "AAAA", "gEA= gEA="])
async def test_a_malformed_have_claim_is_ignored_and_the_shard_still_arrives(have):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 1000, headers={"X-Prime-Have": have})

    heard = []
    async with holder_serving(handler) as url, aiohttp.ClientSession() as s:
        got = await fetch_shard_http(s, url, peer="p", step=3, index=1, manifest_hash="ab" * 32, max_bytes=1 << 20,
                                     stats=P2PStats(), read_timeout_s=2, connect_timeout_s=2, on_have=heard.append)
    assert got == b"x" * 1000 and heard == []


async def test_the_origin_names_the_first_holder_to_a_deferred_node(tmp_path):
    """The node that got a shard's first copy sent its HTTP shard address with its signed request; a node
    deferred afterwards learns who holds the shard and where (X-Prime-Holder), and nothing else does: an
    address that is not a literal-IP /http one, or that the join's dial-back did not reach, is never repeated."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)  # a's HTTP shard server's port
    port = server.sockets[0].getsockname()[1]
    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=5.0") as (coord, base):
        path = "/v1/checkpoints/0/shards/0"
        async with aiohttp.ClientSession() as s:
            a, b, c = RawNode(base, s), RawNode(base, s), RawNode(base, s)
            status, spec = await a.post("/v1/join", {"node": {"listen_ports": {"http": port}}})
            assert status == 200 and spec["reachability"] == {"observed_ip": "127.0.0.1", "libp2p": None, "http": True}
            for n in (b, c):
                assert (await n.post("/v1/join", {}))[0] == 200

            def signed(n, **extra):
                h = n.headers("GET", path, b"")
                del h["Content-Type"]
                return {**h, "X-Prime-Swarm": "1", **extra}

            async with s.get(base + path, headers=signed(a, **{"X-Prime-Shard-Addr": f"/ip4/127.0.0.1/tcp/{port}/http"})) as r:
                assert r.status == 200
                await r.read()
            async with s.get(base + path, headers=signed(b)) as r:
                assert r.status == 429 and (await r.json())["error"] == "seeded"
                assert r.headers["X-Prime-Holder"] == f"{a.pub} /ip4/127.0.0.1/tcp/{port}/http"
            # a claims a port the dial-back never reached: forgotten, not repeated
            async with s.get(base + path, headers=signed(a, **{"X-Prime-Shard-Addr": "/ip4/127.0.0.1/tcp/4242/http"})) as r:
                assert r.status == 200
                await r.read()
            async with s.get(base + path, headers=signed(c)) as r:
                assert r.status == 429 and "X-Prime-Holder" not in r.headers
    server.close()
    await server.wait_closed()
    async with running_coordinator(tmp_path / "2", "distribution.super_seed_seconds=5.0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            a, b = RawNode(base, s), RawNode(base, s)
            for n in (a, b):
                assert (await n.post("/v1/join", {}))[0] == 200
            h = a.headers("GET", path, b"")
            del h["Content-Type"]
            async with s.get(base + path, headers={**h, "X-Prime-Swarm": "1",
                                                   "X-Prime-Shard-Addr": "/dns4/evil.example/tcp/80/http"}) as r:
                assert r.status == 200
                await r.read()
            h = b.headers("GET", path, b"")
            del h["Content-Type"]
            async with s.get(base + path, headers={**h, "X-Prime-Swarm": "1"}) as r:
                assert r.status == 429 and "X-Prime-Holder" not in r.headers


async def test_both_planes_share_one_upload_cap(tmp_path):
    """`upload_limit` is the node's whole upload: a shard going out over HTTP and one over libp2p at the same
    time take their bytes from the same tokens (served alone, each plane would get the full cap)."""
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=2, raw_size=512 * KIB)
    h = manifest_hash(manifest)
    limit = 256 * KIB
    async with running(node(shard_root=tmp_path, http=True, upload_limit=limit), node(listen=False, http=True),
                       node(listen=False)) as (server, over_http, over_libp2p):
        peers = [(await n.connect(server.listen_addrs))[0] for n in (over_http, over_libp2p)]
        for n in (over_http, over_libp2p):
            record_have(n.table, server, 3, [0, 1], h, server.announce_addrs)
        t0 = time.monotonic()
        got = await asyncio.gather(over_http.fetch_shard(peers[0], 3, 0, 1 << 20, manifest_hash=h),
                                   over_libp2p.fetch_shard(peers[1], 3, 1, 1 << 20, manifest_hash=h))
        elapsed = time.monotonic() - t0
        assert list(got) == shards
        # the server counts a chunk once its write returned, which may be after the client has read it all
        want = {"http:127.0.0.1": len(shards[0]), over_libp2p.peer_id: len(shards[1])}
        deadline = time.monotonic() + 5
        while (served := {k: server.stats.snapshot()["bytes_served_by_peer"].get(k) for k in want}) != want \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert served == want
        assert elapsed >= 0.8 * sum(map(len, shards)) / limit, elapsed  # one cap, not one per plane
