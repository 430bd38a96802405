"""Idle nodes are paced by the coordinator (node/coordinator/pacing.py; docs/PROTOCOL.md, `POST /v1/work`): a 204
says when to ask again, so that all idle nodes together ask at about `server.idle_work_requests_per_s` instead of
every node every 0.2-0.5 s (10,000 idle nodes: 20,000-50,000 requests a second). The pure pacer, then the real
coordinator and the real client over loopback, and a coordinator's header a node must not trust blindly."""
from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from node.coordinator.pacing import MAX_MS, MIN_MS, WINDOW_MS, IdlePacer
from node.http import RETRY_AFTER_MS_HEADER
from node.worker.client import DEFAULT_NO_WORK, CoordinatorClient
from protocol import messages as M
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def test_the_wait_grows_with_the_idle_nodes_within_bounds():
    p = IdlePacer(requests_per_s=100)
    assert p.no_work("a", 0).retry_after_ms == MIN_MS  # one idle node: the old cadence
    for i in range(999):
        p.no_work(f"n{i}", 10)
    assert p.idle_nodes() == 1000 and p.no_work("a", 20).retry_after_ms == 10_000  # 1,000 idle / 100 per s
    for i in range(20_000):
        p.no_work(f"m{i}", 30)
    assert p.no_work("a", 40).retry_after_ms == MAX_MS
    # a node that got work is no longer idle; nodes not told "no work" for WINDOW_MS drop out
    p.got_work("a")
    assert p.idle_nodes() == 20_999
    assert p.no_work("b", 40 + WINDOW_MS + 1).retry_after_ms == MIN_MS and p.idle_nodes() == 1


def test_the_wire_bounds_of_the_wait():
    with pytest.raises(ValidationError):
        M.NoWork(retry_after_ms=0)
    with pytest.raises(ValidationError):
        M.NoWork(retry_after_ms=10**9)


async def test_a_coordinator_header_out_of_bounds_or_garbled_means_the_default():
    """The node parses the header through the wire model; anything else (huge, negative, other scripts' digits,
    text) is the default wait, never a node that sleeps for a day or spins."""
    sent: list[str] = []

    async def work(request):
        return web.Response(status=204, headers={RETRY_AFTER_MS_HEADER: sent[-1]} if sent[-1] else None)

    async def status(request):
        return web.json_response({"run_id": "r", "coordinator_key": "00" * 32})

    app = web.Application()
    app.router.add_post("/v1/work", work)
    app.router.add_get("/v1/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as s:
            client = CoordinatorClient(f"http://127.0.0.1:{port}", Identity.generate(), s)
            for header, expected in [("5000", 5000), ("", 250), ("99999999999", 250), ("-5", 250), ("50", 250),
                                     ("١٢٠٠", 250), ("12ms", 250), ("120000", 120_000)]:
                sent.append(header)
                got = await client.work(0)
                assert isinstance(got, M.NoWork) and got.retry_after_ms == expected, (header, got)
            assert DEFAULT_NO_WORK.retry_after_ms == 250
    finally:
        await runner.cleanup()


async def test_a_real_coordinator_paces_its_idle_nodes(tmp_path):
    """Twelve joined nodes, no work left (one node holds every place of the open batches): each 204 names a wait
    that grows with the nodes told "no work", 12 idle at 4 requests/s -> 3 s; the node that asked first was told
    the minimum."""
    from tests.integration.coordinator_harness import running_coordinator

    async with running_coordinator(tmp_path, "verification.fraction=0", "run.batch_prompts=1",
                                   "run.max_assignments_per_node=100", "admission.pow_bits=0",
                                   "admission.joins_per_address_per_minute=100",
                                   "server.idle_work_requests_per_s=4") as (coord, base):
        async with aiohttp.ClientSession() as s:
            nodes = [CoordinatorClient(base, Identity.generate(), s) for _ in range(12)]
            for n in nodes:
                await n.join()
            taken = 0
            while isinstance(await nodes[0].work(0), M.Assignment):  # the open batches' places, all to node 0
                taken += 1
                assert taken < 50, "work never ran out"
            waits = [(await n.work(0)) for n in nodes[1:]]
            assert all(isinstance(w, M.NoWork) for w in waits)
            ms = [w.retry_after_ms for w in waits]
            assert ms[0] == 500 and ms[-1] == 3000 and ms == sorted(ms), ms  # node 0 counts too: 2 idle, then 12
            assert coord.idle_pacer.idle_nodes() == 12
