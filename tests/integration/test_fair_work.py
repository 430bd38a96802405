"""Work is shared fairly with untrusted nodes: a cap on assignments in flight per node, expiry costs
reputation, a node cannot claim to go back in time, and prompts to hand out again survive a restart."""
from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(120)


async def test_hoarding_is_capped_per_node(tmp_path):
    """Three keys used to hold 79 assignments between them; now each holds at most 2 at once."""
    async with running_coordinator(tmp_path, "verification.fraction=0", "run.prompts_per_assignment=1") as (coord, base):
        async with aiohttp.ClientSession() as s:
            hoarders = [RawNode(base, s) for _ in range(3)]
            for h in hoarders:
                await h.post("/v1/join", {})
            got = {h.pub: [] for h in hoarders}
            for _ in range(10):
                for h in hoarders:
                    st, body = await h.post("/v1/work", {"policy_step": 0})
                    if st == 200:
                        got[h.pub].append(body)
                    else:
                        assert (st, body["error"]) == (429, "too_many_assignments"), (st, body)
            assert all(len(v) == 2 for v in got.values()), {k[:8]: len(v) for k, v in got.items()}
            # an honest node still gets work, and a hoarder gets more once it submits one
            honest = RawNode(base, s)
            await honest.post("/v1/join", {})
            st, _ = await honest.post("/v1/work", {"policy_step": 0})
            assert st == 200
            h = hoarders[0]
            w = got[h.pub][0]
            st, _ = await h.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 0,
                                                "rollouts": fake_rollouts(w, coord.eos_token_id, coord.vocab_size,
                                                                          random.Random(0))})
            assert st == 200
            st, _ = await h.post("/v1/work", {"policy_step": 0})
            assert st == 200


async def test_expiry_costs_reputation_until_a_ban(tmp_path):
    async with running_coordinator(tmp_path, "run.assignment_deadline_seconds=0.2", "verification.expiry_penalty=0.4",
                                   "verification.fraction=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            await node.post("/v1/join", {})
            statuses = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20:
                st, body = await node.post("/v1/work", {"policy_step": 0})
                statuses.append(st)
                if st == 403:
                    assert body["error"] == "banned"
                    break
                await asyncio.sleep(0.3)  # never submit: every assignment expires
            assert statuses[-1] == 403, statuses
            assert coord.ledger.node(node.pub).reputation < 0


async def test_a_node_cannot_claim_an_older_step_than_it_reported(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            await node.post("/v1/join", {})
            rng = random.Random(0)
            while coord.published_step < 1:
                st, w = await node.post("/v1/work", {"policy_step": 0})
                if st in (204, 429):
                    await asyncio.sleep(0.05)
                    continue
                await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 0,
                                               "rollouts": fake_rollouts(w, coord.eos_token_id, coord.vocab_size, rng)})
            st, _ = await node.post("/v1/heartbeat", {"policy_step": 1})
            assert st == 200
            st, body = await node.post("/v1/work", {"policy_step": 0})
            assert (st, body["error"]) == (409, "policy_went_back") and "older than step 1" in body["detail"]
            st, body = await node.post("/v1/work", {"policy_step": 5})
            assert (st, body["error"]) == (409, "unpublished_policy")  # not published: a node cannot hold it


async def test_prompts_to_hand_out_again_survive_a_restart(tmp_path):
    """The re-issue queue of expired prompts used to live only in memory."""
    from node.coordinator.app import start_server
    from node.coordinator.service import Coordinator
    from protocol.identity import Identity
    from tests.integration.coordinator_harness import test_config

    ident = Identity.generate()
    cfg = test_config(tmp_path, "run.assignment_deadline_seconds=0.2", "verification.fraction=0")
    coord = Coordinator(cfg, ident)
    runner, port = await start_server(coord, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            node = RawNode(f"http://127.0.0.1:{port}", s)
            await node.post("/v1/join", {})
            st, w = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200
            expired = {p["prompt_id"]: p["seeds"] for p in w["prompts"]}
            t0 = time.monotonic()
            while len(coord.ledger.requeued()) < len(expired):
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
        await coord.stop()
    coord = Coordinator(test_config(tmp_path, "verification.fraction=0"), ident)
    runner, port = await start_server(coord, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            node.session, node.base = s, f"http://127.0.0.1:{port}"
            st, w = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200
            # the same prompts, with the same seeds, come first after the restart
            assert {p["prompt_id"]: p["seeds"] for p in w["prompts"]} == expired
            assert coord.ledger.requeued() == []
    finally:
        await runner.cleanup()
        await coord.stop()
