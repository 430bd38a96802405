"""Small asyncio helpers shared by the roles: waits for the long-running loops (every loop watches a
stop event), the HTTP client session of a node, and the bounded whole-body read of HTTP request and
response bodies."""
from __future__ import annotations

import asyncio
import weakref
from collections import Counter

import aiohttp

# A client keeps an idle connection for less time than our servers do (their keep-alive timer is
# server.header_timeout_s, 10 s by default, and aiohttp's client default is 15 s): a request sent on a
# connection the server is closing at that moment fails (ServerDisconnectedError / ClientOSError), which
# bench/load.py saw for 13 of ~28,000 requests from nodes whose heartbeats come every 10 s.
CLIENT_KEEPALIVE_S = 4.0


# Requests sent and TCP connections opened by each client session (round trips are what a node far from the
# origin pays for: a request on a kept-alive connection costs one, a new connection one more). Read with
# `client_counts`; the fetcher logs them per sync.
_COUNTS: "weakref.WeakKeyDictionary[aiohttp.ClientSession, Counter[str]]" = weakref.WeakKeyDictionary()


def client_session(*, sock_connect: float = 10, sock_read: float = 60) -> aiohttp.ClientSession:
    """The HTTP client of a worker or relay: no overall timeout (shards are large), bounded connect and
    read waits, and idle connections kept alive (a node fetches every step over the same few connections),
    but dropped before the server drops them. No cap per host beyond the connector's 100: the fetcher
    bounds what it has in flight itself."""
    return counted_session(timeout=aiohttp.ClientTimeout(total=None, sock_connect=sock_connect, sock_read=sock_read),
                           connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S))


def counted_session(**kwargs) -> aiohttp.ClientSession:
    """An aiohttp.ClientSession(**kwargs) whose requests and new connections `client_counts` reads."""
    counts: Counter[str] = Counter()
    trace = aiohttp.TraceConfig()

    async def _request(session, ctx, params) -> None:
        counts["requests"] += 1

    async def _connect(session, ctx, params) -> None:
        counts["connects"] += 1

    trace.on_request_start.append(_request)
    trace.on_connection_create_end.append(_connect)
    session = aiohttp.ClientSession(trace_configs=[trace], **kwargs)
    _COUNTS[session] = counts
    return session


def client_counts(session) -> Counter[str]:
    """Requests sent and connections opened so far by a session made by `counted_session` (empty otherwise)."""
    return _COUNTS.get(session, Counter())


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
