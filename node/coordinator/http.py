"""HTTP plumbing shared by the coordinator and relays: JSON errors, signed-request guard, rate limits,
and a shard response that honours Range and a shared upload cap."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from node.aio import read_bounded
from protocol.errors import SignatureError
from protocol.signing import RequestVerifier, strict_json_loads

log = logging.getLogger("prime_node.http")


MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
SWARM_HEADER = "X-Prime-Swarm"  # "1": the requester can also get shards from libp2p peers


class ApiError(Exception):
    """An error meant for the client: status + short code + one human sentence (DESIGN §5)."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def json_error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


_HTTP_CODES = {400: "malformed", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
               416: "range_not_satisfiable"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return json_error(e.status, e.code, e.detail)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(e.status, _HTTP_CODES.get(e.status, "http_error"), e.reason or str(e))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return json_error(500, "internal", "the server failed to handle this request; it has been logged")


class TokenBucket:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class RateLimiter:
    """Per-key token buckets, bounded in number (least recently created dropped first)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, TokenBucket] = {}

    def allow(self, key: str) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.pop(next(iter(self._buckets)))
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst)
        return bucket.take()


class UploadThrottle:
    """One shared byte budget for every upload of a server (0 = unlimited). Async: waits, never drops."""

    def __init__(self, bytes_per_second: int):
        self.rate = bytes_per_second
        self._lock = asyncio.Lock()
        self._next = time.monotonic()

    async def consume(self, n: int) -> None:
        if self.rate <= 0:
            return
        async with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            delay = self._next - now
        if delay > 0:
            await asyncio.sleep(delay)


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """Strict JSON (no NaN) validated by a pydantic model; 400 with the first problems otherwise."""
    try:
        data = strict_json_loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "malformed", f"body is not valid JSON: {e}"[:300]) from None
    except RecursionError:  # json's C scanner stops at the interpreter's recursion limit (~1000 levels)
        raise ApiError(400, "malformed", "body is not valid JSON: nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        probs = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                          for err in e.errors()[:3])
        raise ApiError(400, "malformed", f"invalid request: {probs}") from None


async def read_signed(request: web.Request, verifier: RequestVerifier, limiter: RateLimiter) -> tuple[str, bytes]:
    """Read the (size-limited) body and check its signature. Returns (signer node id, body)."""
    limit = request.app[MAX_BODY_BYTES]
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "too_large", f"body of {request.content_length} bytes exceeds {limit}")
    body = await read_bounded(request.content, limit)
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


SHARD_NAME_DIGITS = 5
CHUNK = 256 * 1024


def shard_path(root: Path, step: int, index: int) -> Path:
    """The only way a shard path is formed: from two integers, never from a client string."""
    return root / str(int(step)) / "shards" / f"{int(index):0{SHARD_NAME_DIGITS}d}.zst"


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """`bytes=a-b` / `bytes=a-` / `bytes=-n` -> inclusive (start, end). One range only."""
    if not header.startswith("bytes=") or "," in header:
        raise ApiError(416, "range_not_satisfiable", "only a single bytes=a-b range is supported")
    a, _, b = header[6:].strip().partition("-")
    try:
        if a == "":
            n = int(b)
            start, end = max(0, size - n), size - 1
        else:
            start = int(a)
            end = int(b) if b else size - 1
    except ValueError:
        raise ApiError(416, "range_not_satisfiable", f"bad Range header {header!r}") from None
    end = min(end, size - 1)
    if start < 0 or start > end:
        raise ApiError(416, "range_not_satisfiable", f"range {header!r} outside 0-{size - 1}")
    return start, end


async def file_response(request: web.Request, path: Path, throttle: UploadThrottle,
                        on_bytes: Callable[[int], None] | None = None,
                        content_type: str = "application/octet-stream") -> web.StreamResponse:
    """Serve a file from disk in chunks with Range support, under the shared upload cap."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ApiError(404, "not_found", "no such shard") from None
    start, end = 0, size - 1
    status = 200
    rng = request.headers.get("Range")
    if rng and size > 0:
        start, end = _parse_range(rng, size)
        status = 206
    resp = web.StreamResponse(status=status)
    resp.content_type = content_type
    resp.headers["Accept-Ranges"] = "bytes"
    resp.content_length = max(0, end - start + 1)
    if status == 206:
        resp.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    await resp.prepare(request)
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            await throttle.consume(len(chunk))
            await resp.write(chunk)
            if on_bytes:
                on_bytes(len(chunk))
            left -= len(chunk)
    await resp.write_eof()
    return resp


_ASCII_DIGITS = re.compile(r"[0-9]{1,10}")


def int_param(request: web.Request, name: str, limit: int = 2**31) -> int:
    """A path number: 1-10 ASCII digits below `limit`. Not str.isdigit()/int(), which accept other
    scripts' digits ("²" passes isdigit() but int() refuses it; int("١") is 1), signs, spaces, "_"."""
    raw = request.match_info[name]
    if not _ASCII_DIGITS.fullmatch(raw) or int(raw) >= limit:
        raise ApiError(400, "malformed", f"{name} must be a non-negative integer below {limit} in ASCII digits")
    return int(raw)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
