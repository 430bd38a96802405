"""Small helpers for libp2p streams (trio side): exact reads, peer names."""
from __future__ import annotations

from typing import Any

from libp2p.network.stream.exceptions import StreamEOF, StreamError


class StreamClosedEarly(Exception):
    """The stream ended (EOF, reset, or the connection went away) before the expected bytes arrived."""


async def read_some(stream: Any, n: int) -> bytes:
    """Read 1..n bytes; StreamClosedEarly instead of EOF/reset (the callers always expect more)."""
    try:
        chunk = await stream.read(n)
    except StreamEOF:
        chunk = b""
    except StreamError as e:  # reset by the peer, or the connection closed under us
        raise StreamClosedEarly(f"stream broke ({type(e).__name__})") from None
    if not chunk:
        raise StreamClosedEarly("stream ended early")
    if len(chunk) > n:  # a muxer must never do this; refuse rather than over-read a bounded buffer
        raise StreamClosedEarly(f"read returned {len(chunk)} bytes, more than the {n} asked for")
    return chunk


async def read_exactly(stream: Any, n: int) -> bytes:
    """Read exactly `n` bytes. Callers bound `n` and wrap this in a timeout."""
    buf = bytearray()
    while len(buf) < n:
        buf += await read_some(stream, n - len(buf))
    return bytes(buf)


def stream_peer(stream: Any) -> str:
    """Base58 peer id of the other end of `stream` ('?' if the connection is already gone)."""
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except Exception:
        return "?"
