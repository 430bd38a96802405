"""Pipeline benchmark: trained tokens/s and trainer idle fraction for k = 0 (synchronous),
k = 0 streaming (periodic asynchrony), k = 1 and k = 2, with checkpoint delivery rate-limited so
that one broadcast takes about one trainer step.

Everything is real: a coordinator and N worker processes on 127.0.0.1 (the same commands a user
runs), the tiny model, verification on. First a calibration run (k = 2, no cap) measures the
trainer's step time and the delta checkpoint size; the cap is then set so that sending one
checkpoint to every node takes one trainer step. Steps 1-2 are warm-up and not counted. The
calibration run is reported too ("k=2 no cap"): it is the most this machine's workers can feed the
trainer, whatever the delivery.

    python bench/pipeline.py [--steps 20] [--nodes 2]
Writes bench/results/pipeline.json and docs/pipeline.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results"
WORK = REPO / "bench" / ".pipeline-work"

MODES = [
    ("k=0 sync", ["run.async_level=0"]),
    ("k=0 streaming", ["run.async_level=0", "run.stream_groups=true"]),
    ("k=1", ["run.async_level=1"]),
    ("k=2", ["run.async_level=2"]),
]
BASE = ["model.tiny_hidden_size=128", "model.tiny_layers=4", "run.batch_prompts=8", "run.group_size=8",
        "run.prompts_per_assignment=2", "sampling.max_tokens=12", "distribution.shard_size=65536"]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def run(name: str, overrides: list[str], steps: int, nodes: int) -> dict:
    work = WORK / name.replace(" ", "_").replace("=", "")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = ["--config", str(REPO / "configs/local.toml")] + [f"--set={o}" for o in BASE + overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ready = work / "ready.json"
    coord = subprocess.Popen([sys.executable, "-m", "node.cli", "coordinator", *cfg, f"--set=storage.dir={work}/c",
                              f"--set=run.max_steps={steps}", "--ready-file", str(ready)],
                             cwd=REPO, env=env, stdout=open(work / "coord.log", "w"), stderr=subprocess.STDOUT)
    procs = [coord]
    try:
        while not ready.exists():
            if coord.poll() is not None:
                raise RuntimeError((work / "coord.log").read_text()[-2000:])
            time.sleep(0.1)
        url = json.loads(ready.read_text())["url"]
        for i in range(nodes):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "node.cli", "join", "--coordinator", url, *cfg,
                 f"--set=worker.storage_dir={work}/w{i}", "--set=worker.heartbeat_seconds=1"],
                cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, stdout=open(work / f"w{i}.log", "w"),
                stderr=subprocess.STDOUT))
        t0 = time.monotonic()
        while True:
            status = get(url + "/v1/status")
            if status["step"] >= steps or status["trainer"]["error"]:
                break
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{name}: no progress")
            time.sleep(0.5)
    finally:
        for p in procs[::-1]:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return summarize(name, status)


def summarize(name: str, status: dict) -> dict:
    """A run's numbers from the coordinator's final /v1/status (also used by bench/wan_k.py)."""
    log = [s for s in status["step_log"] if s["step"] >= 1]
    counted = [s for s in log if s["step"] >= 3]
    span = (counted[-1]["published_ms"] - log[1]["published_ms"]) / 1000  # from step 2's end to the last
    tokens = sum(s["loss_tokens"] for s in counted)
    idle = sum(s["idle_seconds"] for s in counted)
    busy = sum(s["busy_seconds"] for s in counted)
    deltas = [s["compressed_bytes"] for s in log if s["encoding"] == "xor-delta"]
    return {"mode": name, "steps": len(counted), "seconds": round(span, 2),
            "trained_tokens_per_s": round(tokens / span, 1), "trainer_idle_fraction": round(idle / (idle + busy), 3),
            "mean_step_busy_s": round(busy / len(counted), 3),
            "max_staleness": max(s["max_staleness"] for s in counted),
            "delta_bytes": int(sum(deltas) / max(1, len(deltas))),
            "rejected": status["verification"]["rejected"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    print("calibrating (k=2, no upload cap)…", flush=True)
    cal = run("k=2 no cap", ["run.async_level=2"], args.steps, args.nodes)
    cap = int(args.nodes * cal["delta_bytes"] / cal["mean_step_busy_s"])
    print(f"  trainer step {cal['mean_step_busy_s']:.3f} s, delta {cal['delta_bytes'] / 1e6:.2f} MB "
          f"-> origin cap {cap / 1e6:.2f} MB/s for {args.nodes} nodes", flush=True)
    results = []
    for name, overrides in MODES:
        print(f"running {name}…", flush=True)
        results.append(run(name, overrides + [f"distribution.origin_upload_limit={cap}"], args.steps, args.nodes))
    sync = results[0]["trained_tokens_per_s"]
    results.append(cal)  # the same run with instant delivery: how fast 2 cores can make rollouts at all
    for r in results:
        r["speedup_vs_sync"] = round(r["trained_tokens_per_s"] / sync, 2)
    print()
    print(f"{'mode':<15} {'tokens/s':>9} {'vs sync':>8} {'trainer idle':>13} {'max stale':>10} {'rejected':>9}")
    for r in results:
        print(f"{r['mode']:<15} {r['trained_tokens_per_s']:>9.1f} {r['speedup_vs_sync']:>7.2f}x "
              f"{100 * r['trainer_idle_fraction']:>12.1f}% {r['max_staleness']:>10} {r['rejected']:>9}")
    doc = {"benchmark": "pipeline", "nodes": args.nodes, "steps": args.steps, "origin_upload_limit": cap,
           "calibration": cal, "results": results, "machine": f"{os.cpu_count()} cores"}
    (OUT / "pipeline.json").write_text(json.dumps(doc, indent=2))
    plot(results)
    shutil.rmtree(WORK, ignore_errors=True)


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["mode"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    a.bar(names, [r["trained_tokens_per_s"] for r in results], color="#4c8bf5")
    a.set_ylabel("trained tokens/s")
    a.set_title("throughput")
    b.bar(names, [100 * r["trainer_idle_fraction"] for r in results], color="#f5a24c")
    b.axhline(10, color="gray", ls="--", lw=1)
    b.set_ylabel("trainer idle %")
    b.set_title("trainer idle (broadcast ≈ one step)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "pipeline.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
