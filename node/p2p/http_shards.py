"""Shard bytes between nodes over plain HTTP: the swarm's cheap data plane.

On by default (`p2p.http`; docs/P2P.md "The HTTP data plane"). libp2p keeps discovery, gossip and the nodes
that can only dial out; a node that listens also serves the shards it holds at
`GET /v1/p2p/shards/{step}/{index}?manifest=<hash>` and puts `/ip4/<host>/tcp/<port>/http` among the addresses of
its `have` announcements. A fetcher that knows such an address for a holder asks it over HTTP first: on this
machine a fetch over py-libp2p costs ~14 ms of CPU before its first byte and ~35-40 CPU-s per GB, over HTTP ~0.7 ms and ~2 (bench/transport_cost.py).

Every answer about a shard (200, 404, 429) also says which shards of that step the server holds
(`X-Prime-Have`, a bitfield as in BitTorrent): a node learns a holder's whole set with each fetch instead
of waiting for its batched `have` gossip, which at 16 nodes on two cores arrived seconds late
(docs/P2P.md). Like a `have`, it is a claim: a shard is verified whoever serves it.

Nothing about trust changes: every shard is checked against the signed manifest by the fetcher,
whichever plane carried it. Both sides are bounded like the libp2p shard protocol: the server takes two
validated integers and a hex hash (never a path), serves at most `max_concurrent` transfers, at most
`max_per_client` of them to one client address (more get 429 "busy"), under the node's upload cap, gives
each transfer a deadline, and runs on HardenedAppRunner (node/http.py: connections per address, the fd
share, and a minimum send rate that resets a reader who stops reading within seconds); the client dials only literal IP
addresses from a strict pattern, follows no redirect, and refuses a body above the signed size, a stall
longer than `read_timeout_s` or a transfer slower than a floor rate. Every failure comes out as the
libp2p plane's ShardFetchError types.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import re
import time
from typing import Any, Callable, Iterable

import aiohttp
from aiohttp import web

from node.fdlimits import listen_backlog
from node.http import HAVE_HEADER, ApiError, ConnectionLimits, HardenedAppRunner, abort_connection, error_middleware, int_param
from node.rate_limit import AsyncRateLimiter, SharedBucket

from .announce import MAX_INDICES, MAX_SHARD_INDEX, MAX_STEP
from .addrs import ip_allowed, tcp_endpoint
from .errors import ShardBusy, ShardFetchError, ShardFetchTimeout, ShardNotFound, ShardPeerGone, ShardProtocolError, ShardTooLarge
from .shard_store import ShardStore
from .stats import P2PStats

log = logging.getLogger(__name__)

PATH = "/v1/p2p/shards/{step}/{index}"
CHUNK_BYTES = 256 * 1024
FLOOR_RATE = 32 * 1024  # bytes/s below which a transfer counts as stalled overall (as over libp2p)
_HASH = re.compile(r"[0-9a-f]{64}")


HAVE_BITS = MAX_INDICES  # X-Prime-Have covers shards 0..4095 (684 base64 characters at most)
HAVE_TTL_S = 0.1  # how stale the holdings a server tells may be
# A request for a shard of a step this node is downloading right now, not here yet, waits this long for it before
# "not here" (polled every ARRIVAL_POLL_S). The origin names a first copy's holder once it has sent the last byte,
# while the holder has yet to receive and verify it: in the WAN lab 9-10 of a run's 270 delta shards were asked of
# their named holder too early, went back to the origin and came ~0.3 s later (docs/BENCHMARKS.md, "A NATed
# node's peer shards over HTTP"). At most `max_concurrent` requests wait at once; more are answered at once.
ARRIVAL_WAIT_S = 1.0
ARRIVAL_POLL_S = 0.02


def encode_have(indices: Iterable[int]) -> str:
    """Shards held, as the base64 of a bitfield: shard i is bit 7 - i % 8 of byte i // 8 (indices ≥ HAVE_BITS
    are left out)."""
    held = [i for i in indices if 0 <= i < HAVE_BITS]
    bits = bytearray((max(held) // 8 + 1) if held else 0)
    for i in held:
        bits[i // 8] |= 0x80 >> (i % 8)
    return base64.b64encode(bits).decode()


def decode_have(value: str) -> list[int] | None:
    """The indices of an X-Prime-Have value, or None if it is not a bitfield of at most HAVE_BITS bits."""
    if not isinstance(value, str) or len(value) > 4 * ((HAVE_BITS // 8 + 2) // 3):
        return None
    try:
        bits = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return [8 * k + j for k, byte in enumerate(bits) if byte for j in range(8) if byte & (0x80 >> j)]


def http_addr(host: str, port: int) -> str:
    """The announcement address of an HTTP shard server: /ip4/<host>/tcp/<port>/http (or /ip6/)."""
    ip = ipaddress.ip_address(host)
    return f"/ip{ip.version}/{ip}/tcp/{int(port)}/http"


def url_of(addr: str, *, allow_private: bool = False) -> str | None:
    """http://host:port for an address of exactly that form with a literal IP and a real port, else None.
    The IP must be public (addrs.py: never loopback, private, link-local, ...) unless `allow_private`:
    these addresses come from strangers, and the coordinator repeats them to every node."""
    endpoint = tcp_endpoint(addr, "/http")
    if endpoint is None or not ip_allowed(str(endpoint[0]), allow_private):
        return None
    ip, port = endpoint
    return f"http://{ip}:{port}" if ip.version == 4 else f"http://[{ip}]:{port}"


def is_http_addr(addr: str) -> bool:
    """An address of the HTTP data plane (libp2p never dials these)."""
    return isinstance(addr, str) and addr.endswith("/http")


class HttpShardServer:
    """Serves the node's shards over HTTP; `start(host, port)` returns the bound port."""

    def __init__(self, store: ShardStore | None, *, stats: P2PStats, max_concurrent: int, max_bytes: int,
                 read_timeout_s: float, upload_limit: int = 0, upload_bucket: SharedBucket | None = None,
                 max_per_client: int = 4, limits: ConnectionLimits | None = None):
        self.store = store
        self.stats = stats
        self.max_concurrent = max_concurrent
        # Transfers one client address may hold at once: one address cannot take every slot, and with the
        # runner's minimum send rate (`limits`) a slot it holds without reading is freed within seconds.
        self.max_per_client = max(1, min(max_per_client, max_concurrent))
        self.limits = limits or ConnectionLimits()
        self.active_by_client: dict[str, int] = {}
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.limiter = AsyncRateLimiter(upload_limit, shared=upload_bucket if upload_limit > 0 else None)
        self.chunk_bytes = int(min(CHUNK_BYTES, max(1024, upload_limit // 20))) if upload_limit > 0 else CHUNK_BYTES
        self.active = 0
        self.waiting = 0  # requests waiting for a shard that is arriving (ARRIVAL_WAIT_S)
        self._runner: web.AppRunner | None = None
        self._have_cache: dict[tuple[int, str], tuple[float, dict[str, str]]] = {}

    async def start(self, host: str, port: int = 0) -> int:
        app = web.Application(client_max_size=1024, middlewares=[error_middleware])  # JSON errors, never a bare 500
        app.router.add_get(PATH, self.handle)
        runner = self._runner = HardenedAppRunner(app, access_log=None, handle_signals=False, limits=self.limits)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=listen_backlog())
        await site.start()
        return runner.bound_port()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _have(self, step: int, manifest_hash: str) -> dict[str, str]:
        """The X-Prime-Have header for this checkpoint, listed again at most every HAVE_TTL_S: a listing of a
        2,048-shard step takes ~3 ms, and a flood of requests must not cost one each."""
        held = getattr(self.store, "held", None)
        if held is None:
            return {}
        now = time.monotonic()
        cached = self._have_cache.get((step, manifest_hash))
        if cached is None or now - cached[0] > HAVE_TTL_S:
            if len(self._have_cache) >= 64:  # a few live steps; never grows with requests
                self._have_cache.clear()
            cached = self._have_cache[(step, manifest_hash)] = (now, {HAVE_HEADER: encode_have(held(step, manifest_hash))})
        return cached[1]

    async def _open(self, step: int, index: int, manifest_hash: str) -> Any:
        """The shard's body, waiting up to ARRIVAL_WAIT_S for it if its step is downloading here (the store says
        so: a partial step of that manifest), else None at once."""
        if self.store is None:
            return None
        body = self.store.open(step, index, manifest_hash)
        arriving = getattr(self.store, "arriving", None)
        if body is not None or arriving is None or self.waiting >= self.max_concurrent:
            return body
        self.waiting += 1
        try:
            deadline = time.monotonic() + ARRIVAL_WAIT_S
            while time.monotonic() < deadline and arriving(step, manifest_hash):
                await asyncio.sleep(ARRIVAL_POLL_S)
                if (body := self.store.open(step, index, manifest_hash)) is not None:
                    return body
            return self.store.open(step, index, manifest_hash)  # the step may have been completed meanwhile
        finally:
            self.waiting -= 1

    async def handle(self, request: web.Request) -> web.StreamResponse:
        step = int_param(request, "step", MAX_STEP + 1)
        index = int_param(request, "index", MAX_SHARD_INDEX + 1)
        manifest_hash = request.query.get("manifest")
        if manifest_hash is None or not _HASH.fullmatch(manifest_hash):
            raise ApiError(400, "malformed", "?manifest= must be the manifest's sha256 (64 lowercase hex)")
        peer = f"http:{request.remote}"
        have = self._have(step, manifest_hash)
        client = request.remote or "unknown"
        mine = self.active_by_client.get(client, 0)
        if self.active >= self.max_concurrent or mine >= self.max_per_client:
            self.stats.count_refused("busy")
            raise ApiError(429, "busy", f"serving {self.active} shards already ({mine} to you); try another peer",
                           headers=have)
        body = await self._open(step, index, manifest_hash)
        if body is None:
            self.stats.count_refused("not_found")
            raise ApiError(404, "not_found", f"no shard {index} of step {step} here", headers=have)
        self.active += 1
        self.active_by_client[client] = mine + 1
        try:
            if body.size > self.max_bytes:
                self.stats.count_refused("too_large")
                raise ApiError(413, "too_large", f"shard is {body.size} bytes, limit {self.max_bytes}")
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", **have})
            resp.content_length = body.size
            await resp.prepare(request)
            sent = 0
            try:  # a reader that stops reading cannot pin the slot: the whole transfer has a deadline
                async with asyncio.timeout(self.read_timeout_s + body.size / FLOOR_RATE):
                    for chunk in body.chunks(self.chunk_bytes):
                        await self.limiter.acquire(len(chunk))
                        await resp.write(chunk)
                        sent += len(chunk)
                        self.stats.add_served(peer, len(chunk), shard_done=sent == body.size)
            except TimeoutError:
                self.stats.count_aborted("stalled")
                abort_connection(request.transport)  # the body is incomplete: the connection cannot be reused
            except (ConnectionError, OSError):
                self.stats.count_aborted("peer_gone")
            return resp
        finally:
            self.active -= 1
            left = self.active_by_client.get(client, 1) - 1
            if left > 0:
                self.active_by_client[client] = left
            else:
                self.active_by_client.pop(client, None)
            body.close()


async def fetch_shard_http(session: aiohttp.ClientSession, base_url: str, *, peer: str, step: int, index: int,
                           manifest_hash: str, max_bytes: int, stats: P2PStats, read_timeout_s: float,
                           connect_timeout_s: float, on_have: Callable[[list[int]], None] | None = None) -> bytes:
    """The compressed bytes of a shard from a peer's HTTP shard server (unverified: check the sha256).
    `on_have` gets the shards the peer says it holds, whatever it answered (a malformed claim is ignored)."""
    where: dict[str, Any] = dict(peer=peer, step=step, index=index)
    what = f"shard {index} of step {step} from peer {peer} over HTTP"
    url = f"{base_url}{PATH.format(step=int(step), index=int(index))}?manifest={manifest_hash}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    buf = bytearray()
    try:
        async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
            if on_have is not None and (held := decode_have(resp.headers.get(HAVE_HEADER, ""))):
                on_have(held)
            if resp.status == 429:
                raise ShardBusy(f"{what}: busy", **where)
            if resp.status == 404:
                raise ShardNotFound(f"{what}: not held there", **where)
            if resp.status == 413:
                raise ShardTooLarge(f"{what}: larger than the peer serves", **where)
            if resp.status != 200:
                raise ShardProtocolError(f"{what}: answered {resp.status}", **where)
            length = resp.content_length
            if length is None or length > max_bytes:
                raise ShardTooLarge(f"{what}: peer offers {length} bytes, limit {max_bytes}", **where)
            async with asyncio.timeout(read_timeout_s + length / FLOOR_RATE):
                async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                    buf += chunk
                    if len(buf) > length:
                        raise ShardProtocolError(f"{what}: more bytes than announced", **where)
                    stats.add_fetched(peer, len(chunk), shard_done=len(buf) == length)
            if len(buf) != length:
                raise ShardPeerGone(f"{what}: connection lost after {len(buf)} of {length} bytes", **where)
    except ShardFetchError:
        raise
    except TimeoutError:
        raise ShardFetchTimeout(f"{what}: timed out", **where) from None
    except (aiohttp.ClientError, OSError) as e:
        raise ShardPeerGone(f"{what}: {type(e).__name__}: {e}"[:300], **where) from None
    return bytes(buf)


def pick_url(addrs: Any, *, allow_private: bool = False) -> str | None:
    """The first usable HTTP shard server among a peer's announced addresses (url_of's rules)."""
    return next((url for a in addrs or () if (url := url_of(a, allow_private=allow_private)) is not None), None)
