"""`server.engine_process = true` (node/coordinator/engine.py): a real CLI coordinator whose training,
publishing and replays run in its engine process.

- The run trains with the trainer in the engine process (libtorch mapped there), and status and /metrics show
  the engine's steps and batch health.
- SIGKILL of the engine: the API process marks the coordinator failed (503 to nodes, the reason on status and
  /metrics) and exits 1; restarted, the run resumes with nothing acknowledged lost (the ledger checks of
  test_coordinator_crash.py).
- A forged submission is replayed by the engine and its node banned, as in one process.
SIGKILL of the API process, and of the engine mid-publish: test_coordinator_crash.py (both layouts)."""
import asyncio
import os
import random
import signal
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts
from tests.integration.test_coordinator_crash import ENGINE, assert_durable, drive, engine_pids, ledger_rows, start

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def mapped_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


async def poll(fn, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        got = await fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        await asyncio.sleep(0.1)


async def test_api_process_trains_without_torch_and_fails_loudly_when_its_engine_dies(tmp_path):
    rng = random.Random(2)
    acked: list = []
    storage = tmp_path / "coord"
    proc, url = start(tmp_path, None, ENGINE, "--set=server.exit_on_failure=false")
    try:
        async with aiohttp.ClientSession() as s:
            node = RawNode(url, s)
            st, spec = await node.post("/v1/join", {})
            assert st == 200
            vocab, eos = spec["model_config_json"]["vocab_size"], spec["eos_token_id"]
            assert await drive(node, lambda: ledger_rows(tmp_path)[1][-1] >= 2, vocab, eos, rng, acked) == "done"
            async def trained():  # the engine's Published messages and snapshots reach the status (cached 1 s)
                async with s.get(url + "/v1/status") as r:
                    st = await r.json()
                return st if st["step"] >= 2 and st["trainer"]["busy_seconds"] > 0 else None
            status = await poll(trained, 30, "step 2 on the status")
            assert status["failed"] is None
            async def usable_counted():  # batch health's series, from the engine's snapshots
                async with s.get(url + "/metrics") as r:
                    return [float(ln.split()[-1]) for ln in (await r.text()).splitlines()
                            if ln.startswith("prime_groups_usable_total ") and float(ln.split()[-1]) >= 8]
            await poll(usable_counted, 30, "the groups of 2 steps counted in /metrics")
            [engine] = engine_pids(storage)
            assert mapped_libtorch(engine)  # the trainer's torch is in the engine process
            # and none in the API process, after its run was loaded, served and trained: its tokenizer is loaded
            # without transformers (node/trainer/light_tokenizer.py)
            assert not mapped_libtorch(proc.pid)

            os.kill(engine, signal.SIGKILL)

            async def failed():
                async with s.get(url + "/v1/status") as r:
                    return (await r.json())["failed"]
            failure = await poll(failed, 30, "the coordinator marked failed after its engine was killed")
            assert failure["component"] == "engine" and "exit code -9" in failure["reason"], failure
            st, body = await node.post("/v1/work", {"policy_step": status["step"]})
            assert st == 503 and body["error"] == "coordinator_failed", (st, body)
            async with s.get(url + "/metrics") as r:
                assert 'prime_coordinator_failed{component="engine"} 1.0' in await r.text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1  # a failed coordinator exits non-zero
        steps_before = ledger_rows(tmp_path)[1]

        proc, url = start(tmp_path, None, ENGINE)
        async with aiohttp.ClientSession() as s:
            node.session, node.base = s, url  # same key, no re-join
            target = steps_before[-1] + 1
            assert await drive(node, lambda: ledger_rows(tmp_path)[1][-1] >= target, vocab, eos, rng, acked,
                               max_seconds=90) == "done"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not engine_pids(storage)
    assert assert_durable(tmp_path, acked) >= target


async def test_a_forgery_is_replayed_by_the_engine_and_its_node_banned(tmp_path):
    proc, url = start(tmp_path, None, ENGINE, "--set=verification.fraction=1")
    try:
        async with aiohttp.ClientSession() as s:
            node = RawNode(url, s)
            st, spec = await node.post("/v1/join", {})
            assert st == 200
            vocab, eos = spec["model_config_json"]["vocab_size"], spec["eos_token_id"]
            st, w = await node.post("/v1/work", {"policy_step": spec["current_step"]})
            assert st == 200, (st, w)
            st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"],
                                                     "policy_step": spec["current_step"],
                                                     "rollouts": fake_rollouts(w, eos, vocab, random.Random(3))})
            assert st == 200 and res["accepted"], (st, res)  # recorded; the replay comes after the answer

            async def banned():
                st, body = await node.post("/v1/heartbeat", {"policy_step": spec["current_step"]})
                return st == 403 and body["error"] == "banned"
            await poll(banned, 60, "the forger banned after the engine's replay")
            async with s.get(url + "/v1/status") as r:
                v = (await r.json())["verification"]
            assert any(reason.startswith("verify_") for reason in v["rejected_by_reason"]), v
            assert v["groups_by_verdict"].get("void", 0) == len(w["prompts"]), v
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not engine_pids(tmp_path / "coord")


async def test_a_verifier_pool_works_with_the_engine_and_no_torch_in_the_api_process(tmp_path):
    """server.engine_process with a verifier pool (refused at config time before): a real CLI coordinator and a
    raw listed verifier. A forgery the verifier judges bans its node (the API process built the job and acted on
    the verdicts); a forgery it answers `unavailable` to is replayed by the engine and its node banned too, never
    trained unreplayed. The API process maps no libtorch after both; the engine does."""
    from tests.integration.test_attack_verifier_dodge import lease
    from tests.integration.test_verifier_pool import pool_keys

    verifier = RawNode("", None)
    proc, url = start(tmp_path, None, ENGINE, "--set=verification.fraction=1", f"--set={pool_keys(verifier.pub)}")
    try:
        async with aiohttp.ClientSession() as s:
            verifier.base, verifier.session = url, s
            judged, refused = RawNode(url, s), RawNode(url, s)
            st, spec = await judged.post("/v1/join", {})
            assert st == 200
            await refused.post("/v1/join", {})
            vocab, eos, step = spec["model_config_json"]["vocab_size"], spec["eos_token_id"], spec["current_step"]
            st, _ = await verifier.post("/v1/verify/jobs", {})
            assert st == 204  # nothing submitted yet; the verifier is an active member of the pool now

            async def forge(node: RawNode, seed: int) -> int:
                st, w = await node.post("/v1/work", {"policy_step": step})
                assert st == 200, (st, w)
                rollouts = fake_rollouts(w, eos, vocab, random.Random(seed))
                st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": step,
                                                         "rollouts": rollouts})
                assert st == 200 and res["accepted"], (st, res)
                return len(rollouts)

            async def banned(node: RawNode):
                st, body = await node.post("/v1/heartbeat", {"policy_step": step})
                return st == 403 and body["error"] == "banned"

            n = await forge(judged, 3)
            job = await lease(verifier)
            assert job["policy_step"] == step and len(job["items"]) == n  # built in the API process
            st, _ = await verifier.post("/v1/verify/verdicts", {"job_id": job["job_id"], "verdicts": [
                {"reason": "verify_commitment", "tokens": 8, "near_ties": 0}] * n})
            assert st == 200
            await poll(lambda: banned(judged), 30, "the node banned on the pool's verdicts")

            await forge(refused, 4)
            job = await lease(verifier)
            st, _ = await verifier.post("/v1/verify/verdicts", {"job_id": job["job_id"], "unavailable": True})
            assert st == 200  # no other verifier: the engine replays it
            await poll(lambda: banned(refused), 60, "the node banned after the engine's replay")

            async with s.get(url + "/v1/status") as r:
                v = (await r.json())["verification"]
            assert v["pool"]["unavailable"] == {verifier.pub[:16]: 1} and v["pool"]["replayed_in_process"] == 1, v
            assert "unchecked" not in v["groups_by_verdict"], v
            [engine] = engine_pids(tmp_path / "coord")
            assert mapped_libtorch(engine) and not mapped_libtorch(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not engine_pids(tmp_path / "coord")


async def test_a_training_thread_dying_in_the_engine_fails_the_coordinator_as_in_one_process(tmp_path):
    """test_supervisor.py's "train-step" fault, raised in the engine's training thread: the API process shows
    the same component and reason, answers 503, and exits 1 when stopped."""
    from tests.integration.test_supervisor import check_failed_coordinator, start_coordinator, stop, wait_ready

    proc, log = start_coordinator(tmp_path, "train-step", "server.exit_on_failure=false", "server.engine_process=true")
    try:
        base = await wait_ready(proc, tmp_path, log)
        await check_failed_coordinator(base, "trainer", "InjectedFault")
        assert proc.poll() is None, "exit_on_failure = false: the coordinator stays up"
    finally:
        rc = stop(proc)
    assert rc == 1, log.read_text()[-3000:]
    assert "coordinator failed: trainer died" in log.read_text()
    assert not engine_pids(tmp_path / "coord")


@pytest.mark.timeout(420)
async def test_an_honest_worker_trains_with_every_submission_replayed_by_the_engine(tmp_path):
    """A real worker (transformers backend) against a coordinator whose engine replays every submission
    (fraction 1): its rollouts pass the replay done in the engine process, and the run trains."""
    from tests.integration.coordinator_harness import running_coordinator
    from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

    async with running_coordinator(tmp_path, "server.engine_process=true", "verification.fraction=1.0",
                                   "run.max_steps=2", "run.batch_prompts=4", "run.group_size=4") as (coord, url):
        assert coord.engine is not None and coord.policies is None  # nothing of the policies in this process
        worker = start_worker(tmp_path, "a", coord, url)
        await wait_for(lambda: coord.published_step >= 2, 300, "2 training steps", coord)
        await wait_for(lambda: coord.status()["verification"]["groups_by_verdict"].get("verified", 0) > 0, 60,
                       "a verified submission", coord)
        await stop_workers(worker)
        status = coord.status()
        assert status["verification"]["rejected"] == 0, status["verification"]
        assert worker[0].stats.accepted > 0 and worker[0].stats.rejected == 0
        assert status["trainer"]["last_metrics"].get("groups", 0) > 0  # the engine's snapshot reached the status


def thread_nices(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (field 19 of /proc/PID/task/TID/stat; Linux keeps it per thread)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError):
            pass  # a thread that ended meanwhile
    return out


async def test_the_engine_restores_at_the_api_priority_then_every_thread_is_niced(tmp_path):
    """server.engine_nice applies from Ready on (node/coordinator/engine.py): the restore, θ_0 and the warm start
    run at the API's priority (niced from its start, an engine's start-up was starved past 120 s in CI), then every
    thread of the engine is niced, torch's worker threads, started during the restore, too."""
    from tests.integration.coordinator_harness import running_coordinator

    async with running_coordinator(tmp_path, "server.engine_process=true") as (coord, _):
        assert coord.engine is not None and coord.engine.pid is not None
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert thread_nices(coord.engine.pid) == {min(19, ours + coord.cfg.server.engine_nice)}
