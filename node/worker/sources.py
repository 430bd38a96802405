"""Where checkpoint bytes come from. Every source is untrusted: the fetcher checks each shard
against the signed manifest, so a source only ever costs a retry.

One boundary for untrusted bytes: a source's answers reach the fetcher typed (a listing through its wire
model, `protocol.messages.decode`; a manifest's bytes go to `TrustedManifests`, whose strict parser is the
manifest's one deserializer; shard bytes are checked against the signed sha256), and the only error that
leaves a source is `SourceError`. `BadAnswer`, its subclass, says the source answered with bytes that break
the protocol (not the wire model, over its size cap): the fetcher bans that source and goes on with the
others, where a plain `SourceError` (unreachable, 404, busy) only costs a retry."""
from __future__ import annotations

import re
from typing import Callable, Protocol, Sequence

import aiohttp
from multidict import CIMultiDict

from node.aio import read_bounded
from node.http import HOLDER_HEADER, SHARD_ADDR_HEADER, SHARD_HOLDER_HEADER, SWARM_HEADER
from node.worker.client import MAX_MANIFEST_BYTES, Unreachable, read_limited
from protocol.messages import MAX_LISTING_BYTES, CheckpointList, ErrorBody, WireError, decode


class SourceError(Exception):
    """A source failed; `data` holds the bytes received before it did (for a Range resume)."""

    def __init__(self, msg: str, data: bytes = b""):
        super().__init__(msg)
        self.data = data


class BadAnswer(SourceError):
    """The source answered with bytes that are not what the protocol says (a listing that is not a
    CheckpointList, a body over its cap): it is hostile or broken, and the fetcher stops asking it."""


class ShardDeferred(SourceError):
    """The origin asks us to get this shard from peers for now (super-seeding); `holders`: (node id, address) of
    the node it sent the first copy to, once per address it says: its HTTP shard server
    (/ip4/<ip>/tcp/<port>/http) and its libp2p address (/ip4/<ip>/tcp/<port>)."""

    def __init__(self, msg: str, holders: list[tuple[str, str]] | None = None):
        super().__init__(msg)
        self.holders = holders or []


class ShardSource(Protocol):
    """Everything the fetcher asks of a source (an HTTP server, or the swarm of peers)."""

    name: str
    kind: str  # "coordinator" | "relay" | "peer"

    async def listing(self) -> CheckpointList:
        """GET /v1/checkpoints, parsed (SourceError if this source cannot list; BadAnswer if its answer is
        not a listing)."""

    async def manifest(self, step: int) -> bytes:
        """The manifest's bytes, untrusted (SourceError if this source has none)."""

    async def shard(self, step: int, index: int, max_bytes: int, offset: int = 0, *,
                    manifest_hash: str | None = None) -> bytes:
        """Bytes [offset, end) of a compressed shard (ShardDeferred: "not now, ask peers")."""

    def holders(self, step: int, index: int, manifest_hash: str) -> int:
        """How many peers behind this source are known to hold the shard (0 for a server)."""

    def report_bad(self, step: int, index: int) -> bool:
        """The shard just served failed verification: True if the source dealt with it (dropped the
        one peer that served it), False if the fetcher should ban the source itself."""

    def hint(self, step: int, manifest_hash: str, index: int, node_id: str, addr: str) -> None:
        """The origin says `node_id` holds the shard and serves it at `addr`, HTTP or libp2p (the swarm records
        it)."""

    def first_holders(self, step: int) -> list[tuple[int, str, str]]:
        """(shard index, node id, address) for the first copies of `step` that this source named with its
        manifest (the origin's X-Prime-Shard-Holder; [] for any other source): fetched from those peers at once."""


_HOLDER = re.compile(r"([0-9a-f]{64}) (/\S{1,200})")
_SHARD_HOLDER = re.compile(r"(\d{1,5}) ([0-9a-f]{64}) (/\S{1,200})")
MAX_SHARD_HOLDERS = 64  # X-Prime-Shard-Holder values read from one manifest answer (the origin sends at most 64)
KEEP_HOLDER_STEPS = 8  # steps whose named holders an HttpSource keeps until the fetcher takes them


def _holders(values: list[str]) -> list[tuple[str, str]]:
    """(node id, address) of each of the first two X-Prime-Holder values that is exactly that."""
    return [(m.group(1), m.group(2)) for v in values[:2] if (m := _HOLDER.fullmatch(v))]


def _shard_holders(values: list[str]) -> list[tuple[int, str, str]]:
    """(shard index, node id, address) of each of the first MAX_SHARD_HOLDERS X-Prime-Shard-Holder values that is
    exactly that (the address is checked where it is used: PeerSource.hint)."""
    return [(int(m.group(1)), m.group(2), m.group(3)) for v in values[:MAX_SHARD_HOLDERS]
            if (m := _SHARD_HOLDER.fullmatch(v))]


class HttpSource:
    """A coordinator or relay serving the /v1/checkpoints paths (docs/PROTOCOL.md, "HTTP API")."""

    def __init__(self, base_url: str, kind: str, session: aiohttp.ClientSession, *, swarm: bool = False,
                 signer: Callable[[str, str], dict[str, str]] | None = None,
                 shard_addr: Callable[[], str | Sequence[str] | None] = lambda: None):
        self.base = base_url.rstrip("/")
        self.name = f"{kind}:{self.base}"
        self.kind = kind
        self.session = session
        self.swarm = swarm  # we can also fetch from peers: the origin may defer us to them
        # (method, path) -> signed headers: super-seeding counts only the copies of joined nodes
        self.signer = signer
        # where we serve shards (our HTTP shard server first: an older origin reads only the first; then our
        # libp2p address), told to the origin so it can name us as a first holder
        self.shard_addr = shard_addr
        self._first_holders: dict[int, list[tuple[int, str, str]]] = {}  # step -> named with its manifest

    def _swarm_headers(self, path: str) -> CIMultiDict[str]:
        """A swarm node's request is signed, so that the origin knows a joined node asks (super-seeding)."""
        headers: CIMultiDict[str] = CIMultiDict()
        if self.swarm:
            headers[SWARM_HEADER] = "1"
            if self.signer is not None:
                headers.update(self.signer("GET", path))
        return headers

    async def _get(self, path: str, limit: int, headers: CIMultiDict[str] | None = None
                   ) -> tuple[int, bytes, list[str]]:
        """Status, body (at most `limit` bytes: a longer body is a BadAnswer, read no further) and the answer's
        X-Prime-Shard-Holder values."""
        try:
            async with self.session.get(self.base + path, headers=headers) as resp:
                return resp.status, await read_limited(resp, limit), resp.headers.getall(SHARD_HOLDER_HEADER, [])
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise SourceError(f"{self.name}: {e or type(e).__name__}") from None
        except Unreachable:
            raise BadAnswer(f"{self.name}: {path} sent more than the {limit}-byte limit") from None

    async def listing(self) -> CheckpointList:
        status, body, _ = await self._get("/v1/checkpoints", MAX_LISTING_BYTES)
        if status != 200:
            raise SourceError(f"{self.name}: /v1/checkpoints answered {status}")
        try:
            return decode(CheckpointList, body, limit=MAX_LISTING_BYTES)
        except WireError as e:
            raise BadAnswer(f"{self.name}: /v1/checkpoints: {e}") from None

    async def manifest(self, step: int) -> bytes:
        path = f"/v1/checkpoints/{int(step)}/manifest"
        status, body, holders = await self._get(path, MAX_MANIFEST_BYTES, self._swarm_headers(path))
        if status != 200:
            raise SourceError(f"{self.name}: manifest of step {step} answered {status}")
        if holders and self.swarm:
            self._first_holders[int(step)] = _shard_holders(holders)
            while len(self._first_holders) > KEEP_HOLDER_STEPS:
                del self._first_holders[min(self._first_holders)]
        return body

    def first_holders(self, step: int) -> list[tuple[int, str, str]]:
        return self._first_holders.pop(step, [])

    def holders(self, step: int, index: int, manifest_hash: str) -> int:
        return 0

    def report_bad(self, step: int, index: int) -> bool:
        return False

    def hint(self, step: int, manifest_hash: str, index: int, node_id: str, addr: str) -> None:
        pass  # a server has no peers to learn about

    async def shard(self, step: int, index: int, max_bytes: int, offset: int = 0, *,
                    manifest_hash: str | None = None) -> bytes:
        """Bytes [offset, end) of a compressed shard, read in chunks so a broken transfer keeps what came."""
        path = f"/v1/checkpoints/{int(step)}/shards/{int(index)}"
        headers = self._swarm_headers(path)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        if self.swarm:
            mine = self.shard_addr()
            for addr in ([mine] if isinstance(mine, str) else list(mine or ()))[:2]:  # one header per address
                headers.add(SHARD_ADDR_HEADER, addr)
        url = self.base + path
        got = bytearray()
        try:
            async with self.session.get(url, headers=headers) as resp:
                if resp.status == 429 and getattr(ErrorBody.parse(await read_bounded(resp.content, 4096) or b""),
                                                  "error", None) == "seeded":
                    raise ShardDeferred(f"{self.name}: shard {index} of step {step} is spreading via peers",
                                        holders=_holders(resp.headers.getall(HOLDER_HEADER, [])))
                if resp.status not in (200, 206) or (offset and resp.status != 206):
                    raise SourceError(f"{self.name}: shard {index} of step {step} answered {resp.status}")
                async for chunk in resp.content.iter_chunked(256 * 1024):
                    got += chunk
                    if len(got) > max_bytes - offset:
                        raise BadAnswer(f"{self.name}: shard {index} of step {step} is larger than signed")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise SourceError(f"{self.name}: {e or type(e).__name__}", bytes(got)) from None
        return bytes(got)
