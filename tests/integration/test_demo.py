"""`prime-node demo` end to end: separate processes on loopback, summary JSON with the contract keys."""
import json
import subprocess
import sys

import pytest

from tests.integration.coordinator_harness import REPO

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

KEYS = {"steps_completed", "async_level", "max_staleness_seen", "accepted_rollouts", "rejected_rollouts",
        "reward_by_step", "wall_seconds", "trainer_idle_fraction", "checkpoint_bytes_by_source"}


def run_demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`prime-node demo ARGS --summary FILE` in tmp_path; its output and summary (asserts it exited 0)."""
    summary = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "node.cli", "demo", *args, "--summary", str(summary)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=380, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(summary.read_text())


def test_demo_runs_and_writes_summary(tmp_path):
    r, s = run_demo(tmp_path, "--nodes", "2", "--steps", "6")
    assert "prime-node demo: done" in r.stdout and "dashboard: http://127.0.0.1:" in r.stdout
    assert KEYS <= set(s)
    assert s["steps_completed"] == 6 and s["async_level"] == 2
    assert 0 <= s["max_staleness_seen"] <= 2
    assert s["accepted_rollouts"] > 0 and s["rejected_rollouts"] == 0
    assert sorted(int(k) for k in s["reward_by_step"]) == list(range(1, 7))
    assert s["checkpoint_bytes_by_source"]["coordinator"] > 0
    assert (tmp_path / "demo-out" / "reward_curve.png").is_file()
    # evaluation during training (configs/local.toml: every 5 steps and θ_0, 64 held-out prompts), and of the
    # last step's policy, which the demo waits for (the curve ends with the policy the run ends with). That
    # the default 60-step demo lifts it is measured in docs/BENCHMARKS.md ("Learning"); 6 steps are too
    # few to assert a rise reliably.
    assert sorted(int(k) for k in s["eval_by_step"]) == [0, 5, 6]
    assert s["eval_prompts"] == 64 and all(0.0 <= v <= 1.0 for v in s["eval_by_step"].values())
    assert s["reward_last5_mean"] is not None and 0.0 <= s["reward_last5_mean"] <= 1.0
    assert "held-out eval" in r.stdout


def test_demo_with_lora(tmp_path):
    """`prime-node demo --set trainer.lora.rank=8` (issue #29): step 0 is published full, every later step as a signed
    `lora-adapter` checkpoint that the workers merge into step 0; every rollout is replayed against that merge and
    accepted. That it learns like full fine-tuning is measured in docs/BENCHMARKS.md ("LoRA against full fine-tuning")."""
    from node.checkpoint_dir import CheckpointDir

    _, s = run_demo(tmp_path, "--nodes", "1", "--steps", "3", "--set", "trainer.lora.rank=8", "--set", "eval.every_steps=0")
    assert s["steps_completed"] == 3 and s["accepted_rollouts"] > 0 and s["rejected_rollouts"] == 0
    store = CheckpointDir(tmp_path / "demo-out" / "coordinator")
    held = store.held_steps()  # step 0 stays while an adapter in the window needs it; older adapters may be pruned
    encodings = {step: store.manifest(step).encoding for step in held}
    assert encodings.get(0) == "full" and 3 in held, encodings
    assert all(encodings[n] == "lora-adapter" and store.manifest(n).lora.rank == 8 for n in held if n), encodings


def test_demo_of_the_multi_turn_task_with_a_verifier_pool(tmp_path):
    """`prime-node demo --set task.name=guess-number --set verification.pool=1`: the demo starts one `prime-node
    verifier` process and the coordinator hands it every replay (verification.fraction = 1), training a group only
    after its verdict; episodes of several turns, each model turn a replay item of the pool's jobs, the environment
    re-run by the coordinator; nothing rejected. (The single-turn task with a pool is this test's subset; the demo with
    two trainer ranks is tests/integration/test_ranks2_eval.py's: each cost make test ~30 s of its own.)"""
    import sqlite3

    r, s = run_demo(tmp_path, "--nodes", "1", "--steps", "3", "--set", "task.name=guess-number",
                    "--set", "verification.pool=1", "--set", "eval.every_steps=0")
    assert s["steps_completed"] == 3 and s["accepted_rollouts"] > 0 and s["rejected_rollouts"] == 0
    assert "and 1 verifiers" in r.stdout
    assert s["groups_by_verdict"].get("verified", 0) >= 3 * 8  # batch_prompts groups per step, all replayed
    vlog = (tmp_path / "demo-out" / "verifier-0.log").read_text()
    assert "Traceback" not in vlog and "holding step 0" in vlog
    with sqlite3.connect(tmp_path / "demo-out" / "coordinator" / "ledger.sqlite") as db:
        turns = [1 + len(r.get("turns", [])) for (data,) in db.execute("select data from groups")
                 for r in json.loads(data)["rollouts"]]
    assert max(turns) > 1, "no episode had a second turn"


def test_demo_writes_everything_under_storage_dir(tmp_path):
    """`--set storage.dir=X`: the demo's logs, its coordinator's storage and its workers' are under X (the demo
    used to write demo-out/ whatever storage.dir said). A second demo with the same X starts it afresh.

    The first demo also audits every submission for a stale step (its rollouts replayed against step 0 as well,
    where they are expected to fail): the log says "rollout failed" only for a replay against the step a rollout
    claims (it printed 16 such lines a step for an honest node's audit)."""
    fast = ("--nodes", "1", "--steps", "1", "--set", "storage.dir=mine", "--set", "eval.every_steps=0",
            "--set", "trainer.warm_start_steps=0")
    _, s = run_demo(tmp_path, *fast, "--set", "verification.stale_audit_fraction=1")
    assert s["steps_completed"] == 1 and s["rejected_rollouts"] == 0
    mine = tmp_path / "mine"
    assert (mine / "coordinator.log").is_file() and (mine / "coordinator" / "ledger.sqlite").is_file()
    assert "rollout failed" not in (mine / "coordinator.log").read_text()
    assert (mine / "worker-0").is_dir() and (mine / "reward_curve.png").is_file()
    assert not (tmp_path / "demo-out").exists()
    (mine / "stale.txt").write_text("from the first demo")
    run_demo(tmp_path, *fast)
    assert not (mine / "stale.txt").exists() and (mine / "coordinator" / "ledger.sqlite").is_file()


def test_demo_never_empties_a_storage_dir_it_did_not_make(tmp_path):
    """storage.dir may name any directory; the demo starts from an empty one and refuses one holding files it
    did not write (before any process starts), rather than deleting them."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("not the demo's")
    r = subprocess.run([sys.executable, "-m", "node.cli", "demo", "--nodes", "1", "--steps", "1",
                        "--set", f"storage.dir={precious}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "not made by prime-node demo" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(precious.iterdir()) == [precious / "keep.txt"]
    assert (precious / "keep.txt").read_text() == "not the demo's"
    assert not (tmp_path / "demo-out").exists()
