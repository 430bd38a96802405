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
