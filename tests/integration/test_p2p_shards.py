"""Shard exchange over `/prime-node/shard/1.0.0` between real libp2p hosts on 127.0.0.1."""
import asyncio
import hashlib
import os
import threading
import time

import pytest
import zstandard

from node.p2p.errors import (
    P2PError,
    ShardBusy,
    ShardFetchTimeout,
    ShardNotFound,
    ShardPeerGone,
    ShardTooLarge,
)
from node.p2p.host import P2PNode
from node.p2p.shard_store import manifest_hash
from protocol.identity import Identity
from protocol.signing import canonical_json
from tests.p2p_helpers import p2p_config, running

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]

RUN = "run-shards"
KIB = 1024


def write_checkpoint(root, step: int, n_shards: int, raw_size: int) -> tuple[dict, list[bytes]]:
    """A checkpoint directory as docs/PROTOCOL.md, "Layout" lays it out: real zstd shards and a manifest."""
    rng = os.urandom(raw_size // 4)
    shards = []
    (root / str(step) / "shards").mkdir(parents=True)
    for i in range(n_shards):
        # Half random, half repetitive: compresses a little, like bf16 weights do.
        raw = (rng + bytes([i]) * (raw_size // 4) + os.urandom(raw_size // 2))[:raw_size]
        z = zstandard.ZstdCompressor(level=1).compress(raw)
        (root / str(step) / "shards" / f"{i:05d}.zst").write_bytes(z)
        shards.append(z)
    manifest = {"format": "prime-node/checkpoint/v1", "run_id": RUN, "step": step,
                "shards": [{"index": i, "zsize": len(z), "sha256": hashlib.sha256(z).hexdigest()}
                           for i, z in enumerate(shards)]}
    (root / str(step) / "manifest.json").write_bytes(canonical_json(manifest))
    return manifest, shards


def node(*, shard_root=None, shard_source=None, coordinator_key=None, **settings) -> P2PNode:
    """A host on 127.0.0.1 with `settings` (P2PConfig fields) over the defaults; the libp2p plane alone unless a
    test asks for `http` (this file tests /prime-node/shard/1.0.0; the HTTP plane has test_p2p_http.py)."""
    settings.setdefault("http", False)
    return P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True, **settings), run_id=RUN,
                   shard_root=shard_root, shard_source=shard_source, coordinator_key=coordinator_key)


async def test_many_shards_in_parallel_byte_exact_with_manifest_check(tmp_path):
    manifest, shards = write_checkpoint(tmp_path, 3, n_shards=24, raw_size=256 * KIB)  # ~5 MiB compressed
    h = manifest_hash(manifest)
    # This client may take every slot: the per-peer limit (default 4) is raised to match.
    async with running(node(shard_root=tmp_path, max_concurrent_streams=8, max_streams_per_peer=8),
                       node(listen=False)) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        limit = asyncio.Semaphore(8)  # what a fetcher does: no more in flight than the peer serves

        async def get(i):
            async with limit:
                return await client.fetch_shard(peer, 3, i, max_bytes=1 << 20, manifest_hash=h)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(get(i) for i in range(len(shards))))
        elapsed = time.perf_counter() - t0
        assert got == shards
        for data, entry in zip(got, manifest["shards"]):
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        total = sum(map(len, shards))
        assert total > 4 * 1024 * KIB
        assert client.stats.bytes_fetched_by_peer() == {peer: total}
        assert server.stats.bytes_served_by_peer() == {client.peer_id: total}
        assert client.stats.snapshot()["shards_fetched_by_peer"] == {peer: len(shards)}
        print(f"fetched {total / 2**20:.1f} MiB in {len(shards)} shards over loopback in {elapsed:.2f} s")

        # The same step number of another checkpoint (another run, a re-published step): refused.
        with pytest.raises(ShardNotFound):
            await client.fetch_shard(peer, 3, 0, max_bytes=1 << 20, manifest_hash="00" * 32)
        with pytest.raises(ShardNotFound, match="not found"):
            await client.fetch_shard(peer, 3, 24, max_bytes=1 << 20)
        with pytest.raises(ShardNotFound):
            await client.fetch_shard(peer, 4, 0, max_bytes=1 << 20)
        with pytest.raises(ShardTooLarge):
            await client.fetch_shard(peer, 3, 0, max_bytes=len(shards[0]) - 1)
        assert server.stats.snapshot()["requests_refused"] == {"not_found": 3, "too_large": 1}


async def test_a_large_shard_crosses_in_full_frames_with_batched_window_updates(monkeypatch):
    """Each Python trip through yamux and Noise costs CPU on both ends (docs/P2P.md, "Shard throughput over
    libp2p"): a 4 MiB shard must cross in about one yamux DATA frame per 65507 bytes (each in one Noise message),
    and the client must return credit once per half window, not after every read. Counted on the client's
    connection by wrapping py-libp2p's frame reader and window-update sender (the transfer itself is real).
    Before: 131 frames (64 KiB writes split in two), and an update per read: a median of one frame's worth."""
    import math
    import statistics

    from libp2p.stream_muxer.yamux import yamux

    from node.p2p.shard_wire import FRAME_PAYLOAD_BYTES

    data = os.urandom(4 * 1024 * KIB)
    frames, updates = [], []
    read_body, send_update = yamux.Yamux._read_data_body, yamux.YamuxStream.send_window_update

    async def counted_body(self, length):
        frames.append((self.peer_id, length))
        return await read_body(self, length)

    async def counted_update(self, increment, skip_lock=False):
        updates.append((self.conn.peer_id, self.stream_id, increment))
        return await send_update(self, increment, skip_lock)

    async with running(node(shard_source=lambda s, i: data), node(listen=False)) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        monkeypatch.setattr(yamux.Yamux, "_read_data_body", counted_body)
        monkeypatch.setattr(yamux.YamuxStream, "send_window_update", counted_update)
        assert await client.fetch_shard(peer, 0, 0, max_bytes=8 << 20) == data
        monkeypatch.undo()
    from_server = [n for p, n in frames if p.to_base58() == server.peer_id]
    by_stream: dict[int, list[int]] = {}
    for p, stream, n in updates:
        if p.to_base58() == server.peer_id:
            by_stream.setdefault(stream, []).append(n)
    to_server = max(by_stream.values(), key=sum)  # the shard's stream (others: gossip, identify)
    full = math.ceil(len(data) / FRAME_PAYLOAD_BYTES)
    # + multistream-select's 2 answers and the response header
    assert len(from_server) <= full + 3, f"{len(from_server)} DATA frames for {full} frames' worth of shard"
    assert sum(from_server) >= len(data)
    # Credit goes back in batches of at least two frames (a few small ones while the window auto-tunes up); before,
    # one update per read of one frame: a median of one frame's worth.
    assert statistics.median(to_server) >= 1.5 * FRAME_PAYLOAD_BYTES, f"window updates of {sorted(to_server)}"
    assert len(to_server) <= full // 2 + 12, f"{len(to_server)} window updates for a 4 MiB shard"
    print(f"4 MiB shard: {len(from_server)} DATA frames, {len(to_server)} window updates from the client")


async def test_a_small_shard_crosses_in_one_frame_with_its_header():
    """Per request, every frame is a trip through yamux and Noise at both ends: the response header rides with the
    shard's first bytes, so a 1 KiB shard's answer is multistream-select's 2 frames and 1 more (4 before). Frames
    are told apart by what they carry (decrypted, as yamux reads them): the connection's other streams (gossip,
    identify) may send a frame of their own meanwhile (a CI run saw two 255-byte ones)."""
    from libp2p.stream_muxer.yamux import yamux

    from node.p2p.shard_wire import PROTOCOL_ID

    data, empty = os.urandom(KIB), b""
    frames = []
    read_body = yamux.Yamux._read_data_body

    async def counted_body(self, length):
        body = await read_body(self, length)
        frames.append((self.peer_id, bytes(body)))
        return body

    source = {(0, 0): data, (0, 1): empty}
    async with running(node(shard_source=lambda s, i: source.get((s, i))), node(listen=False)) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        yamux.Yamux._read_data_body = counted_body
        try:
            assert await client.fetch_shard(peer, 0, 0, max_bytes=1 << 20) == data
            bodies = [b for p, b in frames if p.to_base58() == server.peer_id]
            assert await client.fetch_shard(peer, 0, 1, max_bytes=1 << 20) == empty  # the header alone
        finally:
            yamux.Yamux._read_data_body = read_body
    # the shard's stream: multistream-select's answer naming the protocol, then one frame with header and shard
    # (before: the header in a frame of its own, then the shard's bytes alone)
    named = [i for i, b in enumerate(bodies) if PROTOCOL_ID.encode() in b]
    carrying = [i for i, b in enumerate(bodies) if data[:64] in b]
    assert len(named) == 1 and len(carrying) == 1 and named[0] < carrying[0], [len(b) for b in bodies]
    frame = bodies[carrying[0]]
    assert frame.endswith(data) and len(frame) > len(data), "the response header was not in the shard's frame"


async def test_busy_when_over_the_concurrency_limit(tmp_path):
    big = os.urandom(600 * KIB)  # ≥ 0.9 s at the limit below: plenty of time to ask again
    source = {(1, 0): big, (1, 1): b"small"}
    # One slot and a thin uplink, so the first transfer is still running when the second asks.
    server = node(shard_source=lambda s, i: source.get((s, i)), max_concurrent_streams=1, upload_limit=600 * KIB)
    async with running(server, node()) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        first = asyncio.ensure_future(client.fetch_shard(peer, 1, 0, max_bytes=1 << 20))
        while not client.stats.bytes_fetched_by_peer():
            await asyncio.sleep(0.01)
        with pytest.raises(ShardBusy, match="busy"):
            await client.fetch_shard(peer, 1, 1, max_bytes=1 << 20)
        assert await first == big
        assert await client.fetch_shard(peer, 1, 1, max_bytes=1 << 20) == b"small"  # the slot is free again
        assert server.stats.snapshot()["requests_refused"] == {"busy": 1}


async def test_upload_limit_paces_the_transfer():
    data = os.urandom(400 * KIB)
    rate = 800 * KIB
    async with running(node(shard_source=lambda s, i: data, upload_limit=rate), node()) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        t0 = time.perf_counter()
        assert await client.fetch_shard(peer, 0, 0, max_bytes=1 << 20) == data
        elapsed = time.perf_counter() - t0
        # 400 KiB at 800 KiB/s, minus the 64 KiB burst: ≈ 0.42 s. Unlimited loopback takes ~10 ms.
        assert 0.3 < elapsed < 3.0, elapsed


async def test_peer_vanishing_mid_transfer_fails_cleanly_then_another_peer_serves(tmp_path):
    data = os.urandom(2 * 1024 * KIB)
    getter = lambda s, i: data if (s, i) == (9, 0) else None  # noqa: E731
    slow = node(shard_source=getter, upload_limit=256 * KIB)  # would take ~8 s
    fast = node(shard_source=getter)
    client = node(listen=False, read_timeout_s=3.0)
    async with running(slow, fast, client):
        [slow_id, fast_id] = await client.connect(slow.listen_addrs + fast.listen_addrs)
        transfer = asyncio.ensure_future(client.fetch_shard(slow_id, 9, 0, max_bytes=4 << 20))
        while client.stats.bytes_fetched_by_peer().get(slow_id, 0) < 256 * KIB:
            await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        await slow.stop()  # the serving peer goes away with the transfer in flight
        with pytest.raises(ShardPeerGone, match="connection lost") as err:
            await transfer
        assert time.perf_counter() - t0 < 5.0  # no hang (and the error type says: not a timeout)
        assert err.value.peer == slow_id and (err.value.step, err.value.index) == (9, 0)
        assert isinstance(err.value, P2PError)
        assert await client.fetch_shard(fast_id, 9, 0, max_bytes=4 << 20) == data
        # Bytes are counted per source, including the partial transfer.
        fetched = client.stats.bytes_fetched_by_peer()
        assert fetched[fast_id] == len(data) and 0 < fetched[slow_id] < len(data)


async def test_stalled_transfer_times_out():
    data = os.urandom(256 * KIB)
    # 1 KiB/s: the server sends one 1 KiB chunk per second; a 0.3 s idle timeout fires between
    # two chunks (a chunk can arrive late under load, never early).
    async with running(node(shard_source=lambda s, i: data, upload_limit=1 * KIB),
                       node(read_timeout_s=0.3)) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        t0 = time.perf_counter()
        with pytest.raises(ShardFetchTimeout, match="timed out"):
            await client.fetch_shard(peer, 0, 0, max_bytes=1 << 20)
        assert time.perf_counter() - t0 < 5.0
        # The server notices the reset at its next write (≤ 1 s later) and frees its slot.
        for _ in range(500):
            if server._service.server.active == 0:
                break
            await asyncio.sleep(0.01)
        assert server._service.server.active == 0


async def test_outbound_only_node_fetches_and_serves_over_its_own_connection(tmp_path):
    manifest, shards = write_checkpoint(tmp_path, 1, n_shards=3, raw_size=64 * KIB)
    worker_data = {(2, 0): b"held by the NATed worker"}
    listener = node(shard_root=tmp_path)
    natted = node(listen=False, shard_source=lambda s, i: worker_data.get((s, i)))
    async with running(listener, natted):
        assert natted.listen_addrs == []
        [peer] = await natted.connect(listener.listen_addrs)
        for i, z in enumerate(shards):
            assert await natted.fetch_shard(peer, 1, i, max_bytes=1 << 20, manifest_hash=manifest_hash(manifest)) == z
        # The listener cannot dial the NATed node, but can use the connection the NATed node opened.
        assert await listener.fetch_shard(natted.peer_id, 2, 0, max_bytes=1024) == b"held by the NATed worker"


async def test_fetch_from_a_peer_learned_only_from_its_announcement(tmp_path):
    """w2 never dialled w1: it learns w1's address from w1's signed `have` (relayed by the hub)."""
    coord = Identity.generate()
    data = os.urandom(100 * KIB)
    hub = P2PNode(coord, p2p_config(allow_private_addrs=True), run_id=RUN, coordinator_key=coord.public_hex)
    w1 = node(coordinator_key=coord.public_hex, shard_source=lambda s, i: data if (s, i) == (4, 7) else None)
    w2 = node(coordinator_key=coord.public_hex, listen=False)
    async with running(hub, w1, w2):
        await w1.connect(hub.listen_addrs)
        await w2.connect(hub.listen_addrs)
        assert await w1.wait_for_mesh(hub.peer_id) and await hub.wait_for_mesh(w2.peer_id)
        sub = w2.subscribe()
        w2.note_manifest(4, "ee" * 32)  # its fetcher verified step 4's manifest: peers' haves for it count
        await w1.announce_have(4, [7], "ee" * 32)
        await sub.get(timeout=10)
        [peer] = w2.peers_with(4, 7)
        assert peer == w1.peer_id and w1.peer_id not in await w2.connected_peers()
        assert await w2.fetch_shard(peer, 4, 7, max_bytes=1 << 20) == data


async def test_unreachable_peer_is_a_clean_error():
    async with running(node(connect_timeout_s=2.0)) as (client,):
        ghost = Identity.generate()
        with pytest.raises(P2PError):
            await client.fetch_shard(ghost.node_id, 1, 0, max_bytes=10)
        with pytest.raises(P2PError, match="could not reach"):
            # A closed port on loopback with a valid peer id.
            from node.p2p.keys import peer_id_for_node

            await client.connect([f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_for_node(ghost.node_id).to_base58()}"])
        with pytest.raises(P2PError, match="multiaddr"):
            await client.connect(["not-an-address"])
    assert not [t for t in threading.enumerate() if t.name.startswith("prime-node-")]


async def test_server_refuses_malformed_requests_and_stalled_clients():
    """A malicious client speaking the protocol badly: garbage, oversized, traversal, silence."""
    import trio
    from libp2p.custom_types import TProtocol

    from node.p2p.shard_wire import PROTOCOL_ID, REQUEST_PREFIX, Status, decode_header
    from node.p2p.stream_io import StreamClosedEarly, read_exactly

    async def raw_exchange(service, peer, wire: bytes) -> tuple[Status, bytes] | str:
        stream = await service.host.new_stream(peer, [TProtocol(PROTOCOL_ID)])
        try:
            if wire:
                await stream.write(wire)
            with trio.fail_after(5):
                status, length = decode_header(await read_exactly(stream, 9))
                return status, await read_exactly(stream, length)
        except StreamClosedEarly:
            return "closed"
        finally:
            await stream.reset()

    traversal = b'{"step":1,"index":0,"max_bytes":10,"path":"../../../etc/passwd"}'
    cases = {
        "oversized_length": REQUEST_PREFIX.pack(10**9) + b"x",
        "not_json": REQUEST_PREFIX.pack(5) + b"hello",
        "traversal_field": REQUEST_PREFIX.pack(len(traversal)) + traversal,
    }
    server = node(shard_source=lambda s, i: b"secret", read_timeout_s=0.5)
    async with running(server, node()) as (server, client):
        [peer] = await client.connect(server.listen_addrs)
        pid = client._peer_id(peer)
        for name, wire in cases.items():
            status, reason = await client._bridge.call(raw_exchange, client._service, pid, wire)
            assert status is Status.BAD_REQUEST, name
            assert b"secret" not in reason
        # A client that opens a stream and says nothing is cut off after read_timeout_s.
        t0 = asyncio.get_running_loop().time()
        assert await client._bridge.call(raw_exchange, client._service, pid, b"") == "closed"
        assert asyncio.get_running_loop().time() - t0 < 3
        assert server.stats.snapshot()["requests_refused"] == {"bad_request": 3}
        assert server._service.server.active == 0
        assert await client.fetch_shard(peer, 1, 0, max_bytes=100) == b"secret"  # still serving


async def test_checkpoint_spreads_through_peers_not_the_coordinator(tmp_path):
    """End to end: the coordinator announces a manifest and serves once over a thin uplink; later
    workers find the shards through gossip and take them from an earlier worker instead."""
    coord_id = Identity.generate()
    manifest, shards = write_checkpoint(tmp_path / "coord", 6, n_shards=6, raw_size=96 * KIB)
    h = manifest_hash(manifest)
    total = sum(map(len, shards))
    coord = P2PNode(coord_id, p2p_config(upload_limit=1024 * KIB, allow_private_addrs=True), run_id=RUN,
                    coordinator_key=coord_id.public_hex, shard_root=tmp_path / "coord")
    held = [dict() for _ in range(3)]
    workers = [P2PNode(Identity.generate(), p2p_config(allow_private_addrs=True), run_id=RUN,
                       coordinator_key=coord_id.public_hex, shard_source=lambda s, i, mine=mine: mine.get((s, i)))
               for mine in held]
    async with running(coord, *workers):
        subs = [w.subscribe() for w in workers]
        for w in workers:
            await w.connect(coord.listen_addrs)
            assert await coord.wait_for_mesh(w.peer_id) and await w.wait_for_mesh(coord.peer_id)
        await coord.announce_manifest(6, h)
        for w, sub in zip(workers, subs):
            assert (await sub.get(timeout=10)).announcement.manifest_hash == h == w.manifest_hash(6)
        for w, mine in zip(workers, held):
            for i, entry in enumerate(manifest["shards"]):
                sources = [p for p in w.peers_with(6, i, manifest_hash=h) if p != w.peer_id] + [coord.peer_id]
                data = await w.fetch_shard(sources[0], 6, i, max_bytes=1 << 20, manifest_hash=h)
                assert hashlib.sha256(data).hexdigest() == entry["sha256"]  # what the fetcher checks
                mine[(6, i)] = data
            await w.announce_have(6, range(len(shards)), h)
            # Give the announcement time to reach the next worker before it starts.
            for other_sub in subs[workers.index(w) + 1:]:
                while True:
                    ev = await other_sub.get(timeout=10)
                    if ev.peer_id == w.peer_id:
                        break
        assert all(mine == {(6, i): z for i, z in enumerate(shards)} for mine in held)
        served = coord.stats.bytes_served_by_peer()
        assert sum(served.values()) == total  # the coordinator's uplink carried the checkpoint once
        # The two later workers were fed by peers (newest announcer first: w0 fed w1, w1 fed w2).
        assert [w.stats.snapshot()["bytes_served"] for w in workers] == [total, total, 0]
