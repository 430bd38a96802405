"""Does k = 2 hide the broadcast on WAN links? Trainer idle fraction and steps per minute for k = 0, 1, 2, in the
WAN lab and on loopback, side by side in one run (issue #26, item 5).

    sudo .venv/bin/python bench/wan_k.py [--steps 14] [--cap BYTES_PER_S] [--delays 25,50]
Prints a table and writes bench/results/wan_k.json.

Both environments run the same thing: the real CLI coordinator and two `prime-node join` processes, the model
and batch of bench/pipeline.py (hidden 128, 4 layers, 8 prompts x G = 8, <= 12 tokens, every rollout verified,
p2p on), evaluation and the warm start off. The coordinator's upload is capped so that sending one checkpoint to
both nodes takes about one trainer step (as in bench/pipeline.py: a calibration run on loopback, k = 2 and no
cap, gives the step time and the delta size; `--cap` skips it). "loopback": every process on 127.0.0.1 (the
bench/pipeline.py runner). "lab": the coordinator in the lab's datacenter, the nodes at home behind their own
NAT routers `--delays` ms one way (20 Mbit/s up, 100 down). Steps 1-2 are warm-up; trainer idle is time the
trainer waited for rollouts over waiting + training + publishing (bench/pipeline.py's `summarize`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import pipeline  # noqa: E402
from bench.wan import lab_status, start_run  # noqa: E402

OFF = ["trainer.warm_start_steps=0", "eval.every_steps=0"]
WORK = Path("/tmp/bench_wan_k")


def run_lab(name: str, overrides: list[str], steps: int, delays_ms: list[float], timeout_s: float = 300.0) -> dict:
    from tests.wan.lab import Lab, home

    work = WORK / name.replace(" ", "_").replace("=", "")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sets = ["--config", str(REPO / "configs/local.toml")] + [f"--set={o}" for o in pipeline.BASE + OFF + overrides]
    with Lab() as lab:
        dc, _, url, coord = start_run(lab, REPO, [(f"home{int(d)}", home(d)) for d in delays_ms], work,
                                      [*sets, f"--set=run.max_steps={steps}"], sets)
        t0, st = time.monotonic(), {}
        while time.monotonic() - t0 < timeout_s:
            st = lab_status(lab, dc, url) or st
            if st.get("step", 0) >= steps or (st.get("trainer") or {}).get("error"):
                break
            if coord.poll() is not None:
                raise RuntimeError(f"{name}: the coordinator exited:\n" + lab.log("coordinator")[-3000:])
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name}: {st.get('step')} of {steps} steps in {timeout_s} s")
        lab.check_delay_lines()
    shutil.rmtree(work, ignore_errors=True)
    return pipeline.summarize(name, st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--cap", type=int, default=None, help="origin upload cap, bytes/s (default: calibrated)")
    ap.add_argument("--delays", default="25,50", help="one-way delays of the two home nodes in the lab, ms")
    ap.add_argument("--ks", default="0,1,2")
    args = ap.parse_args()
    from tests.wan.lab import unavailable

    if why := unavailable():
        sys.exit(f"bench/wan_k.py: {why}")
    delays = [float(x) for x in args.delays.split(",")]
    nodes = len(delays)
    cal = None
    cap = args.cap
    if cap is None:
        print("calibrating (loopback, k=2, no upload cap)...", flush=True)
        cal = pipeline.run("calibration", ["run.async_level=2", *OFF], args.steps, nodes)
        cap = int(nodes * cal["delta_bytes"] / cal["mean_step_busy_s"])
        print(f"  trainer step {cal['mean_step_busy_s']:.3f} s, delta {cal['delta_bytes'] / 1e6:.2f} MB -> origin cap "
              f"{cap / 1e6:.2f} MB/s for {nodes} nodes", flush=True)
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        over = [f"run.async_level={k}", f"distribution.origin_upload_limit={cap}"]
        for env in ("loopback", "lab"):
            name = f"{env} k={k}"
            print(f"running {name}...", flush=True)
            r = pipeline.run(name, [*over, *OFF], args.steps, nodes) if env == "loopback" else \
                run_lab(name, over, args.steps, delays)
            r.update(env=env, k=k, steps_per_min=round(60 * r["steps"] / r["seconds"], 1))
            rows.append(r)
    shutil.rmtree(pipeline.WORK, ignore_errors=True)
    print()
    print(f"{'k':>2} {'loopback idle':>13} {'lab idle':>9} {'diff pts':>8} {'loopback steps/min':>18} "
          f"{'lab steps/min':>13} {'lab/loopback':>12} {'max stale (lab)':>15} {'rejected (lab)':>14}")
    by = {(r["env"], r["k"]): r for r in rows}
    for k in sorted({r["k"] for r in rows}):
        lo, la = by[("loopback", k)], by[("lab", k)]
        print(f"{k:>2} {100 * lo['trainer_idle_fraction']:>12.1f}% {100 * la['trainer_idle_fraction']:>8.1f}% "
              f"{100 * (la['trainer_idle_fraction'] - lo['trainer_idle_fraction']):>8.1f} "
              f"{lo['steps_per_min']:>18.1f} {la['steps_per_min']:>13.1f} "
              f"{la['steps_per_min'] / lo['steps_per_min']:>11.2f}x {la['max_staleness']:>15} {la['rejected']:>14}")
    out = REPO / "bench" / "results" / "wan_k.json"
    out.write_text(json.dumps({"benchmark": "wan_k", "steps": args.steps, "nodes": nodes, "lab_delays_ms": delays,
                               "origin_upload_limit": cap, "calibration": cal, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
