"""`prime-node demo`: an embedded local swarm that really trains.

A coordinator and N worker nodes run as separate processes on 127.0.0.1 (the same commands a user
would run), for S steps; then everything is stopped cleanly and a short report is printed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from node.config import Config, dump_toml, load_config
from node.lifecycle import DIE_WITH_ENV, STOP_GRACE_S, Stopper
from node.real_model import REAL_PREFIX, resolve_model_path
from protocol.errors import PrimeNodeError
from protocol.identity import Identity

# The demo's settings; present in a source checkout (make demo installs it editable).
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.toml"
DEMO_DIR = Path("demo-out")  # everything the demo writes (logs, coordinator and worker storage, plot), unless
# storage.dir is set: then there (configs/local.toml sets it to demo-out)
DEMO_MARK = ".prime-node-demo"  # in every directory the demo made: the only non-empty ones the next demo empties
FINAL_EVAL_WAIT_S = 600.0  # the last step's held-out evaluation (SmolLM2 on 2 cores: ~15 s for 40 prompts)


class DemoError(PrimeNodeError):
    pass


class DemoStopped(Exception):
    """A stop signal came: the demo stops its processes and exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.out = DEMO_DIR  # where the demo's logs and storage are (set by _run_demo once it knows)


class Stopping:
    """Set (from lifecycle's signal thread) by the first SIGTERM/SIGINT/SIGHUP; the demo's waits end at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0

    def set(self, signum: int) -> None:
        self.signum = signum
        self.event.set()

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`; raise DemoStopped as soon as a stop signal has come."""
        if self.event.wait(seconds):
            raise DemoStopped(self.signum)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "node.cli", *args]


def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(ready: Path, proc: subprocess.Popen, log: Path, timeout: float = 180.0,
                stopping: Stopping | None = None) -> dict:
    stopping = stopping or Stopping()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ready.is_file():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            raise DemoError(f"the coordinator exited with code {proc.returncode}; see {log}:\n"
                            + log.read_text()[-2000:])
        stopping.pause(0.2)
    raise DemoError(f"the coordinator did not start within {timeout:.0f} s; see {log}")


def _stop(procs: list[subprocess.Popen], timeout: float = STOP_GRACE_S + 2) -> None:
    """SIGTERM each process, then SIGKILL its whole process group (each was started in a session of its
    own: the group holds what it started, e.g. the coordinator's other trainer ranks) if it has not exited
    `timeout` s later. A role's own stop is bounded by STOP_GRACE_S (node/lifecycle.py), so the KILL is
    for one that is past helping."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # not reaped yet, so the group id is still this one's
            except OSError:
                p.kill()
            p.wait()


def summarize(status: dict, wall: float) -> dict:
    rewards = {r["step"]: r["reward"] for r in status["reward_curve"]}
    hist = {int(k): v for k, v in status["staleness_histogram"].items()}
    return {
        "steps_completed": status["step"],
        "async_level": status["async_level"],
        "max_staleness_seen": max(hist, default=0),
        "staleness_histogram": hist,
        "accepted_rollouts": status["verification"]["accepted"],
        "rejected_rollouts": status["verification"]["rejected"],
        "rejected_by_reason": status["verification"]["rejected_by_reason"],
        "groups_by_verdict": status["verification"].get("groups_by_verdict", {}),
        "reward_by_step": rewards,
        "wall_seconds": round(wall, 1),
        "trainer_idle_fraction": status["trainer"]["idle_fraction"],
        "checkpoint_bytes_by_source": status["checkpoint_bytes_by_source"],
        "nodes": len(status["nodes"]),
        # greedy decoding of held-out prompts by the coordinator (eval.every_steps; empty when off)
        "eval_by_step": {e["step"]: e["reward"] for e in status.get("eval_curve", [])},
        "eval_prompts": max((e["n"] for e in status.get("eval_curve", [])), default=0),
        "reward_last5_mean": _last_mean(rewards, 5),
        # usable vs unusable groups of the batch being collected, and the stall warning (None: none)
        "batch_health": status.get("batch_health", {}),
    }


def unusable_note(status: dict) -> str | None:
    """The batch being collected's unusable groups for the progress line, e.g. "828 (all rewards 0)"
    (the commonest reason first); None while every group offered to it was usable."""
    from node.coordinator.batch_health import SHORT

    by_reason = {r: n for r, n in status.get("batch_health", {}).get("unusable", {}).items() if n}
    if not by_reason:
        return None
    reasons = ", ".join(SHORT.get(r, r) for r, _ in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    return f"{sum(by_reason.values())} ({reasons})"


def _last_mean(by_step: dict, n: int) -> float | None:
    steps = sorted(by_step)[-n:]
    return sum(by_step[s] for s in steps) / len(steps) if steps else None


def learning_ratio(rewards: dict[int, float]) -> float | None:
    """Mean reward over the last fifth of the steps divided by the first fifth's."""
    steps = sorted(rewards)
    if len(steps) < 5:
        return None
    fifth = max(1, len(steps) // 5)
    first = sum(rewards[s] for s in steps[:fifth]) / fifth
    last = sum(rewards[s] for s in steps[-fifth:]) / fifth
    return last / first if first > 0 else float("inf")


def plot_rewards(rewards: dict[int, float], out: Path, evals: dict[int, float] | None = None,
                 temperature: float = 1.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(rewards)
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, [rewards[s] for s in steps], marker="o", ms=3, label=f"rollouts (sampled, T={temperature:g})")
    if evals:
        es = sorted(evals)
        ax.plot(es, [evals[s] for s in es], marker="s", ms=4, color="tab:orange", label="held-out eval (greedy)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("prime-node demo: reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def cmd_demo(args) -> int:
    # SIGTERM/SIGINT/SIGHUP: stop the swarm, exit 128 + signum. The deadline leaves _stop its grace and
    # one status read; past it lifecycle SIGKILLs every process of the demo and exits.
    stopping = Stopping()
    Stopper("demo", grace_s=STOP_GRACE_S + 10).install().on_stop(stopping.set)
    try:
        return _run_demo(args, stopping)
    except DemoStopped as e:
        print(f"prime-node demo: stopped by {e} before the end; its coordinator and workers were stopped "
              f"(logs and storage in {e.out})", file=sys.stderr)
        return 128 + e.signum


def _run_demo(args, stopping: Stopping) -> int:
    config_path = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    cfg = load_config(config_path, args.overrides)
    nodes = args.nodes or cfg.demo.nodes
    steps = args.steps or cfg.demo.steps
    if nodes < 1 or steps < 1:
        raise DemoError("--nodes and --steps must be at least 1")
    overrides = list(args.overrides)
    ready_timeout = 180.0
    if cfg.model.path.startswith(REAL_PREFIX):
        # A real model (configs/real.toml): its directory is built here, once (minutes), before any process
        # starts, and every process is given the directory. Loading it takes the coordinator longer.
        print(f"model {cfg.model.path}: preparing (node/real_model.py; built once, then cached)")
        overrides.append(f"model.path={resolve_model_path(cfg.model.path)}")
        ready_timeout = 900.0
    out = demo_dir(cfg)
    _fresh_dir(out)
    common = ["--config", config_path or _write_default(out)] + [f"--set={o}" for o in overrides]
    # DIE_WITH_ENV: each process asks Linux for SIGTERM when the demo dies, even by SIGKILL (node/lifecycle.py)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", DIE_WITH_ENV: str(os.getpid())}
    t0 = time.monotonic()
    # verification.pool: that many verifier processes replay the chosen submissions instead of the coordinator
    verifier_keys = [Identity.generate() for _ in range(cfg.verification.pool)]
    for i, ident in enumerate(verifier_keys):
        ident.save(out / f"verifier-{i}.key")
    pool_set = [f"--set=verification.verifier_keys={json.dumps([v.public_hex for v in verifier_keys])}"] \
        if verifier_keys else []
    ready = out / "coordinator.ready"
    clog = out / "coordinator.log"
    coord = subprocess.Popen(
        _cli("coordinator", *common,
             f"--set=storage.dir={out / 'coordinator'}", f"--set=run.max_steps={steps}", "--set=server.port=0",
             *pool_set, "--ready-file", str(ready)),
        stdout=open(clog, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs = [coord]
    try:
        info = _wait_ready(ready, coord, clog, timeout=ready_timeout, stopping=stopping)
        url = info["url"]
        print(f"coordinator up at {url} (logs: {clog})")
        print(f"dashboard: {url}/dashboard")
        for i in range(nodes):
            wlog = out / f"worker-{i}.log"
            procs.append(subprocess.Popen(
                _cli("join", "--coordinator", url, "--coordinator-key", info["key"], *common,
                     f"--set=worker.storage_dir={out / f'worker-{i}'}", "--set=worker.heartbeat_seconds=1"),
                stdout=open(wlog, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        for i in range(len(verifier_keys)):
            vlog = out / f"verifier-{i}.log"
            procs.append(subprocess.Popen(
                _cli("verifier", "--coordinator", url, "--coordinator-key", info["key"], *common,
                     "--key", str(out / f"verifier-{i}.key"), "--dir", str(out / f"verifier-{i}")),
                stdout=open(vlog, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        pool = f" and {len(verifier_keys)} verifiers" if verifier_keys else ""
        print(f"started {nodes} worker nodes{pool}; training {steps} steps (async level {cfg.run.async_level})")
        status = _follow(url, steps, procs, stopping, evaluates=cfg.eval.every_steps > 0, out=out)
        stopping.pause(1.5)  # one more heartbeat, so byte counts include the last download
        status = _get_json(url + "/v1/status")
    except DemoStopped as e:
        _stop(procs)  # all at once: one grace period, not one per process
        e.out = out
        raise
    finally:
        _stop(procs[1:])  # workers first, so they do not retry against a coordinator already gone
        _stop(procs[:1])
    wall = time.monotonic() - t0
    summary = summarize(status, wall)
    ratio = learning_ratio(summary["reward_by_step"])
    summary["learning_ratio_last_vs_first_fifth"] = ratio
    plot = out / "reward_curve.png"
    if summary["reward_by_step"]:
        plot_rewards(summary["reward_by_step"], plot, summary["eval_by_step"], cfg.sampling.temperature)
        summary["reward_plot"] = str(plot)
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    _report(summary, ratio, plot, args.summary)
    return 0


def demo_dir(cfg: Config) -> Path:
    """Where the demo writes everything: storage.dir when a config file or --set gives it (the coordinator's
    storage is its coordinator/, each worker's its worker-N/), else demo-out/."""
    return Path(cfg.storage.dir) if "dir" in cfg.storage.model_fields_set else DEMO_DIR


def _fresh_dir(out: Path) -> None:
    """Empty `out` for a new demo. Only a directory the demo made (it holds DEMO_MARK), the default demo-out/
    or an empty one is emptied: storage.dir may name anything, and the demo never deletes what it did not write."""
    if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARK).is_file() \
            and out.resolve() != DEMO_DIR.resolve():
        raise DemoError(f"{out} (storage.dir) is not empty and was not made by prime-node demo, which starts from "
                        "an empty directory: remove it or set storage.dir to another")
    if out.exists() and not out.is_dir():
        raise DemoError(f"{out} (storage.dir) is a file, not a directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / DEMO_MARK).write_text("made by prime-node demo: the next demo with this storage.dir empties it\n")


def _write_default(out: Path) -> str:
    """No config file given or found: write the defaults so every process reads the same tree."""
    path = out / "config.toml"
    path.write_text(dump_toml(Config(p2p={"allow_private_addrs": True})))  # every demo node is on 127.0.0.1
    return str(path)


def _final_eval(url: str, steps: int, coord: subprocess.Popen, stopping: Stopping,
                timeout: float = FINAL_EVAL_WAIT_S) -> dict:
    """The status once the coordinator has evaluated the last step's policy (it always does,
    node/coordinator/evaluation.py), so the summary's curve ends with the policy the run ends with. Bounded:
    after `timeout` s, or if the coordinator exits, the summary goes on without that point (and says so)."""
    print(f"waiting for the held-out evaluation of step {steps}", file=sys.stderr)
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline and coord.poll() is None:
        try:
            status = _get_json(url + "/v1/status")
        except OSError:
            status = {}
        if any(e["step"] >= steps for e in status.get("eval_curve", [])):
            return status
        stopping.pause(0.5)
    print(f"WARNING: no evaluation of step {steps} within {timeout:.0f} s; the summary's curve ends earlier",
          file=sys.stderr)
    return status or _get_json(url + "/v1/status")


def _follow(url: str, steps: int, procs: list[subprocess.Popen], stopping: Stopping | None = None,
            evaluates: bool = False, out: Path = DEMO_DIR) -> dict:
    stopping = stopping or Stopping()
    from tqdm import tqdm

    bar = tqdm(total=steps, desc="training", unit="step", file=sys.stderr)
    last = 0
    warned_at: float | None = None
    status: dict = {}
    while True:
        if procs[0].poll() is not None:
            bar.close()
            raise DemoError(f"the coordinator exited early (code {procs[0].returncode}); "
                            f"see {out / 'coordinator.log'}")
        try:
            status = _get_json(url + "/v1/status")
        except OSError:
            stopping.pause(1)
            continue
        if status["trainer"]["error"]:
            bar.close()
            raise DemoError(f"training failed: {status['trainer']['error']}")
        step = status["step"]
        curve = status["reward_curve"]
        note = unusable_note(status)  # every poll: a batch that cannot fill never moves the step
        if step > last or note:
            bar.update(step - last)
            last = step
            postfix = {"reward": f"{curve[-1]['reward']:.3f}"} if curve else {}
            postfix["rejected"] = status["verification"]["rejected"]
            if note:
                postfix["unusable"] = note
            bar.set_postfix(postfix)
        warning = status.get("batch_health", {}).get("warning")
        if warning and (warned_at is None or time.monotonic() - warned_at >= 60):  # the coordinator's rate
            bar.write(f"WARNING: {warning}", file=sys.stderr)
            warned_at = time.monotonic()
        if step >= steps:
            bar.close()
            return _final_eval(url, steps, procs[0], stopping) if evaluates else status
        if all(p.poll() is not None for p in procs[1:]):
            bar.close()
            raise DemoError(f"every worker exited; see {out / 'worker-*.log'}")
        stopping.pause(0.5)


def _report(s: dict, ratio: float | None, plot: Path, summary_path: str | None) -> None:
    rewards = s["reward_by_step"]
    steps = sorted(rewards)
    print()
    print("prime-node demo: done")
    print(f"  steps trained        {s['steps_completed']} in {s['wall_seconds']:.0f} s with {s['nodes']} nodes")
    print(f"  rollouts             {s['accepted_rollouts']} accepted, {s['rejected_rollouts']} rejected")
    print(f"  staleness (k={s['async_level']})      max {s['max_staleness_seen']}, histogram {s['staleness_histogram']}")
    print(f"  trainer idle         {100 * s['trainer_idle_fraction']:.1f}%")
    print(f"  checkpoint bytes     {s['checkpoint_bytes_by_source']}")
    if steps:
        print(f"  reward               step {steps[0]}: {rewards[steps[0]]:.3f} -> step {steps[-1]}: {rewards[steps[-1]]:.3f}")
    if s["reward_last5_mean"] is not None:
        print(f"  reward, last 5 steps {s['reward_last5_mean']:.3f} (1 = exactly right)")
    if ratio is not None:
        print(f"  learning             last fifth / first fifth = {ratio:.2f}x")
    evals = s["eval_by_step"]
    if evals:
        es = sorted(evals)
        print(f"  held-out eval        greedy on {s['eval_prompts']} prompts: step {es[0]}: {evals[es[0]]:.3f} -> "
              f"step {es[-1]}: {evals[es[-1]]:.3f}")
    bh = s.get("batch_health") or {}
    if bh.get("warning"):
        print(f"  not stepping         {bh['warning']}")
    if plot.is_file():
        print(f"  reward curve         {plot}")
    if summary_path:
        print(f"  summary              {summary_path}")
