"""Small asyncio helpers shared by the roles: waits for the long-running loops (every loop watches a
stop event), and the bounded whole-body read of HTTP request and response bodies."""
from __future__ import annotations

import asyncio


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep up to `seconds`, waking at once when `stop` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Return when any of `events` is set, or after `timeout` seconds."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def read_bounded(stream, limit: int) -> bytes | None:
    """The whole of `stream` (an aiohttp/asyncio StreamReader) up to EOF, or None once it holds
    more than `limit` bytes; never consumes more than `limit + 1`. `stream.read(n)` alone returns
    only what has arrived so far, which is not the whole body."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await stream.read(limit + 1 - len(buf))
        if not chunk:
            return bytes(buf)
        buf += chunk
    return None
