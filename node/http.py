"""HTTP plumbing shared by the coordinator and relays: JSON errors (also for HTTP the parser refuses, via
HardenedAppRunner, which logs such requests once per peer address per minute), signed-request guard,
rate limits, and a shard response that honours Range and a shared upload cap.

No client input gives a 500 (DESIGN §5): numbers from clients are ASCII digits, bodies are bounded in
size, time and nesting, and every refusal is `{"error": code, "detail": sentence}`."""
from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ValidationError

from node.aio import read_bounded
from node.peer_log import PeerEventLog
from node.rate_limit import AsyncRateLimiter, KeyedRateLimit
from protocol.errors import SignatureError
from protocol.messages import ErrorBody
from protocol.signing import SIGNED_HEADERS, RequestVerifier, strict_json_loads

log = logging.getLogger("prime_node.http")


MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)  # a signed request's body must arrive within this
SWARM_HEADER = "X-Prime-Swarm"  # "1": the requester can also get shards from libp2p peers
SHARD_ADDR_HEADER = "X-Prime-Shard-Addr"  # a swarm node's HTTP shard server, /ip4/<ip>/tcp/<port>/http
HOLDER_HEADER = "X-Prime-Holder"  # on a 429 "seeded": "<node id> <its HTTP shard address>"
HAVE_HEADER = "X-Prime-Have"  # a node's HTTP shard server: the shards of that step it holds (base64 bitfield)

# Numbers from clients are ASCII digits only: str.isdigit() and int() also take other scripts' digits
# ("²" passes isdigit() but int() refuses it; int("١") is 1), and int() takes signs, spaces and "_".
_ASCII_DIGITS = re.compile(r"[0-9]{1,10}")
_RANGE = re.compile(r"bytes=[ \t]*([0-9]{0,40})[ \t]*-[ \t]*([0-9]{0,40})[ \t]*")


class ApiError(Exception):
    """An error meant for the client: status + short code + one human sentence (DESIGN §5)."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


def json_error(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(ErrorBody.of(code, detail).model_dump(), status=status, headers=headers)


_HTTP_CODES = {400: "malformed", 404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large",
               416: "range_not_satisfiable", 431: "too_large", 500: "internal", 503: "unavailable",
               504: "timeout"}
_KEPT_HEADERS = ("Allow", "Content-Range", "Retry-After")


def _client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        resp = json_error(e.status, e.code, e.detail, e.headers)
        if e.status == 408:
            resp.force_close()  # the rest of that body may never come: do not wait for it
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


# -- below the application: malformed HTTP -----------------------------------------------------------
class _JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with two changes for requests that never reach the application
    (a bad request line, bad or oversized headers, a lying Content-Length): the answer is DESIGN §5's
    JSON error instead of text, and the log gets one line per peer address per minute instead of a
    traceback per request (a peer can send thousands of those a second)."""

    peer_log: PeerEventLog

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


def _peer_of(transport) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unknown"


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, HttpProcessingError) and isinstance(exc.message, str) else str(exc)
    return " ".join(text.split())[:200]


class _JsonErrorServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        handler = _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.peer_log = self.peer_log
        return handler


class HardenedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer malformed HTTP with JSON errors and log it at most once
    per peer address per `log_interval_s` (see `_JsonErrorRequestHandler`). Use it like AppRunner."""

    def __init__(self, app: web.Application, *, log_interval_s: float = 60.0, **kwargs):
        super().__init__(app, **kwargs)
        self.peer_log = PeerEventLog(logging.getLogger("aiohttp.server"), "malformed HTTP requests",
                                     level=logging.WARNING, interval_s=log_interval_s)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state; only the per-connection handler class differs
        server.peer_log = self.peer_log
        return server


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


async def read_signed(request: web.Request, verifier: RequestVerifier, limiter: KeyedRateLimit) -> tuple[str, bytes]:
    """Read the (size-limited) body and check its signature. Returns (signer node id, body)."""
    limit = request.app[MAX_BODY_BYTES]
    for name in SIGNED_HEADERS:
        # Ambiguous: this server would check the first, a proxy in front of it might keep the last.
        if len(request.headers.getall(name, ())) > 1:
            raise ApiError(400, "malformed", f"header {name} appears more than once")
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "too_large", f"body of {request.content_length} bytes exceeds {limit}")
    timeout = request.app.get(BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):  # a Content-Length that promises more than is sent
            body = await read_bounded(request.content, limit)
    except TimeoutError:
        raise ApiError(408, "timeout", f"the request body did not arrive within {timeout:g} s") from None
    except (web.RequestPayloadError, HttpProcessingError) as e:  # e.g. a broken chunked encoding
        raise ApiError(400, "malformed", f"the request body could not be read: {_one_line(e)}") from None
    if body is None:
        raise ApiError(413, "too_large", f"body exceeds {limit} bytes")
    try:
        verified = verifier.verify(request.method, request.path_qs, request.headers, body)
    except SignatureError as e:
        status = 429 if e.code == "nonce_store_full" else 401
        raise ApiError(status, e.code, e.detail) from None
    if not limiter.allow(verified.signer):
        raise ApiError(429, "rate_limited", "too many requests from this node; slow down")
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
