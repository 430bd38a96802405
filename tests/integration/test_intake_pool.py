"""The intake in processes of its own (node/coordinator/intake_pool.py, `server.intake_processes`, on by default
with the engine process): a submission assessed there is refused and stored exactly as the API process would
have done it, and a worker that dies loses no submission (the one in flight is assessed in the API process, the
next starts new workers). A real coordinator on loopback in the engine layout, real spawned workers, SIGKILL."""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import aiohttp
import pytest

from node.lifecycle import descendant_pids
from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(240)


def intake_workers() -> list[int]:
    """This process's intake workers (multiprocessing's spawned children, not the engine or anything else)."""
    pids = []
    for pid in descendant_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmd or b"spawn_main" in cmd:
            pids.append(pid)
    return pids


def stored(db: Path, assignment_id: str) -> list[tuple[str, str, float]]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT prompt_id, data, reward_mean FROM groups WHERE assignment_id=? ORDER BY group_id",
                           (assignment_id,)).fetchall()
    finally:
        con.close()


async def test_pool_assesses_as_the_api_process_and_a_killed_worker_loses_nothing(tmp_path):
    from protocol import messages as M

    rng = random.Random(3)
    async with running_coordinator(tmp_path, "server.engine_process=true", "server.intake_processes=1",
                                   "verification.fraction=0", "run.prompts_per_assignment=2") as (coord, base):
        assert coord.intake_pool is not None
        vocab = coord.vocab_size
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            assert (await node.post("/v1/join", {}))[0] == 200

            async def submit(hostile: bool = False) -> tuple[str, dict, dict]:
                st, work = await node.post("/v1/work", {"policy_step": 0})
                assert st == 200, work
                rollouts = fake_rollouts(work, coord.eos_token_id, vocab, rng)
                if hostile:  # one sample out of the vocabulary: its group is refused, the other kept
                    rollouts[0]["completion_ids"][0] = vocab + 7
                    rollouts.append(dict(rollouts[1]))  # and a duplicate
                payload = {"assignment_id": work["assignment_id"], "policy_step": 0, "rollouts": rollouts}
                st, res = await node.post("/v1/submit", payload)
                assert st == 200, res
                return work["assignment_id"], payload, res

            # 1. Assessed in the worker: the answer and the stored groups are what this process's Assessor gives.
            aid, payload, res = await submit(hostile=True)
            workers = intake_workers()
            assert len(workers) == 1, workers
            a = coord.ledger.assignment(aid)
            here = coord.intake.assessor.assess(a.prompts, a.batch_step, M.SubmitRequest.model_validate(payload))
            assert sorted((r["prompt_id"], r["sample_index"], r["reason"]) for r in res["rejected"]) == \
                sorted((r.prompt_id, r.sample_index, r.reason) for r in here.rejections)
            assert {r["reason"] for r in res["rejected"]} >= {"token_out_of_vocab", "duplicate_rollout"}
            assert [(g.prompt_id, g.data, g.reward_mean) for g in here.groups] == stored(coord.root / "ledger.sqlite", aid)
            assert len(res["accepted"]) == sum(len(g.sample_indexes) for g in here.groups) > 0

            # 2. The worker is killed: the next submissions are all accepted and stored; new workers start.
            os.kill(workers[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while workers[0] in intake_workers():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            for _ in range(2):
                aid, payload, res = await submit()
                assert not res["rejected"] and len(res["accepted"]) == len(payload["rollouts"])
                assert len(stored(coord.root / "ledger.sqlite", aid)) == 2
            assert coord.intake_pool.restarts == 1
            again = intake_workers()
            assert len(again) == 1 and again != workers
    assert intake_workers() == []  # the coordinator's stop ended them
