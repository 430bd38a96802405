"""Serve `/prime-node/shard/1.0.0` streams (trio side).

One request per stream. Bounded everywhere:
- one peer may have at most `max_streams_per_peer` shard streams open (waiting for a request or
  being served); further ones get BUSY at once;
- the request is ≤ 1 KiB and must arrive within `request_timeout_s` (short: an honest client
  sends it with the stream) — and it takes no transfer slot while we wait for it, so streams that
  never say anything cannot starve honest clients;
- at most `max_concurrent` transfers run at once, a slot being taken only for a well-formed
  request (others get BUSY at once rather than queueing, so a client can try another peer);
- a shard above `max_bytes` (ours or the client's) is refused; each write must make progress
  within `read_timeout_s`, and the client must take the shard at `min_send_rate` on average once
  `send_grace_s` of credit is spent (node.rate_limit.MinSendRate: a reader that stops reading, or
  trickles just fast enough to pass a per-write timeout, loses its slot within seconds); the optional
  rate limiter is shared by all streams;
- the shard's open file counts against the process's serving share of the open-file limit
  (node/fdlimits.py): when it is spent the request gets BUSY.
Refusals and cut streams are counted in P2PStats and logged at most once per peer per minute.

py-libp2p swallows exceptions raised by stream handlers, so this handler catches and logs its own.
"""
from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamError

from node.fdlimits import FdBudget, serving_budget
from node.peer_log import PeerEventLog
from node.rate_limit import DEFAULT_MIN_SEND_RATE, DEFAULT_SEND_GRACE_S, MinSendRate, TrioRateLimiter
from .shard_store import ShardStore
from .shard_wire import (
    BadRequest,
    FRAME_PAYLOAD_BYTES,
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

CHUNK_BYTES = FRAME_PAYLOAD_BYTES  # one yamux frame in one Noise message (shard_wire.py)


class NoRequest(Exception):
    """The client opened a stream but sent no complete request within `request_timeout_s`."""


class ShardServer:
    def __init__(self, store: ShardStore | None, *, stats: P2PStats, max_concurrent: int, max_bytes: int,
                 read_timeout_s: float, upload_limit: int = 0, request_timeout_s: float = 2.0,
                 max_streams_per_peer: int = 4, log_interval_s: float = 60.0, upload_bucket: Any = None,
                 min_send_rate: float = DEFAULT_MIN_SEND_RATE, send_grace_s: float = DEFAULT_SEND_GRACE_S,
                 fd_budget: FdBudget | None = None):
        self.store = store
        self.stats = stats
        self.max_concurrent = max_concurrent
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = min(request_timeout_s, read_timeout_s)
        self.max_streams_per_peer = max_streams_per_peer
        MinSendRate(min_send_rate, send_grace_s)  # validate now
        self.min_send_rate, self.send_grace_s = min_send_rate, send_grace_s
        self.fds = fd_budget or serving_budget()
        self.refusal_log = PeerEventLog(log, "shard streams refused or cut", interval_s=log_interval_s)
        self.limiter = None
        self.chunk_bytes = CHUNK_BYTES
        if upload_limit > 0:
            # Small chunks under a limit (≈50 ms of traffic each): the sender sleeps briefly and
            # often, so a reader that went away is noticed at the next write, not many seconds later.
            self.chunk_bytes = int(min(CHUNK_BYTES, max(1024, upload_limit // 20)))
            self.limiter = TrioRateLimiter(upload_limit, burst=max(self.chunk_bytes, upload_limit * 0.05),
                                           shared=upload_bucket)
        self.active = 0  # transfers running (a well-formed request holds a slot)
        self.streams_by_peer: dict[str, int] = {}  # open shard streams per peer, any stage

    async def handle(self, stream: Any) -> None:
        peer = stream_peer(stream)
        open_now = self.streams_by_peer.get(peer, 0)
        if open_now >= self.max_streams_per_peer:
            await self._refuse_quietly(stream, peer, "busy_peer",
                                       f"{open_now} shard streams from your peer id are open already")
            return
        self.streams_by_peer[peer] = open_now + 1
        try:
            await self._serve(stream, peer)
        except NoRequest as e:
            self._aborted(peer, "request_timeout", e)
            await _reset(stream)
        except trio.TooSlowError as e:  # the client stopped reading
            self._aborted(peer, "stalled", e)
            await _reset(stream)
        except (StreamClosedEarly, StreamError) as e:  # the client left
            self._aborted(peer, "peer_gone", e)
            await _reset(stream)
        except Exception as e:  # never let libp2p swallow it silently
            log.warning("shard stream from %s failed: %r", peer, e)
            await _reset(stream)
        finally:
            left = self.streams_by_peer[peer] - 1
            if left:
                self.streams_by_peer[peer] = left
            else:
                del self.streams_by_peer[peer]

    async def _serve(self, stream: Any, peer: str) -> None:
        try:
            with trio.move_on_after(self.request_timeout_s) as waited:
                n = parse_request_length(await read_exactly(stream, REQUEST_PREFIX.size))
                req = decode_request(await read_exactly(stream, n))
            if waited.cancelled_caught:
                raise NoRequest(f"no request within {self.request_timeout_s:g} s")
        except BadRequest as e:
            self.stats.count_refused("bad_request")
            await self._refuse(stream, Status.BAD_REQUEST, str(e))
            return
        if self.active >= self.max_concurrent:
            self.stats.count_refused("busy")
            await self._refuse(stream, Status.BUSY, f"serving {self.active} shards already; try another peer")
            return
        self.active += 1
        try:
            await self._send_shard(stream, peer, req.step, req.index, req.manifest_hash,
                                   min(req.max_bytes, self.max_bytes))
        finally:
            self.active -= 1

    def _aborted(self, peer: str, reason: str, e: BaseException) -> None:
        self.stats.count_aborted(reason)
        self.refusal_log.note(peer, reason, repr(e)[:200])

    async def _refuse_quietly(self, stream: Any, peer: str, counted_as: str, reason: str) -> None:
        """BUSY for a stream over a peer's limit: counted, logged at most once a minute per peer,
        and bounded by the short request deadline (a peer that does not read gets a reset)."""
        self.stats.count_refused(counted_as)
        self.refusal_log.note(peer, counted_as, reason)
        try:
            with trio.fail_after(self.request_timeout_s):
                await stream.write(encode_error(Status.BUSY, reason))
                await stream.close()
        except Exception:  # it left or does not read: nothing more to tell it
            await _reset(stream)

    async def _send_shard(self, stream: Any, peer: str, step: int, index: int, manifest_hash: str | None,
                          limit: int) -> None:
        if not self.fds.try_take(1):
            self.stats.count_refused("busy")
            await self._refuse(stream, Status.BUSY, "this node is serving all the files it can; try another peer")
            return
        try:
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
                rate = MinSendRate(self.min_send_rate, self.send_grace_s)
                # The header rides in the first chunk's write, so every chunk leaves room for it: one frame fewer
                # per shard, and a small shard crosses in one (docs/P2P.md, "Shard throughput over libp2p").
                header = encode_header(Status.OK, body.size)
                sent = 0
                for chunk in body.chunks(self.chunk_bytes - len(header)):
                    if self.limiter is not None:
                        await self.limiter.acquire(len(chunk))  # our own cap: not the client's time
                    await self._write(stream, header + chunk if header else chunk, rate)
                    header = b""
                    sent += len(chunk)
                    self.stats.add_served(peer, len(chunk), shard_done=sent == body.size)
                if header:  # an empty shard: no chunk carried it
                    await self._write(stream, header, rate)
            finally:
                body.close()
        finally:
            self.fds.give(1)
        await stream.close()

    async def _write(self, stream: Any, data: bytes, rate: MinSendRate | None = None) -> None:
        """One write, bounded by `read_timeout_s` and by what is left of the client's send-rate credit."""
        timeout = self.read_timeout_s if rate is None else min(self.read_timeout_s, rate.allowance(len(data)))
        start = trio.current_time()
        with trio.fail_after(timeout):
            await stream.write(data)
        if rate is not None:
            rate.spent(len(data), trio.current_time() - start)

    async def _refuse(self, stream: Any, status: Status, reason: str) -> None:
        await self._write(stream, encode_error(status, reason[:MAX_REQUEST_BYTES]))
        await stream.close()


async def _reset(stream: Any) -> None:
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception:  # the connection is already gone; nothing left to tell the peer
            pass
