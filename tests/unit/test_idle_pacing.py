"""Idle nodes are paced by the coordinator (node/coordinator/pacing.py; docs/PROTOCOL.md, `POST /v1/work`): a 204
says when to ask again, so that all idle nodes together ask at about `server.idle_work_requests_per_s` instead of
every node every 0.2-0.5 s (10,000 idle nodes: 20,000-50,000 requests a second). The pure pacer, then the real
coordinator and the real client over loopback, and a coordinator's header a node must not trust blindly."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from node.coordinator.pacing import WORK_MAX_MS, WORK_MIN_MS, Pacer, online_ms, work_min_ms
from node.http import RETRY_AFTER_MS_HEADER
from node.worker.client import DEFAULT_NO_WORK, CoordinatorClient
from protocol import messages as M
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def test_the_wait_grows_with_the_idle_nodes_within_bounds():
    p = Pacer(requests_per_s=100, min_ms=WORK_MIN_MS, max_ms=WORK_MAX_MS)
    assert p.asked("a", 0) == WORK_MIN_MS  # one idle node: the old cadence
    for i in range(999):
        p.asked(f"n{i}", 10)
    assert p.nodes() == 1000 and p.asked("a", 20) == 10_000  # 1,000 idle / 100 per s
    for i in range(20_000):
        p.asked(f"m{i}", 30)
    assert p.asked("a", 40) == WORK_MAX_MS
    # a node that got work is no longer idle; nodes that did not ask for two longest waits drop out
    p.forget("a")
    assert p.nodes() == 20_999
    assert p.asked("b", 40 + 2 * WORK_MAX_MS + 1) == WORK_MIN_MS and p.nodes() == 1


def test_heartbeats_and_the_online_window_follow_the_swarm():
    p = Pacer(requests_per_s=200, min_ms=5_000, max_ms=30_000)
    assert p.asked("a", 0) == 5_000 and online_ms(p.wait_ms()) == 30_000
    for i in range(10_000):
        p.asked(f"n{i}", 1)
    assert p.wait_ms() == 30_000 and online_ms(p.wait_ms()) == 90_000  # capped: 10,000 / 30 s = 333/s


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
    the minimum. Heartbeats the same way, and status counts a node online for three of their periods."""
    from tests.integration.coordinator_harness import running_coordinator

    async with running_coordinator(tmp_path, "verification.fraction=0", "run.batch_prompts=1",
                                   "run.max_assignments_per_node=100", "admission.pow_bits=0",
                                   "admission.joins_per_address_per_minute=100", "server.heartbeats_per_s=1",
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
            assert coord.work_pacer.nodes() == 12
            # heartbeats: the answer names the next one, 5 s at first, then nodes / 1 per s; online follows (3x)
            hb = M.HeartbeatRequest(policy_step=0, tokens_per_second=1.0, state="idle", steps_held=[0],
                                    bytes_by_source={})
            told = [(await n.heartbeat(hb))[1] for n in nodes]
            assert told[0] == 5_000 and told[-1] == 12_000 and told == sorted(told), told
            assert coord.online_ms() == 36_000  # status and metrics count a node online this long


def test_the_shortest_wait_keeps_within_the_nodes_rate_limit():
    assert work_min_ms(50.0) == WORK_MIN_MS  # the default limit: the old cadence
    assert work_min_ms(3.0) == 667 and work_min_ms(0.5) == 4000  # at most half the limit in idle re-asks


async def test_a_node_that_waits_as_told_is_never_rate_limited(tmp_path):
    """Under a limit of 3 requests a second (burst 1) an idle node that asks again when the 204 says must not be
    answered 429: the coordinator used to name 250 ms (4 a second) whatever its own limit."""
    from tests.integration.coordinator_harness import running_coordinator

    async with running_coordinator(tmp_path, "verification.fraction=0", "run.batch_prompts=1",
                                   "run.max_assignments_per_node=100", "admission.pow_bits=0",
                                   "server.rate_limit_per_second=3", "server.rate_limit_burst=1") as (coord, base):
        async with aiohttp.ClientSession() as s:
            holder, idle = (CoordinatorClient(base, Identity.generate(), s) for _ in range(2))
            for n in (holder, idle):
                await n.join()
                await asyncio.sleep(0.5)  # the join's token back
            while isinstance(await holder.work(0), M.Assignment):  # every open place to the holder
                await asyncio.sleep(0.4)
            for _ in range(4):
                got = await idle.work(0)  # raised CoordinatorError(429) on the second ask: told 250 ms
                assert isinstance(got, M.NoWork), got
                await asyncio.sleep(got.retry_after_ms / 1000)
            assert got.retry_after_ms >= 667, got
