"""A new step reaches a node by the coordinator's push (its signed `manifest` gossip), not by the fetcher's poll.

bench/wan.py --loopback measured where a delta's seconds go from publication to "held" (docs/BENCHMARKS.md, "WAN
lab: N nodes"): the gossip reached each node 0.1-0.5 s after publication (median, N = 1 and 6), before the 1 s poll
would have. This test keeps that mechanism: with the fetcher's poll stretched to 10 minutes, a real worker (p2p on)
still holds every new step within a generous bound of its publication, and each of those fetches followed an
announcement of that step."""
import time

import pytest

from node.worker.fetcher import Fetcher
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.p2p]

STEPS = 3
PUSH_BOUND_S = 30.0  # generous: a loaded 2-core box; the poll it replaces here is 600 s


async def test_new_step_is_fetched_on_the_coordinators_announcement(tmp_path, monkeypatch):
    run = Fetcher.run

    async def slow_poll(self, stop, poll_seconds: float = 1.0):
        return await run(self, stop, poll_seconds=600.0)

    monkeypatch.setattr(Fetcher, "run", slow_poll)
    # k above the run's length: the node is never answered "stale_policy" (a 409 that also wakes the fetcher),
    # so only the announcement can bring a new step before the stretched poll
    async with running_coordinator(tmp_path, f"run.max_steps={STEPS}", f"run.async_level={STEPS + 2}") as (coord, url):
        node, task = start_worker(tmp_path, "w", coord, url)
        announced: dict[int, float] = {}
        held: dict[int, float] = {}
        on_ann, on_new = node._on_announcement, node._on_new_step

        def ann(event):
            if event.announcement.kind == "manifest":
                announced.setdefault(event.announcement.step, time.time())
            on_ann(event)

        def new(step, path):
            held.setdefault(step, time.time())
            on_new(step, path)

        node._on_announcement, node._on_new_step = ann, new
        await wait_for(lambda: coord.published_step >= STEPS, 240, f"step {STEPS} published", coord)
        await wait_for(lambda: STEPS in held, PUSH_BOUND_S, f"the node to hold step {STEPS} (announced: "
                       f"{sorted(announced)}, held: {sorted(held)})", coord)
        await stop_workers((node, task))
        published = {r.step: r.published_ms / 1e3 for r in coord.ledger.steps()}  # wall clock, as time.time()
        for step in range(1, STEPS + 1):
            if step not in held:  # skipped to a newer step in one fetch: fine, the newest is checked
                continue
            assert step in announced, f"step {step} was fetched without an announcement (a poll or a 409)"
            assert step in published, published
            assert announced[step] <= held[step], (step, announced, held)
            assert held[step] - published[step] < PUSH_BOUND_S, (
                f"step {step} held {held[step] - published[step]:.1f} s after its publication")
