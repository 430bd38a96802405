"""Coordinator + real worker nodes (transformers backend, verification on) on loopback."""
import signal
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from tests.integration.coordinator_harness import REPO, running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = pytest.mark.timeout(300)


async def test_two_nodes_k2_staleness_bounded_all_honest_accepted(tmp_path):
    async with running_coordinator(tmp_path, "run.async_level=2", "run.max_steps=5") as (coord, url):
        a = start_worker(tmp_path, "a", coord, url)
        b = start_worker(tmp_path, "b", coord, url)
        await wait_for(lambda: coord.published_step >= 5, 180, "5 steps", coord)
        await stop_workers(a, b)
        status = coord.status()
        assert status["verification"]["rejected"] == 0, status["verification"]
        assert status["verification"]["accepted"] > 0
        assert max(int(s) for s in status["staleness_histogram"]) <= 2
        for row in coord.ledger.steps()[1:]:
            assert row.metrics["max_staleness"] <= 2
        for node, _ in (a, b):
            assert node.stats.accepted > 0 and node.stats.rejected == 0
            held = node.fetcher.store.steps()
            # keeps the last k + 1 versions, plus the delta chain back to a full one (to serve peers)
            assert held[-1] >= 4 and held == list(range(held[0], held[-1] + 1))
            assert len(held) <= 3 or node.fetcher.store.manifest(held[0]).encoding == "full"
            # ...but reconstructed payloads (a full model each) only of the last k + 1: disk does not grow per
            # step (the engine had stopped, so no older step was in use)
            payloads = node.fetcher.store.held_steps()
            assert held[-1] in payloads and set(payloads) <= set(held[-3:]), (payloads, held)
            # the checkpoints a node holds chain: each parent is the previous step's manifest hash
            for s in held[1:]:
                m, prev = node.fetcher.store.manifest(s), node.fetcher.store.manifest(s - 1)
                if prev is not None:
                    assert m.parent == prev.canonical_hash()


async def test_late_joiner_catches_up_full_then_deltas(tmp_path):
    async with running_coordinator(tmp_path, "distribution.full_every=3", "run.max_steps=7") as (coord, url):
        early = start_worker(tmp_path, "early", coord, url)
        await wait_for(lambda: coord.published_step >= 5, 180, "step 5", coord)
        listing = {c["step"]: c for c in coord.checkpoints.listing()}
        # The early node has done its part. Left running, it could take every prompt up to max_steps while
        # the late node is still downloading, and leave it no work at all (seen on a loaded machine).
        await stop_workers(early)
        late_node, late_task = start_worker(tmp_path, "late", coord, url)
        fetched = []
        original = late_node._on_new_step
        late_node._on_new_step = lambda step, path: (fetched.append(step), original(step, path))
        # The run's last step (7) is an xor-delta (full ones are 0, 3, 6) and the late node is the only worker
        # left, so it must fetch a delta before the run can end: wait for exactly that, not for whatever
        # happens to come first (its first accepted rollouts may be made on the full step it began at).
        def delta_fetched() -> bool:
            listing.update({c["step"]: c for c in coord.checkpoints.listing()})  # steps published since (5-7)
            return any(listing.get(s, {}).get("encoding") == "xor-delta" for s in fetched[1:])

        await wait_for(lambda: late_node.stats.accepted > 0 and delta_fetched(), 180,
                       "the late node's first accepted rollouts and its first delta", coord)
        await stop_workers((late_node, late_task))
        first = fetched[0]
        assert listing[first]["encoding"] == "full" and first > 0  # older steps were pruned; it began at a full one
        assert fetched == list(range(first, fetched[-1] + 1))  # then every delta in order


async def test_corrupting_source_is_dropped_and_download_completes(tmp_path):
    """A relay that flips a byte in every shard: the node bans it and completes from the coordinator."""
    async with running_coordinator(tmp_path, "distribution.shard_size=16384", "run.max_steps=2") as (coord, url):
        served = {"bad": 0}

        async def proxy(request: web.Request) -> web.StreamResponse:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + request.path_qs) as r:
                    body = await r.read()
                    if "/shards/" in request.path and r.status == 200:
                        body = bytes([body[0] ^ 0xFF]) + body[1:]
                        served["bad"] += 1
                    return web.Response(body=body, status=r.status, content_type=r.content_type)

        app = web.Application()
        app.router.add_get("/{tail:.*}", proxy)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        evil = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            coord.cfg.distribution.relays.append(evil)
            node, task = start_worker(tmp_path, "w", coord, url)
            await wait_for(lambda: node.backend is not None and node.backend.policy_step >= 0, 60, "first checkpoint")
            await wait_for(lambda: node.stats.accepted > 0, 120, "accepted rollouts", coord)
            await stop_workers((node, task))
            assert served["bad"] >= 1
            assert node.fetcher.score(next(s for s in node.fetcher.sources if s.kind == "relay")).banned
            assert node.stats.rejected == 0
        finally:
            await runner.cleanup()


async def test_killed_node_work_is_reassigned_and_run_completes(tmp_path):
    async with running_coordinator(tmp_path, "run.assignment_deadline_seconds=4",
                                   "run.prompts_per_assignment=4") as (coord, url):
        victim_ids: set = set()
        for attempt in range(3):  # if SIGKILL lands after its last submission, nothing it held was lost
            victim = subprocess.Popen(
                [sys.executable, "-m", "node.cli", "join", "--coordinator", url, "--coordinator-key",
                 coord.identity.public_hex, "--config", str(REPO / "configs/local.toml"),
                 f"--set=worker.storage_dir={tmp_path / f'victim{attempt}'}"],
                cwd=REPO, stdout=open(tmp_path / f"victim{attempt}.log", "w"), stderr=subprocess.STDOUT)
            try:
                # wait until the victim holds an assignment, then SIGKILL it mid-generation
                await wait_for(lambda: bool(coord.ledger.open_assignments()), 120, "the victim's first assignment",
                               coord)
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
            finally:
                if victim.poll() is None:
                    victim.kill()
            # What it held when it died: its assignments settle as `submitted` (a submission already on the
            # wire when it died is still taken) or `expired` (the 4 s deadline); the expired ones are its lost
            # work. Read once none is open, not at the moment of the kill.
            await wait_for(lambda: not coord.ledger.open_assignments(), 60, "the dead node's assignments to settle",
                           coord)
            victim_ids = {r[0] for r in coord.ledger._exec(
                "SELECT assignment_id FROM assignments WHERE state = 'expired'").fetchall()}
            if victim_ids:
                break
        assert victim_ids, "the victim never died holding an assignment"
        victim_prompts = {p.prompt_id for aid in victim_ids for p in coord.ledger.assignment(aid).prompts}

        def redone() -> set:
            rows = coord.ledger._exec("SELECT prompt_id FROM groups").fetchall()
            return {r[0] for r in rows} & victim_prompts

        helper = start_worker(tmp_path, "helper", coord, url)
        await wait_for(lambda: redone() == victim_prompts, 120, "the killed node's prompts to be redone", coord)
        await wait_for(lambda: coord.published_step >= 3, 180, "the run to go on for 3 steps", coord)
        await stop_workers(helper)
        states = {aid: coord.ledger.assignment(aid).state for aid in victim_ids}
        assert set(states.values()) == {"expired"}, states


async def test_k0_refills_a_batch_when_filters_drop_groups(tmp_path):
    """With k = 0 only one batch is open: groups the online difficulty filter drops (all rewards equal;
    frequent with G = 2 and an untrained model) must be replaced while the batch is collected."""
    async with running_coordinator(tmp_path, "run.async_level=0", "run.group_size=2", "run.max_steps=3") as (coord, url):
        a = start_worker(tmp_path, "a", coord, url)
        await wait_for(lambda: coord.published_step >= 3, 120, "3 steps at k = 0", coord)
        await stop_workers(a)
        steps = coord.ledger.steps()[1:]
        assert sum(r.metrics["dropped_filtered"] for r in steps) > 0  # the filter did drop groups
        assert all(r.metrics["groups"] == 8 and r.metrics["max_staleness"] == 0 for r in steps)
