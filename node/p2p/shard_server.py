"""Serve `/prime-node/shard/1.0.0` streams (trio side).

One request per stream. Bounded everywhere: the request is ≤ 1 KiB and must arrive within
`read_timeout_s`; at most `max_concurrent` transfers run at once (others get BUSY at once rather
than queueing, so a client can try another peer); a shard above `max_bytes` (ours or the
client's) is refused; each write must make progress within `read_timeout_s` (a reader that stops
reading cannot pin a slot forever); the optional rate limiter is shared by all streams.

py-libp2p swallows exceptions raised by stream handlers, so this handler catches and logs its own.
"""
from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamError

from .rate_limit import TrioRateLimiter
from .shard_store import ShardStore
from .shard_wire import (
    BadRequest,
    MAX_REQUEST_BYTES,
    REQUEST_PREFIX,
    Status,
    decode_request,
    encode_error,
    encode_header,
    parse_request_length,
)
from .stats import P2PStats
from .stream_io import StreamClosedEarly, read_exactly, stream_peer

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024  # one yamux frame


class ShardServer:
    def __init__(self, store: ShardStore | None, *, stats: P2PStats, max_concurrent: int, max_bytes: int,
                 read_timeout_s: float, upload_limit: int = 0):
        self.store = store
        self.stats = stats
        self.max_concurrent = max_concurrent
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.limiter = None
        self.chunk_bytes = CHUNK_BYTES
        if upload_limit > 0:
            # Small chunks under a limit (≈50 ms of traffic each): the sender sleeps briefly and
            # often, so a reader that went away is noticed at the next write, not many seconds later.
            self.chunk_bytes = int(min(CHUNK_BYTES, max(1024, upload_limit // 20)))
            self.limiter = TrioRateLimiter(upload_limit, burst=max(self.chunk_bytes, upload_limit * 0.05))
        self.active = 0

    async def handle(self, stream: Any) -> None:
        peer = stream_peer(stream)
        try:
            await self._serve(stream, peer)
        except (StreamClosedEarly, StreamError, trio.TooSlowError) as e:  # the client left or stalled
            log.info("shard stream from %s ended early: %r", peer, e)
            await _reset(stream)
        except Exception as e:  # never let libp2p swallow it silently
            log.warning("shard stream from %s failed: %r", peer, e)
            await _reset(stream)

    async def _serve(self, stream: Any, peer: str) -> None:
        if self.active >= self.max_concurrent:
            self.stats.count_refused("busy")
            await self._refuse(stream, Status.BUSY, f"serving {self.active} shards already; try another peer")
            return
        self.active += 1
        try:
            try:
                with trio.fail_after(self.read_timeout_s):
                    n = parse_request_length(await read_exactly(stream, REQUEST_PREFIX.size))
                    req = decode_request(await read_exactly(stream, n))
            except BadRequest as e:
                self.stats.count_refused("bad_request")
                await self._refuse(stream, Status.BAD_REQUEST, str(e))
                return
            await self._send_shard(stream, peer, req.step, req.index, req.manifest_hash,
                                   min(req.max_bytes, self.max_bytes))
        finally:
            self.active -= 1

    async def _send_shard(self, stream: Any, peer: str, step: int, index: int, manifest_hash: str | None,
                          limit: int) -> None:
        body = self.store.open(step, index, manifest_hash) if self.store is not None else None
        if body is None:
            self.stats.count_refused("not_found")
            await self._refuse(stream, Status.NOT_FOUND, f"no shard {index} of step {step} here")
            return
        try:
            if body.size > limit:
                self.stats.count_refused("too_large")
                await self._refuse(stream, Status.TOO_LARGE, f"shard is {body.size} bytes, limit {limit}")
                return
            await self._write(stream, encode_header(Status.OK, body.size))
            sent = 0
            for chunk in body.chunks(self.chunk_bytes):
                if self.limiter is not None:
                    await self.limiter.acquire(len(chunk))
                await self._write(stream, chunk)
                sent += len(chunk)
                self.stats.add_served(peer, len(chunk), shard_done=sent == body.size)
        finally:
            body.close()
        await stream.close()

    async def _write(self, stream: Any, data: bytes) -> None:
        with trio.fail_after(self.read_timeout_s):
            await stream.write(data)

    async def _refuse(self, stream: Any, status: Status, reason: str) -> None:
        await self._write(stream, encode_error(status, reason[:MAX_REQUEST_BYTES]))
        await stream.close()


async def _reset(stream: Any) -> None:
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception:  # the connection is already gone; nothing left to tell the peer
            pass
