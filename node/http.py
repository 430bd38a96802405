"""HTTP plumbing shared by the coordinator, relays and node shard servers: JSON errors (also for HTTP the
parser refuses, via HardenedAppRunner, which logs such requests once per peer address per minute),
connection limits (per client address, a share of the open-file limit, a minimum send rate: see
`ConnectionLimits`), a signed-request guard that checks key, clock and rate limit from the headers before
reading a byte of body and caps the body bytes being read at once, and a shard response that honours
Range and a shared upload cap.

No client input gives a 500 (docs/PROTOCOL.md, "HTTP API"): numbers from clients are ASCII digits,
bodies are bounded in size, time and nesting, and every refusal is `{"error": code, "detail": sentence}`."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Mapping

import zstandard
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ValidationError

from node.aio import read_bounded
from node.fdlimits import FDS_PER_CONNECTION, FdBudget, serving_budget
from node.peer_log import PeerEventLog
from node.rate_limit import DEFAULT_MIN_SEND_RATE, DEFAULT_SEND_GRACE_S, AsyncRateLimiter, KeyedRateLimit, MinSendRate
from protocol.errors import SignatureError
from protocol.messages import ErrorBody
from protocol.signing import SIGNED_HEADERS, RequestVerifier, strict_json_loads

log = logging.getLogger("prime_node.http")


MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)  # a signed request's body must arrive within this
# body bytes being read at once, all requests (typed by the annotation: BodyBudget is defined below)
BODY_BUDGET: web.AppKey[BodyBudget] = web.AppKey("body_budget")
SWARM_HEADER = "X-Prime-Swarm"  # "1": the requester can also get shards from libp2p peers
SHARD_ADDR_HEADER = "X-Prime-Shard-Addr"  # a swarm node's HTTP shard server, /ip4/<ip>/tcp/<port>/http
HOLDER_HEADER = "X-Prime-Holder"  # on a 429 "seeded": "<node id> <its HTTP shard address>"
# on a manifest answered to a signed swarm request: "<shard index> <node id> <address>", a first copy's holder
SHARD_HOLDER_HEADER = "X-Prime-Shard-Holder"
HAVE_HEADER = "X-Prime-Have"  # a node's HTTP shard server: the shards of that step it holds (base64 bitfield)
RETRY_AFTER_MS_HEADER = "X-Prime-Retry-After-Ms"  # /v1/work's 204, /v1/heartbeat's 200: ask again after n ms

# A signed request's body may be sent zstd-compressed (docs/PROTOCOL.md, "Signed requests"): a submission's JSON is
# ~30 bytes a token (37.5 with logprobs in 17 digits), 1.7x less in zstd (bench/submit_bytes.py), which a home
# uplink feels. The signature covers the body as sent, so it is checked before a byte is decompressed, and a body
# that states (in its frame header) more than the body limit is refused undecoded. HardenedAppRunner turns
# aiohttp's own request decompression off: no other encoding is decoded, and none before the signature.
BODY_ENCODING = "zstd"
COMPRESS_MIN_BYTES = 64 * 1024  # smaller bodies (heartbeats, work requests) gain little and are sent as they are
MAX_BODY_WINDOW = 1 << 23  # zstd's window, i.e. its decoder's memory: a frame that asks for more is refused


def compress_body(body: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(body)


def inflated_size(body: bytes, limit: int) -> int:
    """The size a zstd body says it decompresses to (its frame header's content size), at most `limit`: 413 beyond
    it, 400 for a body that is not zstd or does not say."""
    try:
        size = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise ApiError(400, "malformed", f"the body is not a zstd frame: {e}"[:300]) from None
    if size < 0:
        raise ApiError(400, "malformed", "a zstd body must state its content size in the frame header")
    if size > limit:
        raise ApiError(413, "too_large", f"body decompresses to {size} bytes, over {limit}")
    return size


def decompress_body(body: bytes, limit: int) -> bytes:
    """A zstd body's one frame decompressed into exactly the content size its header states (inflated_size: at most
    `limit`; zstd refuses a frame whose content does not match it), with at most MAX_BODY_WINDOW of window; 400 for
    a stream that is broken, truncated or asks for a larger window. Bytes after the frame are ignored (signed, so
    the signer's own)."""
    inflated_size(body, limit)
    try:
        return zstandard.ZstdDecompressor(max_window_size=MAX_BODY_WINDOW).decompress(body)
    except zstandard.ZstdError as e:
        raise ApiError(400, "malformed", f"the zstd body could not be decompressed: {e}"[:300]) from None


def body_encoding(request: web.Request) -> str | None:
    """The request body's Content-Encoding: None (absent or identity) or BODY_ENCODING; 415 for any other."""
    values = request.headers.getall("Content-Encoding", ())
    if len(values) > 1:
        raise ApiError(400, "malformed", "header Content-Encoding appears more than once")
    enc = values[0].strip().lower() if values else ""
    if enc in ("", "identity"):
        return None
    if enc != BODY_ENCODING:
        raise ApiError(415, "unsupported_encoding", f"Content-Encoding {enc[:40]!r} is not accepted: send "
                                                    f"{BODY_ENCODING} or no encoding")
    return enc

# Numbers from clients are ASCII digits only: str.isdigit() and int() also take other scripts' digits
# ("²" passes isdigit() but int() refuses it; int("١") is 1), and int() takes signs, spaces and "_".
_ASCII_DIGITS = re.compile(r"[0-9]{1,10}")
_RANGE = re.compile(r"bytes=[ \t]*([0-9]{0,40})[ \t]*-[ \t]*([0-9]{0,40})[ \t]*")


class ApiError(Exception):
    """An error meant for the client: status + short code + one human sentence (docs/PROTOCOL.md,
    "HTTP API")."""

    def __init__(self, status: int, code: str, detail: str, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


def json_error(status: int, code: str, detail: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(ErrorBody.of(code, detail).model_dump(), status=status, headers=headers)


_HTTP_CODES = {400: "malformed", 404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large",
               416: "range_not_satisfiable", 431: "too_large", 500: "internal", 503: "unavailable",
               504: "timeout"}
_KEPT_HEADERS = ("Allow", "Content-Range", "Retry-After")


def _body_unread(request: web.BaseRequest) -> bool:
    return request.body_exists and not request.content.is_eof()


def _client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        resp = json_error(e.status, e.code, e.detail, e.headers)
        if e.status == 408 or _body_unread(request):
            # The rest of that body may never come (408), or it was refused before it was read: aiohttp
            # would otherwise keep the connection up to 10 s more to read and discard it.
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kept = {k: e.headers[k] for k in _KEPT_HEADERS if k in e.headers}
        return json_error(e.status, _HTTP_CODES.get(e.status, "http_error"), e.reason or str(e), kept)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if isinstance(e, ConnectionError) and _client_gone(request):
            # The client hung up (mid-body or mid-download): nobody reads the answer, nothing to log.
            log.debug("%s %s: the client went away", request.method, request.path)
            return json_error(400, "connection_lost", "the connection was closed before the request was served")
        log.exception("internal error on %s %s", request.method, request.path)
        return json_error(500, "internal", "the server failed to handle this request; it has been logged")


# -- below the application: connections and malformed HTTP -------------------------------------------
@dataclass(frozen=True)
class ConnectionLimits:
    """What one client may hold of a server, enforced per connection below the application.

    - `max_per_address`: connections open at once from one client address; the next one is answered 429
      with Retry-After and closed before any request is read (every client behind one NAT shares this).
    - the process's serving share of the open-file limit (node/fdlimits.py): when full, a new connection is
      answered 503 with Retry-After, so publishing, the ledger and the trainer always have descriptors.
    - `min_send_rate` bytes/s after `send_grace_s` (node.rate_limit.MinSendRate): a client that keeps the
      server waiting to take its response longer than that allows is cut (the connection is aborted: its
      socket and the file being sent are freed). An honest 20 Mbit/s uplink is ~150x the default floor;
      a client that never reads is cut about `send_grace_s` after its socket buffers filled.
    """

    max_per_address: int = 32
    min_send_rate: float = DEFAULT_MIN_SEND_RATE
    send_grace_s: float = DEFAULT_SEND_GRACE_S
    retry_after_s: int = 5

    def __post_init__(self):
        if self.max_per_address < 1 or self.min_send_rate <= 0 or self.send_grace_s <= 0 or self.retry_after_s < 1:
            raise ValueError("connection limits must be positive")


class _HardenedRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with three changes:
    - requests that never reach the application (a bad request line, bad or oversized headers, a lying
      Content-Length) are answered with the JSON error body (docs/PROTOCOL.md, HTTP API) instead of text, and logged once per peer
      address per minute instead of a traceback per request (a peer can send thousands a second);
    - a connection over its address's limit or the serving fd share is refused before its request is read;
    - while the transport is paused (the client is not taking what we send), a MinSendRate clock runs, and
      the connection is aborted when the client has used up its credit."""

    peer_log: PeerEventLog
    server: "_HardenedServer"

    def connection_made(self, transport) -> None:
        self._peer = _peer_of(transport)
        self._counted = self._fds = 0
        self._send = MinSendRate(self.server.limits.min_send_rate, self.server.limits.send_grace_s)
        self._stall: asyncio.TimerHandle | None = None
        self._paused_at = 0.0
        self._paused_size = 0
        super().connection_made(transport)  # -> _HardenedServer.connection_made, which may refuse it

    def refuse(self, status: int, code: str, detail: str) -> None:
        """Answer `status` with Retry-After before any request is read, and close at once: a refused
        connection must not keep its descriptor (a flood of them is what the limits are for). What the
        client already sent is read and dropped first, so the close is a FIN after the answer rather than a
        reset that could destroy it."""
        self._force_close = True  # aiohttp discards what arrives, and the request loop ends at once
        transport = self.transport
        if transport is None:
            return
        _discard_input(transport)
        body = ErrorBody.of(code, detail).model_dump_json().encode()
        reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "Error")
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Retry-After: {self.server.limits.retry_after_s}\r\nConnection: close\r\n\r\n").encode()
        transport.write(head + body)
        # The answer is in the socket's buffer: the kernel sends it, then a FIN. Closed on the next turn of
        # the loop, after aiohttp's request task has started (and, seeing _force_close, ended).
        self._loop.call_soon(transport.close)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.transport is None:
            return
        self._paused_at = self._loop.time()
        self._paused_size = self.transport.get_write_buffer_size()
        self._stall = self._loop.call_later(max(0.0, self._send.allowance()), self._cut_slow_reader)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
            taken = self._paused_size - (self.transport.get_write_buffer_size() if self.transport else 0)
            self._send.spent(max(0, taken), self._loop.time() - self._paused_at)

    def _cut_slow_reader(self) -> None:
        self._stall = None
        self.server.slow_readers_cut += 1
        self.peer_log.note(self._peer, "slow_reader",
                           f"cut: took its response slower than {self.server.limits.min_send_rate:g} B/s")
        abort_connection(self.transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)

    def log_exception(self, *args, **kw) -> None:
        exc = kw.get("exc_info")
        peer = args[1] if len(args) > 1 and isinstance(args[1], str) else _peer_of(self.transport)
        if isinstance(exc, HttpProcessingError):
            self.peer_log.note(peer, "malformed", lambda: _one_line(exc))
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs (above); raises if a response began
        if status >= 500:
            detail = "the server failed to handle this request; it has been logged"
        else:
            detail = f"malformed HTTP request: {_one_line(exc) if exc is not None else message or 'bad request'}"
        resp = json_error(status, _HTTP_CODES.get(status, "http_error"), detail)
        resp.force_close()
        return resp


def _discard_input(transport, limit: int = 64 * 1024) -> None:
    """Read and drop what has arrived on the transport's socket (at most `limit` bytes; never blocks)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    left = limit
    try:
        while left > 0:
            data = os.read(sock.fileno(), min(left, 16 * 1024))  # a non-blocking socket: raises when empty
            if not data:
                return
            left -= len(data)
    except (BlockingIOError, OSError):
        return


def abort_connection(transport) -> None:
    """Drop a connection now, with what it had left to send: a reset (SO_LINGER 0), not close(), which waits
    for a buffer this client never reads, and not a plain abort(), which leaves the kernel to keep trying."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already gone: abort() below is all there is to do
            pass
    transport.abort()


def _peer_of(transport) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unknown"


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, HttpProcessingError) and isinstance(exc.message, str) else str(exc)
    return " ".join(text.split())[:200]


class _HardenedServer(web.Server):
    """aiohttp's Server with the connection accounting of ConnectionLimits (state set by HardenedAppRunner)."""

    peer_log: PeerEventLog
    limits: ConnectionLimits
    fds: FdBudget
    by_address: dict[str, int]
    refused: dict[str, int]
    slow_readers_cut: int

    def __call__(self) -> web.RequestHandler:
        handler = _HardenedRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.peer_log = self.peer_log
        handler.server = self
        return handler

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        peer = handler._peer
        n = self.by_address.get(peer, 0)
        self.by_address[peer] = n + 1
        handler._counted = 1
        if n >= self.limits.max_per_address:
            self._refuse(handler, 429, "too_many_connections",
                         f"at most {self.limits.max_per_address} connections at once from one address")
        elif not self.fds.try_take(FDS_PER_CONNECTION):
            self._refuse(handler, 503, "busy", "this server is serving all the connections it can; retry later")
        else:
            handler._fds = FDS_PER_CONNECTION

    def _refuse(self, handler: _HardenedRequestHandler, status: int, code: str, detail: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        self.peer_log.note(handler._peer, code, detail)
        handler.refuse(status, code, detail)

    def connection_lost(self, handler, exc=None) -> None:
        super().connection_lost(handler, exc)
        if getattr(handler, "_counted", 0):
            handler._counted = 0
            left = self.by_address.get(handler._peer, 1) - 1
            if left > 0:
                self.by_address[handler._peer] = left
            else:
                self.by_address.pop(handler._peer, None)
        if getattr(handler, "_fds", 0):
            self.fds.give(handler._fds)
            handler._fds = 0


AIOHTTP_PATCHED_VERSIONS = "3.14"  # the aiohttp releases harden_aiohttp_server was written for (3.14.x)


def harden_aiohttp_server(server: web.Server | None, *, peer_log: PeerEventLog, limits: ConnectionLimits,
                          fds: FdBudget) -> _HardenedServer:
    """Turn the `web.Server` an AppRunner built into a _HardenedServer, in place: the same object and state,
    with the connection accounting and request handler class above. Targets aiohttp 3.14 (3.14.5 in use;
    pyproject.toml accepts >=3.10,<4); called by HardenedAppRunner.setup, i.e. by every HTTP server this
    project starts (coordinator, relay, node shard server), before any site listens. Idempotent: a server
    already hardened is returned as it is.

    The upstream defect it works around: aiohttp has no hook below the application for a connection. Its
    `web.Server.__call__` builds a stock `RequestHandler` for every connection (the class is hard-coded; no
    argument chooses another), so there is no per-address connection
    limit, no share of the open-file limit, no floor on the send rate, and a request the HTTP parser refuses
    gets a text/plain answer and a logged traceback per request. AppRunner builds its Server inside
    `setup()` (the private `_make_server`), so the public way in is its result, `runner.server`, whose class
    is swapped here. tests/integration/test_attack_connections.py fails if the swap stops taking effect."""
    if server is None:
        raise RuntimeError("harden_aiohttp_server: the runner has no server (call it after AppRunner.setup)")
    if isinstance(server, _HardenedServer):
        return server
    if type(server) is not web.Server:  # a subclass may override what the swap replaces: refuse it, loudly
        raise TypeError(f"harden_aiohttp_server expects aiohttp's own web.Server, not {type(server).__name__}")
    server.__class__ = _HardenedServer  # same state; connection accounting and handler class added
    hardened: _HardenedServer = server  # type: ignore[assignment]
    hardened.peer_log, hardened.limits, hardened.fds = peer_log, limits, fds
    hardened.by_address, hardened.refused, hardened.slow_readers_cut = {}, {}, 0
    return hardened


class HardenedAppRunner(web.AppRunner):
    """`web.AppRunner` for a server that strangers reach: malformed HTTP gets JSON errors (logged at most once
    per peer address per `log_interval_s`), and every connection is held to `limits` (ConnectionLimits;
    `fd_budget` defaults to the process's serving share, node/fdlimits.py, whose first use raises the
    open-file limit to the hard limit). Use it like AppRunner; `connection_stats()` says what it refused."""

    def __init__(self, app: web.Application, *, log_interval_s: float = 60.0,
                 limits: ConnectionLimits | None = None, fd_budget: FdBudget | None = None, **kwargs):
        # Request bodies reach the handlers as sent: a signed body is decompressed (zstd only) after its signature
        # is checked (read_signed), and aiohttp would otherwise inflate gzip, deflate or br bodies from anyone.
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)
        self.peer_log = PeerEventLog(logging.getLogger("aiohttp.server"), "malformed or refused connections",
                                     level=logging.WARNING, interval_s=log_interval_s)
        self.limits = limits or ConnectionLimits()
        self.fd_budget = fd_budget
        self._hardened: _HardenedServer | None = None

    async def setup(self) -> None:
        await super().setup()
        self._hardened = harden_aiohttp_server(self.server, peer_log=self.peer_log, limits=self.limits,
                                               fds=self.fd_budget or serving_budget())

    def bound_port(self) -> int:
        """The TCP port this runner's (first) site listens on, e.g. after asking for port 0. Read from aiohttp's
        public `addresses`, not from the private `site._server`."""
        addresses = self.addresses
        if not addresses:
            raise RuntimeError("this runner has no listening site yet (start a site first)")
        return int(addresses[0][1])

    def connection_stats(self) -> dict:
        """Open connections, the most from one address, refusals by code, slow readers cut."""
        s = self._hardened
        if s is None:
            return {"open": 0, "max_per_address": 0, "refused": {}, "slow_readers_cut": 0}
        return {"open": sum(s.by_address.values()), "max_per_address": max(s.by_address.values(), default=0),
                "refused": dict(s.refused), "slow_readers_cut": s.slow_readers_cut}


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """Strict JSON (no NaN) validated by a pydantic model; 400 with the first problems otherwise."""
    try:
        data = strict_json_loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as e:  # deep nesting included (strict_json_loads)
        raise ApiError(400, "malformed", f"body is not valid JSON: {e}"[:300]) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        probs = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                          for err in e.errors()[:3])
        raise ApiError(400, "malformed", f"invalid request: {probs}") from None


class BodyBudget:
    """The request body bytes a server reads at once: at most `limit` over all connections and `per_key` for
    one signer. A request whose body may exceed SMALL_BODY_BYTES reserves its Content-Length (or the body
    limit when it sends none) before its body is read and gives it back after; over either limit it is
    refused with 503 and Retry-After. Smaller bodies (heartbeats, work requests) take nothing: what they can
    hold is aiohttp's read buffer, which every connection has anyway (bounded by the connection limits), so a
    flood of large stalled submissions never blocks them. One event loop: no lock."""

    SMALL_BODY_BYTES = 64 * 1024

    def __init__(self, limit: int, per_key: int | None = None, retry_after_s: int = 1):
        if limit < 1 or (per_key is not None and per_key < 1):
            raise ValueError("a body budget must be positive")
        self.limit, self.retry_after_s = int(limit), int(retry_after_s)
        self.per_key = int(per_key) if per_key is not None else self.limit
        self.in_flight = 0
        self.by_key: dict[str, int] = {}
        self.peak = 0  # the most ever reserved at once (tests, metrics)
        self.refused = 0

    def take(self, key: str, n: int) -> int:
        """Reserve `n` bytes for `key`; returns what was reserved (0 for a small body), for `give`."""
        if n <= self.SMALL_BODY_BYTES:
            return 0
        mine = self.by_key.get(key, 0)
        if self.in_flight + n > self.limit or mine + n > self.per_key:
            self.refused += 1
            raise ApiError(503, "busy", f"reading {self.in_flight} bytes of request bodies already "
                                        f"({mine} for this key); retry later", {"Retry-After": str(self.retry_after_s)})
        self.in_flight += n
        self.by_key[key] = mine + n
        self.peak = max(self.peak, self.in_flight)
        return n

    def give(self, key: str, n: int) -> None:
        if n <= 0:
            return
        self.in_flight = max(0, self.in_flight - n)
        left = self.by_key.get(key, 0) - n
        if left > 0:
            self.by_key[key] = left
        else:
            self.by_key.pop(key, None)


def _rate_limited() -> ApiError:
    return ApiError(429, "rate_limited", "too many requests from this node; slow down", {"Retry-After": "1"})


KeyCheck = Callable[[str], object]  # raises ApiError to refuse a signer (unknown, banned) before its body


async def read_signed(request: web.Request, verifier: RequestVerifier, limiter: KeyedRateLimit,
                      check_key: KeyCheck | None = None) -> tuple[str, bytes]:
    """Check what the headers say, then read the (size-limited) body and check its signature. Returns
    (signer node id, body).

    Before a byte of body is read: the signature headers are well-formed, the timestamp is inside the
    clock window and the run is ours (RequestVerifier.check_headers), `check_key` accepts the key (the
    coordinator: a joined, unbanned node; /v1/join passes one that refuses banned keys only), the key's
    rate limit has a token, the body's Content-Encoding is none or zstd (415), and the app's BodyBudget has room
    for the body (503 + Retry-After when not). The token is only taken once the signature is good, so nobody can
    spend another node's rate limit with requests they cannot sign. A zstd body is signed as sent and returned
    decompressed (decompress_body: at most the body limit), its stated size reserved in the budget meanwhile."""
    limit = request.app[MAX_BODY_BYTES]
    for name in SIGNED_HEADERS:
        # Ambiguous: this server would check the first, a proxy in front of it might keep the last.
        if len(request.headers.getall(name, ())) > 1:
            raise ApiError(400, "malformed", f"header {name} appears more than once")
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "too_large", f"body of {request.content_length} bytes exceeds {limit}")
    encoded = body_encoding(request) is not None
    try:
        key = verifier.check_headers(request.headers)
    except SignatureError as e:
        raise ApiError(401, e.code, e.detail) from None
    if check_key is not None:
        check_key(key)
    if not limiter.would_allow(key):
        raise _rate_limited()
    budget: BodyBudget | None = request.app.get(BODY_BUDGET)
    declared = min(limit, request.content_length if request.content_length is not None else limit)
    reserved = budget.take(key, declared) if budget is not None else 0
    timeout = request.app.get(BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):  # a Content-Length that promises more than is sent
            body = await read_bounded(request.content, limit)
    except TimeoutError:
        raise ApiError(408, "timeout", f"the request body did not arrive within {timeout:g} s") from None
    except (web.RequestPayloadError, HttpProcessingError) as e:  # e.g. a broken chunked encoding
        raise ApiError(400, "malformed", f"the request body could not be read: {_one_line(e)}") from None
    finally:
        if budget is not None:
            budget.give(key, reserved)
    if body is None:
        raise ApiError(413, "too_large", f"body exceeds {limit} bytes")
    try:
        verified = verifier.verify(request.method, request.path_qs, request.headers, body)
    except SignatureError as e:
        status = 429 if e.code == "nonce_store_full" else 401
        raise ApiError(status, e.code, e.detail) from None
    if not limiter.allow(verified.signer):
        raise _rate_limited()
    if encoded:  # signed as sent, so decompressed only now, off the loop (~3 ms for a 1.3 MB submission), and
        # counted in the body budget while it inflates, as if it had been read so: 1 KB may state 8 MiB
        inflating = budget.take(verified.signer, inflated_size(body, limit)) if budget is not None else 0
        try:
            body = await asyncio.to_thread(decompress_body, body, limit)
        finally:
            if budget is not None:
                budget.give(verified.signer, inflating)
    return verified.signer, body


CHUNK = 256 * 1024


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """`bytes=a-b` / `bytes=a-` / `bytes=-n` (ASCII digits) -> inclusive (start, end) within a file of
    `size` > 0 bytes. One range only. Anything else raises ApiError(416) with `Content-Range: bytes */size`."""
    m = _RANGE.fullmatch(header)
    if m is None:
        raise ApiError(416, "range_not_satisfiable", "only a single bytes=a-b range is supported",
                       {"Content-Range": f"bytes */{size}"})
    a, b = m[1], m[2]
    if a == "":
        if b == "" or int(b) == 0:
            raise ApiError(416, "range_not_satisfiable", f"range {header[:80]!r} selects nothing",
                           {"Content-Range": f"bytes */{size}"})
        start, end = max(0, size - int(b)), size - 1
    else:
        start = int(a)
        end = min(int(b), size - 1) if b else size - 1
    if start > end:
        raise ApiError(416, "range_not_satisfiable", f"range {header[:80]!r} is outside 0-{size - 1}",
                       {"Content-Range": f"bytes */{size}"})
    return start, end


async def file_response(request: web.Request, path: Path, throttle: AsyncRateLimiter,
                        on_bytes: Callable[[int], None] | None = None,
                        content_type: str = "application/octet-stream") -> web.StreamResponse:
    """Serve a file from disk in chunks with Range support, under the shared upload cap."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ApiError(404, "not_found", "no such shard") from None
    start, end = 0, size - 1
    status = 200
    ranges = request.headers.getall("Range", ())
    if len(ranges) > 1:
        raise ApiError(416, "range_not_satisfiable", "only a single Range header is supported",
                       {"Content-Range": f"bytes */{size}"})
    if ranges and size > 0:
        start, end = _parse_range(ranges[0], size)
        status = 206
    resp = web.StreamResponse(status=status)
    resp.content_type = content_type
    resp.headers["Accept-Ranges"] = "bytes"
    resp.content_length = max(0, end - start + 1)
    if status == 206:
        resp.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    await resp.prepare(request)
    if request.method == "HEAD":  # headers only: a body here would be read as the next response
        await resp.write_eof()
        return resp
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            await throttle.acquire(len(chunk))
            await resp.write(chunk)
            if on_bytes:
                on_bytes(len(chunk))
            left -= len(chunk)
    await resp.write_eof()
    return resp


def int_param(request: web.Request, name: str, limit: int = 2**31) -> int:
    """A path number: 1-10 ASCII digits below `limit`. Not str.isdigit()/int(), which accept other
    scripts' digits ("²" passes isdigit() but int() refuses it; int("١") is 1), signs, spaces, "_"."""
    raw = request.match_info[name]
    if not _ASCII_DIGITS.fullmatch(raw) or int(raw) >= limit:
        raise ApiError(400, "malformed", f"{name} must be a non-negative integer below {limit} in ASCII digits")
    return int(raw)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
