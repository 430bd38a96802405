"""A hostile relay beside the real coordinator (issue #25, finding 3): it serves honest shards (so it becomes
the fastest source, the one the fetcher asks for the listing) and then garbage on GET /v1/checkpoints. The
node must never exit: the relay is marked bad and the node goes on with the coordinator.

The fetcher tests run the real `Fetcher` (the loop of workers, relays and pool verifiers alike) with the real
`HttpSource`s against the real coordinator and a real aiohttp relay on 127.0.0.1; the worker tests run a
whole `WorkerNode`. The fuzz test throws hypothesis-made answers (listings, manifests, headers, shard bodies,
HTTP framing) from a real local server at the real source classes: only the source's own error leaves.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = pytest.mark.timeout(300)


def _honest_then(garbage: str):
    """How the relay answers GET /v1/checkpoints once it has served shards: (honest listing) -> body bytes."""
    def listing(honest: dict) -> bytes:
        if garbage == "deep_nesting":
            return b"[" * 100_000
        if garbage == "wrong_types":
            return json.dumps({"checkpoints": [{"step": "latest"}]}).encode()
        if garbage == "missing_keys":
            return json.dumps({"checkpoints": [{"step": 10**6}]}).encode()
        if garbage == "huge_body":  # 4 MiB: more than any listing of MAX_LISTED_STEPS steps
            return json.dumps({**honest, "steps": honest["steps"], "pad": "x" * (4 << 20)}).encode()
        if garbage == "extra_keys":
            return json.dumps({**honest, "mirror_of": "http://evil.example"}).encode()
        if garbage == "negative_steps":
            fake = dict(honest["checkpoints"][0], step=-1)
            return json.dumps({**honest, "checkpoints": [*honest["checkpoints"], fake]}).encode()
        if garbage == "base_not_before_step":  # a delta that is its own base: a loop for a naive planner
            fake = dict(honest["checkpoints"][0], step=10**6, encoding="xor-delta", base_step=10**6)
            return json.dumps({**honest, "checkpoints": [*honest["checkpoints"], fake]}).encode()
        if garbage == "not_json":
            return b"<html><body>502 Bad Gateway</body></html>"
        raise AssertionError(garbage)
    return listing


GARBAGE = ["deep_nesting", "wrong_types", "missing_keys", "huge_body", "extra_keys", "negative_steps",
           "base_not_before_step", "not_json"]


class HostileRelay:
    """A relay on 127.0.0.1 that serves the coordinator's manifests and shards honestly (from memory once it
    has them, so it is fast) and answers listings with `garbage`: from the first one, or (`after_shards`)
    once it has served a shard, as an attacker does who wants to be the fastest source first."""

    def __init__(self, upstream: str, garbage: str, *, after_shards: bool = False):
        self.upstream, self.listing, self.after_shards = upstream, _honest_then(garbage), after_shards
        self.cache: dict[str, tuple[int, bytes, str]] = {}
        self.shards_served = 0
        self.garbage_served = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _upstream(self, path_qs: str) -> tuple[int, bytes, str]:
        if path_qs in self.cache:
            return self.cache[path_qs]
        async with aiohttp.ClientSession() as s, s.get(self.upstream + path_qs) as r:
            got = r.status, await r.read(), r.content_type
        if got[0] == 200 and path_qs != "/v1/checkpoints":  # manifests and shards of a step never change
            self.cache[path_qs] = got
        return got

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        status, body, content_type = await self._upstream(request.path_qs)
        if request.path == "/v1/checkpoints" and status == 200 and (self.shards_served or not self.after_shards):
            self.garbage_served += 1
            return web.Response(body=self.listing(json.loads(body)), content_type="application/json")
        if "/shards/" in request.path and status == 200:
            self.shards_served += 1
        return web.Response(body=body, status=status, content_type=content_type)

    async def __aenter__(self) -> "HostileRelay":
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.mark.parametrize("garbage", GARBAGE)
async def test_hostile_relay_listing_is_banned_and_fetch_loop_goes_on(tmp_path, garbage):
    """The fetch loop of a worker, relay or pool verifier (one `Fetcher` class): the relay is the source asked
    first for the listing (listed first, as the fastest source is) and answers garbage. The loop never ends;
    the relay is banned; step 0 comes from the coordinator and every later listing too."""
    from node.aio import client_session
    from node.checkpoint_dir import CheckpointDir
    from node.worker.fetcher import Fetcher
    from node.worker.sources import HttpSource

    async with running_coordinator(tmp_path, "run.max_steps=1") as (coord, url), HostileRelay(url, garbage) as evil:
        async with client_session() as session:
            relay_src = HttpSource(evil.url, "relay", session)
            held: list[int] = []
            fetcher = Fetcher(CheckpointDir(tmp_path / "node"), [relay_src, HttpSource(url, "coordinator", session)],
                              coord.identity.public_hex, keep=3, on_new_step=lambda step, path: held.append(step))
            stop = asyncio.Event()
            loop = asyncio.create_task(fetcher.run(stop, poll_seconds=0.05))
            try:
                await wait_for(lambda: loop.done() or fetcher.score(relay_src).banned, 60, "the relay's ban")
                assert not loop.done(), f"the fetch loop ended: {loop.exception()!r}"
                assert evil.garbage_served >= 1
                served = evil.garbage_served
                await asyncio.sleep(0.5)  # ~10 more polls: all of them go to the coordinator
                assert not loop.done(), f"the fetch loop ended: {loop.exception()!r}"
                assert evil.garbage_served == served
                await wait_for(lambda: held == [0], 30, "step 0 from the coordinator")
                assert fetcher.newest_held == 0 and not loop.done()
            finally:
                stop.set()
                await asyncio.wait_for(loop, 10)


@pytest.mark.parametrize("garbage", ["deep_nesting", "wrong_types"])
async def test_hostile_relay_does_not_stop_the_worker(tmp_path, garbage):
    """A whole worker, the relay in its run spec: the relay serves step 0's shards first, from memory and as one
    2 MiB shard, so that it becomes the fastest source and is asked for the next listing; then garbage. The
    worker never exits, bans the relay, and goes on fetching later steps from the coordinator and doing
    accepted work."""
    async with running_coordinator(tmp_path, "run.max_steps=3", "distribution.shard_size=2097152") as (coord, url), \
            HostileRelay(url, garbage, after_shards=True) as evil:
        coord.cfg.distribution.relays.append(evil.url)
        for path in ("/v1/checkpoints/0/manifest", "/v1/checkpoints/0/shards/0"):  # a mirror holds step 0
            await evil._upstream(path)
        node, task = start_worker(tmp_path, "w", coord, url)
        relay = lambda: next(s for s in node.fetcher.sources if s.kind == "relay")  # noqa: E731

        def banned() -> bool:
            if task.done():
                raise AssertionError(f"the worker exited: {task.exception()!r}")
            return getattr(node, "fetcher", None) is not None and node.fetcher.score(relay()).banned

        await wait_for(banned, 120, "the relay's ban", coord)
        first = node.fetcher.newest_held
        await wait_for(lambda: banned() and node.fetcher.newest_held > first and node.stats.accepted > 0, 180,
                       "a later step from the coordinator and accepted work", coord)
        assert evil.garbage_served >= 1
        await stop_workers((node, task))
        assert node.stats.rejected == 0


# --- fuzz: whatever a server answers, only SourceError leaves a source --------------------------------------


def _answers():
    """Hypothesis strategy of one server answer: ("web", status, headers, body) served by aiohttp as given, or
    ("raw", bytes) written as the whole response on the socket (broken framing, lying lengths, cut bodies)."""
    from hypothesis import strategies as st

    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)
    header_names = st.sampled_from(["X-Prime-Holder", "X-Prime-Have", "Content-Type", "Retry-After", "X-Extra"])
    json_value = st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | printable,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(printable, inner, max_size=4), max_leaves=20)
    entry = st.fixed_dictionaries({}, optional={
        "step": json_value | st.integers(-5, 10**10), "encoding": st.sampled_from(["full", "xor-delta", "?"]) | json_value,
        "base_step": st.none() | st.integers(-5, 10**10) | json_value, "num_shards": st.integers(-1, 10**6),
        "total_size": st.integers(-1, 2**64), "compressed_size": st.integers(-1, 2**64),
        "manifest_hash": st.sampled_from(["0" * 64, "zz", ""]) | printable})
    listing = st.fixed_dictionaries({}, optional={
        "steps": st.lists(st.integers(-3, 10**10), max_size=5) | json_value,
        "newest": st.none() | st.integers(-3, 10**10) | json_value,
        "checkpoints": st.lists(entry, max_size=4) | json_value, "extra": json_value})
    documents = (json_value | listing).map(lambda d: json.dumps(d).encode())
    deep = st.integers(1, 200_000).map(lambda n: b"[" * n) | st.integers(1, 50_000).map(lambda n: b'{"a":' * n)
    seeded = st.just(b'{"error":"seeded","detail":"ask peers"}')
    body = st.binary(max_size=4096) | documents | deep | seeded
    headers = st.dictionaries(header_names, printable | st.sampled_from(["0" * 64 + " /ip4/127.0.0.1/tcp/1/http"]),
                              max_size=3)
    web_answer = st.tuples(st.just("web"), st.sampled_from([200, 206, 204, 404, 429, 500, 302]), headers, body)
    head = st.tuples(st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.1 206 Partial", b"HTTP/1.1 429 x", b"HTTP/9 2",
                                      b"", b"garbage"]),
                     st.lists(st.sampled_from([b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 99999",
                                               b"Content-Length: x", b"Transfer-Encoding: chunked",
                                               b"Content-Encoding: gzip", b"Content-Type: application/json",
                                               b"X-Prime-Holder: \xff\xfe", b"Bad header line"]), max_size=4),
                     st.binary(max_size=512))
    raw = head.map(lambda h: (h[0] + b"\r\n" + b"".join(x + b"\r\n" for x in h[1]) + b"\r\n" + h[2]))
    return web_answer | st.tuples(st.just("raw"), raw | st.binary(max_size=512))


def test_fuzzed_answers_raise_only_source_errors_from_the_worker_sources(tmp_path):
    """Listings, manifests, headers, shard bodies and HTTP framing chosen by hypothesis, served from a real
    aiohttp server (and a raw socket server for broken framing) on 127.0.0.1 to the real `HttpSource` (as a
    relay and as a swarm-enabled coordinator source): each call returns a typed answer or raises SourceError,
    never anything else; a manifest's bytes then meet `TrustedManifests`, which raises only CheckpointError."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from node.aio import client_session
    from node.worker.sources import HttpSource, SourceError
    from node.worker.trusted import TrustedManifests
    from protocol.checkpoint import CheckpointError
    from protocol.messages import CheckpointList

    loop = asyncio.new_event_loop()
    now: dict = {}

    async def web_handler(request: web.Request) -> web.StreamResponse:
        _, status, headers, body = now["answer"]
        return web.Response(status=status, headers=headers, body=body)

    async def raw_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(now["answer"][1])
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def start():
        app = web.Application()
        app.router.add_get("/{tail:.*}", web_handler)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        raw = await asyncio.start_server(raw_handler, "127.0.0.1", 0)
        session = client_session(sock_connect=2, sock_read=2)
        return runner, raw, session, site._server.sockets[0].getsockname()[1], raw.sockets[0].getsockname()[1]

    runner, raw, session, web_port, raw_port = loop.run_until_complete(start())
    trusted = TrustedManifests("ab" * 32)
    calls = {"ok": 0, "source_error": 0}

    async def one(answer, op: str, swarm: bool, max_bytes: int, offset: int) -> None:
        now["answer"] = answer
        port = web_port if answer[0] == "web" else raw_port
        src = HttpSource(f"http://127.0.0.1:{port}", "coordinator" if swarm else "relay", session, swarm=swarm,
                         shard_addr=lambda: "/ip4/127.0.0.1/tcp/9/http")
        try:
            if op == "listing":
                assert isinstance(await src.listing(), CheckpointList)
            elif op == "manifest":
                data = await src.manifest(3)
                try:
                    trusted.accept(data, 3, newest_held=None, parent=None)
                except CheckpointError:
                    pass
            else:
                data = await src.shard(3, 0, max_bytes, offset, manifest_hash="0" * 64)
                assert isinstance(data, bytes) and len(data) <= max_bytes - offset
            calls["ok"] += 1
        except SourceError:
            calls["source_error"] += 1

    @settings(max_examples=150, deadline=5000, suppress_health_check=list(HealthCheck), database=None)
    @given(answer=_answers(), op=st.sampled_from(["listing", "manifest", "shard"]), swarm=st.booleans(),
           max_bytes=st.integers(1, 8192), offset=st.sampled_from([0, 0, 1, 100]))
    def check(answer, op, swarm, max_bytes, offset):
        loop.run_until_complete(asyncio.wait_for(one(answer, op, swarm, max_bytes, offset), 10))

    try:
        check()
    finally:
        async def stop():
            await session.close()
            raw.close()
            await raw.wait_closed()
            await runner.cleanup()
        loop.run_until_complete(stop())
        loop.close()
    assert calls["source_error"] > 0  # the garbage was seen and refused, not skipped
