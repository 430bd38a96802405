"""Dodging the verifier pool (#25, finding 2): a submission must never go to training unreplayed because
of which step, size or timing its node chose.

Before: a pool verifier answering `unavailable` (a step its fetcher skipped on the way to the newest full
checkpoint, or one that did not arrive within 30 s) made the coordinator mark the submission `unchecked`
and train it, even at `new_node_fraction = 1`. A forger who claims such a step was never checked.
Now a refused job goes to another verifier, then to the coordinator's own replay; pool verifiers hold
every step of the window. A real coordinator, real `Verifier`s (the worker's fetcher, transformers,
verify.rollouts) and raw signed clients as verifiers that refuse, all on 127.0.0.1. Both process layouts: with
`server.engine_process = true` "in-process" is the engine process (the API process holds no model)."""
import asyncio
import random
import time
from typing import Any

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator
from tests.integration.test_intake_attacks import backend_at, honest_rollouts, wait_verdicts
from tests.integration.test_verifier_pool import LAYOUTS, check_layout, layouts, pool_keys, verifier_process

pytestmark = pytest.mark.timeout(300)  # a safety net: every loop below is bounded by work done or a deadline


async def past_204(node: RawNode, path: str, payload: dict, timeout: float, every: float) -> tuple[int, Any]:
    """POST `payload` to `path` again while the answer is 204 ("nothing right now"), as a node does, for up to
    `timeout` s; the first other answer, or the last 204."""
    t0 = time.monotonic()
    while True:
        st, body = await node.post(path, payload)
        if st != 204 or time.monotonic() - t0 > timeout:
            return st, body
        await asyncio.sleep(every)


async def lease(verifier: RawNode, timeout: float = 30.0) -> dict:
    """The next job the coordinator hands this (raw) verifier; jobs appear within milliseconds of a submit."""
    st, body = await past_204(verifier, "/v1/verify/jobs", {}, timeout, 0.05)
    assert st in (200, 204), (st, body)
    if st == 204:
        raise AssertionError("no job was handed out")
    return body["job"]


async def submit(node: RawNode, step: int, rollouts_for, coord=None) -> str:
    """Take work at `step` and answer it with `rollouts_for(assignment)`; the assignment id. A 204 ("no work right
    now") is asked again, as a node does, for up to 15 s: in one CI run (engine-process layout) the first ask at
    step 0 right after step 2 was published got a 204."""
    st, w = await past_204(node, "/v1/work", {"policy_step": step}, 15, 0.1)
    assert st == 200, (st, w, None if coord is None else
                       (coord.published_step, coord.scheduler.published_step, coord.scheduler.demand()))
    st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": step,
                                             "rollouts": rollouts_for(w)})
    assert st == 200 and not res["rejected"], res  # acknowledged like honest work: the replay comes later
    return w["assignment_id"]


def verdicts(coord, assignment_id: str) -> set:
    return {g.verdict for g in coord.ledger.submission_groups(assignment_id)}


async def train_to(coord, honest: RawNode, target: int) -> None:
    """Honest work at the newest step until `target` is published (the pool's verdicts let each batch train)."""
    backends: dict[int, object] = {}
    t0 = time.monotonic()
    while coord.published_step < target:
        assert time.monotonic() - t0 < 180, f"step {target} was not published"
        if not any(n for b, n in coord.scheduler.demand().items() if b <= target):
            await asyncio.sleep(0.05)  # batches up to `target` are full: no work past them (the window stays put)
            continue
        step = coord.published_step
        st, w = await honest.post("/v1/work", {"policy_step": step})
        if st in (204, 429):
            await asyncio.sleep(0.1)
            continue
        assert st == 200, (st, w)
        if step not in backends:  # built once per step: transformers' loading is not thread-safe with the
            backends[step] = backend_at(coord, step)  # verifier's own model loading in this process
        b = backends[step]
        st, res = await honest.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": step,
                                                   "rollouts": honest_rollouts(b, w, coord.eos_token_id)})
        assert st == 200 and not res["rejected"], res["rejected"]


@layouts
async def test_forger_claiming_a_step_the_verifier_skipped_is_replayed_and_banned(tmp_path, layout):
    """Step 0 and 2 are full, step 1 a delta: a verifier that starts at step 2 used to fetch step 2 alone and
    answer `unavailable` for step 1, which is still inside the window. A forger claiming step 1 (and one
    claiming each other step of the window) is now replayed by that verifier and banned."""
    from protocol.identity import Identity

    first, late = Identity.generate(), Identity.generate()
    # run.max_steps = 2 keeps the window put: groups accepted past batch 2's need carry into batch 3, and a CI run
    # trained step 3 with them while the late verifier started, which made step 0 stale (409) for its forger
    async with running_coordinator(tmp_path, *LAYOUTS[layout], pool_keys(first.public_hex, late.public_hex),
                                   "distribution.full_every=2", "run.max_steps=2") as (coord, base):
        check_layout(coord, layout)
        async with aiohttp.ClientSession() as s:
            honest = RawNode(base, s)
            forgers = {step: RawNode(base, s) for step in (0, 1, 2)}
            for n in (honest, *forgers.values()):
                await n.post("/v1/join", {})
            async with verifier_process(base, tmp_path, first):
                await train_to(coord, honest, 2)
                await wait_verdicts(coord)
            assert coord.ledger.latest_step().encoding == "full"
            # the late verifier starts at the newest full step; step 1 (delta) is in the window (k = 2)
            async with verifier_process(base, tmp_path, late) as v:
                θ0 = backend_at(coord, 0)
                ids = {}
                for step, forger in forgers.items():  # θ_0's rollouts claimed as step 1 and 2; random ones as 0
                    forge = (lambda w: fake_rollouts(w, coord.eos_token_id, coord.vocab_size, random.Random(7))) \
                        if step == 0 else (lambda w: honest_rollouts(θ0, w, coord.eos_token_id))
                    ids[step] = await submit(forger, step, forge, coord)
                await wait_verdicts(coord, timeout=120)
                for step, forger in forgers.items():
                    assert verdicts(coord, ids[step]) == {"void"}, (step, verdicts(coord, ids[step]))
                    assert coord.ledger.node(forger.pub).banned, step
                assert v.jobs_done >= 3  # the late verifier replayed them itself: it holds every step of the window
                assert {0, 1, 2} <= set(v.payloads)
            assert "unchecked" not in coord.ledger.verdict_counts()


@layouts
async def test_a_job_refused_as_unavailable_goes_to_another_verifier_then_in_process(tmp_path, layout):
    """Two listed verifiers each answer `unavailable`: the job is never handed back to one that refused it,
    goes to the other, and then the coordinator replays it itself: the forgery is void, never trained."""
    async with aiohttp.ClientSession() as s:
        r1, r2 = RawNode("", s), RawNode("", s)
        async with running_coordinator(tmp_path, *LAYOUTS[layout], pool_keys(r1.pub, r2.pub)) as (coord, base):
            check_layout(coord, layout)
            r1.base = r2.base = base
            for r in (r1, r2):  # both ask for work: both are active members of the pool
                st, _ = await r.post("/v1/verify/jobs", {})
                assert st == 204
            forger = RawNode(base, s)
            await forger.post("/v1/join", {})
            aid = await submit(forger, 0, lambda w: fake_rollouts(w, coord.eos_token_id, coord.vocab_size,
                                                                   random.Random(3)))
            job = await lease(r1)
            st, _ = await r1.post("/v1/verify/verdicts", {"job_id": job["job_id"], "unavailable": True})
            assert st == 200
            assert verdicts(coord, aid) == {None}  # still undecided: not passed over to training
            st, _ = await r1.post("/v1/verify/jobs", {})
            assert st == 204  # not handed back to the verifier that could not do it
            again = await lease(r2)
            assert again["job_id"] == job["job_id"]
            st, _ = await r2.post("/v1/verify/verdicts", {"job_id": job["job_id"], "unavailable": True})
            assert st == 200
            await wait_verdicts(coord)
            assert verdicts(coord, aid) == {"void"} and coord.ledger.node(forger.pub).banned
            assert "unchecked" not in coord.ledger.verdict_counts()
            pool = coord.status()["verification"]["pool"]
            assert pool["unavailable"] == {r1.pub[:16]: 1, r2.pub[:16]: 1}
            assert pool["replayed_in_process"] == 1


@layouts
async def test_a_verifier_unavailable_for_everything_makes_nothing_skip_verification(tmp_path, layout):
    """The pool's one verifier answers `unavailable` to every job: every submission, honest or forged, is
    replayed in-process instead; none is passed over, the forger is banned and the verifier is noted."""
    async with aiohttp.ClientSession() as s:
        refuser = RawNode("", s)
        async with running_coordinator(tmp_path, *LAYOUTS[layout], pool_keys(refuser.pub)) as (coord, base):
            check_layout(coord, layout)
            refuser.base = base
            stop = asyncio.Event()

            async def refuse_everything() -> int:
                n = 0
                while not stop.is_set():
                    st, body = await refuser.post("/v1/verify/jobs", {})
                    if st == 204:
                        await asyncio.sleep(0.02)
                        continue
                    assert st == 200, (st, body)
                    st, _ = await refuser.post("/v1/verify/verdicts", {"job_id": body["job"]["job_id"],
                                                                       "unavailable": True})
                    assert st == 200
                    n += 1
                return n

            refusing = asyncio.create_task(refuse_everything())
            honest, forger = RawNode(base, s), RawNode(base, s)
            await honest.post("/v1/join", {})
            await forger.post("/v1/join", {})
            θ0 = backend_at(coord, 0)
            good = [await submit(honest, 0, lambda w: honest_rollouts(θ0, w, coord.eos_token_id)) for _ in range(2)]
            bad = await submit(forger, 0, lambda w: fake_rollouts(w, coord.eos_token_id, coord.vocab_size,
                                                                   random.Random(5)))
            await wait_verdicts(coord)
            stop.set()
            refused = await asyncio.wait_for(refusing, 10)
            assert refused == 3
            assert all(verdicts(coord, a) == {"verified"} for a in good)
            assert verdicts(coord, bad) == {"void"} and coord.ledger.node(forger.pub).banned
            assert "unchecked" not in coord.ledger.verdict_counts()
            pool = coord.status()["verification"]["pool"]
            assert pool["unavailable"] == {refuser.pub[:16]: 3} and pool["replayed_in_process"] == 3
