"""A worker generates its next assignment while its last submission is in flight (issue #26, "the k = 2 claim
under WAN": with k = 2 the lab's trainer still waited on each node's submit round trip plus the coordinator's
intake, because the node generated nothing until the answer came back).

Real coordinator, real in-process worker (tiny model, real generation), and between them a real HTTP hop that
forwards every request untouched but holds the first submission until the worker has generated more tokens, or
for HOLD_S. A worker that waits for its submission's answer before it generates again never gets there.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(180)]

HOLD_S = 30.0  # a generation of the tiny model takes well under a second; 30 s is for a loaded 2-core CI box
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}  # the rest pass as they are


class HoldingHop:
    """Forwards every request to `upstream`; holds the first POST /v1/submit until `released()` or HOLD_S."""

    def __init__(self, upstream: str, released) -> None:
        self.upstream, self.released = upstream, released
        self.held_s: float | None = None  # how long the first submission was held; None until it was
        self.released_by_progress = False
        self.submits = 0
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        if request.method == "POST" and request.path == "/v1/submit":
            self.submits += 1
            if self.submits == 1:
                t0 = time.monotonic()
                while time.monotonic() - t0 < HOLD_S and not self.released():
                    await asyncio.sleep(0.05)
                self.released_by_progress = self.released()
                self.held_s = time.monotonic() - t0
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                        headers=headers, auto_decompress=False) as r:
            payload = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
            return web.Response(status=r.status, body=payload, headers=out)


async def test_the_next_assignment_generates_while_the_last_submission_is_in_flight(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0") as (coord, url):
        tokens_at_hold: list[int] = []
        node_ref: list = []

        def released() -> bool:
            node = node_ref[0]
            if not tokens_at_hold:
                tokens_at_hold.append(node.stats.tokens)
            return node.stats.tokens > tokens_at_hold[0]

        hop = HoldingHop(url, released)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", hop.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:
            hop.session = session
            pair = start_worker(tmp_path, "w", coord, f"http://127.0.0.1:{port}", "p2p.enabled=false")
            node_ref.append(pair[0])
            try:
                await wait_for(lambda: hop.submits >= 2, 120, "a second submission")
                assert hop.held_s is not None
                print(f"first submission held {hop.held_s:.2f} s; generated meanwhile: {hop.released_by_progress}")
                assert hop.released_by_progress, (
                    f"the worker generated nothing in the {HOLD_S:.0f} s its first submission was in flight")
                await wait_for(lambda: pair[0].stats.assignments >= 2, 60, "two answered submissions")
                assert pair[0].stats.accepted > 0 and pair[0].stats.lost == 0
            finally:
                await stop_workers(pair)
                await runner.cleanup()
