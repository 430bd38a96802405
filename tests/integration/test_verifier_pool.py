"""The verifier pool (#15): trusted `prime-node verifier` processes replay the chosen submissions instead
of the coordinator. A real coordinator and a real Verifier (the worker's fetcher, the transformers engine,
verify.rollouts) on 127.0.0.1; honest rollouts come from the real backend. Hostile cases: keys not in
`verification.verifier_keys`, malformed and mismatched answers, a verifier that leases a job and dies.

Both process layouts (as test_coordinator_crash.py): with `server.engine_process = true` the API process, which
imports no torch of its own, builds the pool's jobs and acts on its verdicts; the engine process publishes the
steps the verifiers fetch (served by the API process) and replays what no pool verifier could do
(test_attack_verifier_dodge.py). The engine runs at nice 0: niced beside the other tests on 2 cores, its
start-up was starved in CI (test_coordinator_crash.py)."""
import asyncio
from contextlib import asynccontextmanager

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, running_coordinator
from tests.integration.test_intake_attacks import backend_at, honest_rollouts, train_to_step_1, wait_verdicts

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"one-process": ("server.engine_process=false",), "engine-process": ("server.engine_process=true", "server.engine_nice=0")}
layouts = pytest.mark.parametrize("layout", list(LAYOUTS))


def check_layout(coord, layout: str) -> None:
    """The engine layout holds no policy model in this (the API) process: nothing here can replay."""
    assert (coord.engine is not None and coord.policies is None) == (layout == "engine-process")


@asynccontextmanager
async def verifier_process(base: str, tmp, identity):
    from node.verifier import Verifier

    v = Verifier(base, identity, tmp / f"verifier-{identity.node_id[:8]}")
    task = asyncio.create_task(v.run())
    try:
        yield v
    finally:
        v.stop()
        await asyncio.wait_for(task, 30)


def pool_keys(*keys: str) -> str:
    return "verification.verifier_keys=[" + ",".join(f'"{k}"' for k in keys) + "]"


@layouts
async def test_the_pool_verifies_honest_work_and_catches_a_forger(tmp_path, layout):
    from protocol.identity import Identity

    ident = Identity.generate()
    async with running_coordinator(tmp_path, *LAYOUTS[layout], pool_keys(ident.public_hex)) as (coord, base):
        check_layout(coord, layout)
        async with aiohttp.ClientSession() as s, verifier_process(base, tmp_path, ident) as v:
            honest, cheat = RawNode(base, s), RawNode(base, s)
            await honest.post("/v1/join", {})
            await cheat.post("/v1/join", {})
            await train_to_step_1(coord, honest)  # step 1 is trained only after the pool's verdicts on batch 0
            # the cheater generates with θ_0 but claims θ_1: the pool's replay against θ_1 catches it
            st, w = await cheat.post("/v1/work", {"policy_step": 1})
            assert st == 200
            st, res = await cheat.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 1,
                                                      "rollouts": honest_rollouts(backend_at(coord, 0), w,
                                                                                  coord.eos_token_id)})
            assert st == 200 and res["rejected"] == []
            await wait_verdicts(coord)
            assert coord.ledger.node(cheat.pub).banned
            assert {g.verdict for g in coord.ledger.submission_groups(w["assignment_id"])} == {"void"}
            counts = coord.ledger.verdict_counts()
            assert counts.get("verified", 0) >= coord.cfg.run.batch_prompts and "undecided" not in counts
            assert "unchecked" not in counts  # every submission was replayed (fraction 1), none passed over
            assert v.jobs_done >= 2 and v.rollouts_judged >= coord.cfg.run.batch_prompts * coord.cfg.run.group_size
            pool = coord.status()["verification"]["pool"]
            assert pool["verifiers"] == 1 and pool["active"] == 1
            assert pool["replayed_in_process"] == 0  # the pool did every replay


# The job board's answers to strangers, bad answers and a dying verifier are the API process's alone: one layout
# (the engine layout's pool path is in the test above and in test_attack_verifier_dodge.py; make test's 15 minutes)
@pytest.mark.parametrize("layout", ["one-process"])
async def test_strangers_bad_answers_and_a_verifier_that_dies(tmp_path, layout):
    from protocol.identity import Identity

    async with aiohttp.ClientSession() as s:
        dying = RawNode("", s)  # a listed verifier that leases a job and never answers
        real = Identity.generate()
        async with running_coordinator(tmp_path, *LAYOUTS[layout], pool_keys(dying.pub, real.public_hex),
                                       "verification.job_lease_seconds=1") as (coord, base):
            check_layout(coord, layout)
            dying.base = base
            stranger, node = RawNode(base, s), RawNode(base, s)
            for path, body in (("/v1/verify/jobs", {}), ("/v1/verify/verdicts", {"job_id": "x", "unavailable": True})):
                st, err = await stranger.post(path, body)
                assert st == 403 and err["error"] == "not_a_verifier", (path, st, err)
            st, spec = await dying.post("/v1/verify/jobs", {"spec": True})
            assert st == 200 and spec["spec"]["coordinator_key"] == coord.identity.public_hex and spec["job"] is None
            st, _ = await dying.post("/v1/verify/jobs", {})
            assert st == 204  # nothing submitted yet
            for bad in ({"job_id": "x"}, {"job_id": "x", "unavailable": True, "verdicts": [
                         {"reason": None, "tokens": 1, "near_ties": 0}]},
                        {"job_id": "x", "verdicts": [{"reason": "rm -rf", "tokens": 1, "near_ties": 0}]},
                        {"job_id": "x", "verdicts": [{"reason": None, "tokens": -1, "near_ties": 0}]},
                        {"job_id": "x", "unavailable": True, "extra": 1}):
                st, err = await dying.post("/v1/verify/verdicts", bad)
                assert st == 400, (bad, st, err)
            st, err = await dying.post("/v1/verify/verdicts", {"job_id": "x", "unavailable": True})
            assert st == 404 and err["error"] == "unknown_job"

            # an honest submission becomes a job; the dying verifier leases it and answers wrongly, then dies
            await node.post("/v1/join", {})
            _, w = await node.post("/v1/work", {"policy_step": 0})
            rollouts = honest_rollouts(backend_at(coord, 0), w, coord.eos_token_id)
            st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 0,
                                                     "rollouts": rollouts})
            assert st == 200 and not res["rejected"]
            job = None
            for _ in range(600):  # the job appears within milliseconds; 30 s on a very busy machine
                st, body = await dying.post("/v1/verify/jobs", {})
                if st == 200:
                    job = body["job"]
                    break
                await asyncio.sleep(0.05)
            assert job is not None and len(job["items"]) == len(rollouts) and job["policy_step"] == 0
            st, err = await dying.post("/v1/verify/verdicts", {"job_id": job["job_id"], "verdicts": [
                {"reason": None, "tokens": 1, "near_ties": 0}]})
            assert st == 400 and err["error"] == "wrong_verdict_count"
            await asyncio.sleep(1.2)  # the lease runs out: the job goes to the next verifier that asks
            async with verifier_process(base, tmp_path, real) as v:
                await wait_verdicts(coord)
                assert v.jobs_done == 1
            assert {g.verdict for g in coord.ledger.submission_groups(w["assignment_id"])} == {"verified"}
            # the dead verifier's late answer is refused: its lease went to another
            st, err = await dying.post("/v1/verify/verdicts", {"job_id": job["job_id"], "verdicts": [
                {"reason": None, "tokens": 1, "near_ties": 0}] * len(rollouts)})
            assert st == 404 and err["error"] == "unknown_job"  # decided by the other verifier and closed
            assert coord.metrics.verify_jobs_rehanded._value.get() == 1
