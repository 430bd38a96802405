"""Fetch one shard over `/prime-node/shard/1.0.0` (trio side).

Bounded: the peer's announced length must fit `max_bytes` before anything is read; every read must
make progress within `read_timeout_s`; the whole transfer must finish before a deadline (given, or
derived from the length at a floor rate, so a peer trickling a byte every few seconds cannot hold
us for ever). Every failure becomes one of the ShardFetchError subclasses, with the peer named.
The bytes are opaque here: the caller checks them against the signed manifest.
"""
from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamError

from .errors import (
    PeerUnavailable,
    ShardBusy,
    ShardFetchError,
    ShardFetchTimeout,
    ShardNotFound,
    ShardPeerGone,
    ShardProtocolError,
    ShardTooLarge,
)
from .shard_wire import (
    MAX_REASON_BYTES,
    PROTOCOL_ID,
    RESPONSE_HEADER,
    BadRequest,
    ShardRequest,
    Status,
    decode_header,
    encode_request,
)
from .stats import P2PStats
from .stream_io import StreamClosedEarly, read_exactly, read_some

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
FLOOR_RATE = 32 * 1024  # bytes/s below which a transfer counts as stalled overall

_REFUSALS: dict[Status, type[ShardFetchError]] = {
    Status.NOT_FOUND: ShardNotFound,
    Status.BUSY: ShardBusy,
    Status.TOO_LARGE: ShardTooLarge,
    Status.BAD_REQUEST: ShardProtocolError,
    Status.ERROR: ShardProtocolError,
}


async def fetch_shard(host: Any, peer_id: Any, req: ShardRequest, *, stats: P2PStats, read_timeout_s: float,
                      open_timeout_s: float, timeout_s: float | None = None) -> bytes:
    peer = peer_id.to_base58()
    where = dict(peer=peer, step=req.step, index=req.index)
    what = f"shard {req.index} of step {req.step} from peer {peer}"
    try:
        with trio.fail_after(open_timeout_s):
            stream = await host.new_stream(peer_id, [PROTOCOL_ID])
    except trio.TooSlowError:
        raise ShardFetchTimeout(f"{what}: no stream within {open_timeout_s:.0f} s", **where) from None
    except Exception as e:  # dial failures come in many libp2p types; all mean "cannot reach"
        raise PeerUnavailable(f"{what}: cannot open a stream ({type(e).__name__}: {e})"[:300]) from None

    done = False
    try:
        data = await _exchange(stream, req, what, where, stats, peer, read_timeout_s, timeout_s)
        done = True
        return data
    except StreamClosedEarly as e:
        raise ShardPeerGone(f"{what}: connection lost ({e})", **where) from None
    except StreamError as e:
        raise ShardPeerGone(f"{what}: stream failed ({type(e).__name__})", **where) from None
    except trio.TooSlowError:
        raise ShardFetchTimeout(f"{what}: timed out", **where) from None
    except BadRequest as e:
        raise ShardProtocolError(f"{what}: {e}", **where) from None
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True  # also runs when we are being cancelled
            try:
                await (stream.close() if done else stream.reset())
            except Exception:  # the peer or connection is already gone
                pass


async def _exchange(stream: Any, req: ShardRequest, what: str, where: dict, stats: P2PStats, peer: str,
                    read_timeout_s: float, timeout_s: float | None) -> bytes:
    with trio.fail_after(read_timeout_s):
        await stream.write(encode_request(req))
        status, length = decode_header(await read_exactly(stream, RESPONSE_HEADER.size))
    if status != Status.OK:
        if length > MAX_REASON_BYTES:
            raise ShardProtocolError(f"{what}: refusal reason of {length} bytes", **where)
        with trio.fail_after(read_timeout_s):
            reason = (await read_exactly(stream, length)).decode("utf-8", "replace")
        reason = "".join(c if c.isprintable() else "?" for c in reason)[:200]
        raise _REFUSALS[status](f"{what}: {status.name.lower().replace('_', ' ')} ({reason})", **where)
    if length > req.max_bytes:
        raise ShardTooLarge(f"{what}: peer offers {length} bytes, limit {req.max_bytes}", **where)
    deadline = timeout_s if timeout_s is not None else read_timeout_s + length / FLOOR_RATE
    buf = bytearray()
    with trio.fail_after(deadline):
        while len(buf) < length:
            with trio.fail_after(read_timeout_s):  # idle timeout: each read must make progress
                chunk = await read_some(stream, min(CHUNK_BYTES, length - len(buf)))
            buf += chunk
            stats.add_fetched(peer, len(chunk), shard_done=len(buf) == length)
    return bytes(buf)
