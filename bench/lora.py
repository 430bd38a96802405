"""LoRA adapter broadcast (issue #29), its parts side by side in one run, one table, bench/results/lora.json:

  bytes      bytes on the wire per step: the signed `lora-adapter` checkpoint the real Publisher sends, against what
             full fine-tuning's encodings would send for the same merged weights (full, xor-delta, sparse-delta), for
             the real SmolLM2-135M-Instruct and a Qwen2-0.5B-shaped model, at each target set (--targets: q,k,v,o,
             the trainer's default, and q,v, peft's own default for llama/qwen2) (bench/lora_bytes.py `measure`);
  broadcast  time until every node of N = 16 holds step 1, each node seeded with step 0 (the full base) before the
             clock: step 1 published as a lora-adapter, as the xor-delta a full fine-tuning run's publisher sends, and
             as a full checkpoint, each under the same origin upload cap (default 2.5 MB/s = 20 Mbit/s, a home
             uplink). bench/broadcast.py's machinery: the coordinator (configs/real.toml, the real model) serves with
             its cap, every node is the worker's real Fetcher in its own process with its own libp2p host;
  swap       adapter swap time per backend (bench/lora_swap.py: its JSON, or run it with --parts swap);
  learning   LoRA vs full fine-tuning on the demo task, 3 seeds (bench/learning.py --lora-ranks 0,8: its JSON, or run).

--parts names the parts run now; --from-json the parts read from their earlier JSON (labelled "from JSON" in the
table, with the file's date). Heavy (minutes of CPU, 16 processes): run under the shared lock,
    flock /tmp/heavy.lock nice .venv/bin/python bench/lora.py [--parts bytes,broadcast] [--from-json swap,learning]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RESULTS = ROOT / "bench" / "results"
PARTS = ("bytes", "broadcast", "swap", "learning")
# ":unmerged": the nodes keep the adapter step unmerged (worker.lora_serving = "adapter": rebuilt and verified, no
# merge into a full payload); plain lora-adapter nodes merge it into the base and write a full payload, as a worker
# serving merged weights does
ENCODINGS = ("lora-adapter:unmerged", "lora-adapter", "xor-delta", "full")


def _from_json(path: Path) -> dict:
    doc = json.loads(path.read_text())
    # the commit that last wrote it (a checkout's mtime is the checkout's), else the file's mtime
    when = subprocess.run(["git", "log", "-1", "--format=%ci", "--", str(path)], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    return {**doc, "source": f"from JSON ({path.relative_to(ROOT)}, committed {when})"}


# -- bytes ----------------------------------------------------------------------------------------
def part_bytes(models: list[str], target_sets: list[list[str]], rank: int, alpha: int, steps: int) -> dict:
    from lora_bytes import model_for, measure

    out = []
    for kind in models:
        for targets in target_sets:
            work = Path(tempfile.mkdtemp(prefix="lora-bytes-"))
            try:
                model, name = model_for(kind, work)
                print(f"bytes: {name}, rank {rank}, targets {','.join(targets)}", flush=True)
                doc = measure(model, rank=rank, alpha=alpha, steps=steps, targets=targets, work=work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            doc.pop("work")
            adapter = [r for r in doc["rows"] if r["step"]]
            doc.update(model=name, kind=kind,
                       min_full_over_adapter=min(r["full_over_adapter"] for r in adapter),
                       max_full_over_adapter=max(r["full_over_adapter"] for r in adapter))
            out.append(doc)
    return {"source": "measured in this run", "runs": out}


# -- broadcast ------------------------------------------------------------------------------------
def _link_tree(src: Path, dst: Path) -> None:
    """A copy of src made of hard links: 16 stores seeded with one 270 MB base cost no disk and no time (nothing
    rewrites a payload or shard in place)."""
    shutil.copytree(src, dst, copy_function=os.link)


def _kill_children() -> None:
    """Node processes a timed-out round left behind (they fetch until they hold the step): ours, by pid."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            try:
                os.kill(int(stat.parent.name), 9)
            except OSError:
                pass


async def broadcast_round(encoding: str, n: int, cap: int, mode: str, rank: int, alpha: int, work: Path,
                          unmerged: bool, timeout: float) -> dict:
    """A fresh coordinator on the real model (configs/real.toml, trainer.lora.rank = `rank` for the adapter
    round, else full fine-tuning) publishes step 0; every node's store is seeded with it (hard links) before the
    node starts. Step 1 (one real trainer step on synthetic groups) is trained before the clock; once the clock
    started the real Publisher packs it into the coordinator's store (full_every = 1 for `full`) and it is made
    servable and announced as the training loop does (`published_step`, `on_step_published`). The round ends when
    all n hold step 1 (bench/broadcast.py `one_round`), each node's rebuilt payload checked against the origin's."""
    from broadcast import one_round

    from node.checkpoint_dir import CheckpointDir
    from node.config import load_config
    from node.coordinator.app import start_server
    from node.coordinator.publisher import Publisher
    from node.coordinator.service import Coordinator
    from node.trainer import Trainer
    from protocol.identity import Identity
    from tests.unit.test_trainer_step import make_groups, train_batches

    lora = encoding == "lora-adapter"
    cfg = load_config(ROOT / "configs" / "real.toml", [
        f"storage.dir={work}/coord", f"distribution.origin_upload_limit={cap}", "eval.every_steps=0",
        "run.run_id=lora-bench", f"trainer.lora.rank={rank if lora else 0}", f"trainer.lora.alpha={alpha}"])
    coord = Coordinator(cfg, Identity.generate())
    runner, port = await start_server(coord, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        store = coord.checkpoints
        # the coordinator's own trainer waits in its thread for rollouts that never come: step 1 is trained here
        trainer = Trainer(coord.model_dir, cfg.trainer, batch_prompts=4)
        await asyncio.to_thread(train_batches, trainer, [make_groups(4, seed=101)])
        weights, adapter = trainer.weights_for_broadcast(), trainer.adapter_for_broadcast()
        assert (adapter is not None) == lora
        pub = Publisher(store, coord.identity, cfg.run.run_id, async_level=cfg.run.async_level,
                        shard_size=cfg.distribution.shard_size, level=cfg.distribution.compression_level,
                        full_every=1 if encoding == "full" else 10 ** 6)
        published: dict = {}

        async def at_go() -> None:
            t0 = time.monotonic()
            p = await asyncio.to_thread(pub.publish, 1, weights, adapter)
            published.update(publish_seconds=round(time.monotonic() - t0, 2), encoding=p.encoding,
                             step_bytes=p.compressed_bytes)
            coord.training.published_step = 1
            coord.on_step_published(1, {})

        def seed(node: Path) -> None:
            d = CheckpointDir(node)
            _link_tree(store.step_dir(0), d.step_dir(0))
            os.link(store.payload_path(0), d.payload_path(0))

        print(f"broadcast: step 1 as {encoding} to {n} nodes ({mode}), origin cap {cap / 1e6:.2f} MB/s", flush=True)
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(one_round(mode, n, coord, url, work / "nodes", seed=seed, at_go=at_go, step=1,
                                                 unmerged=unmerged), timeout)
        except asyncio.TimeoutError:  # ours, or one_round's own 600 s wait for a node's answer
            _kill_children()
            r = {"mode": mode, "nodes": n, "seconds": None, "timed_out_s": round(time.monotonic() - t0)}
        assert published.get("encoding") == encoding, published
        m0 = store.manifest(0)
        assert m0 is not None  # published by the coordinator's start
        r.update(published, base_bytes=m0.compressed_size, cap=cap, unmerged=unmerged,
                 one_copy_seconds=round(published["step_bytes"] / cap, 2))
        if r["seconds"] is not None:
            # the clock includes the publisher's packing (as a real step's does); the wire's share beside it
            r["after_publish_seconds"] = round(r["seconds"] - published["publish_seconds"], 2)
        print(f"  {encoding}: {published['step_bytes'] / 1e6:.2f} MB, all {n} hold it after {r['seconds']} s "
              f"(publish {published['publish_seconds']} s; one copy at the cap {r['one_copy_seconds']} s)",
              flush=True)
        return r
    finally:
        await runner.cleanup()
        await coord.stop()
        if os.environ.get("BENCH_KEEP_LOGS"):  # the node processes' logs, for a round to be read after
            keep = Path(os.environ["BENCH_KEEP_LOGS"]) / f"{encoding}{'-unmerged' if unmerged else ''}"
            keep.mkdir(parents=True, exist_ok=True)
            for log in (work / "nodes").glob("n*.log"):
                shutil.copy(log, keep / log.name)
        shutil.rmtree(work, ignore_errors=True)


def part_broadcast(encodings: list[str], n: int, cap: int, mode: str, rank: int, alpha: int,
                   timeout: float) -> dict:
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for enc in encodings:
        work = Path(tempfile.mkdtemp(prefix="lora-broadcast-"))
        encoding, _, how = enc.partition(":")
        rows.append(asyncio.run(broadcast_round(encoding, n, cap, mode, rank, alpha, work, how == "unmerged",
                                                timeout)))
    return {"source": "measured in this run", "model": "SmolLM2-135M-Instruct", "nodes": n, "cap": cap,
            "mode": mode, "rank": rank, "rows": rows, "machine": f"{os.cpu_count()} cores"}


# -- swap, learning -------------------------------------------------------------------------------
def part_swap() -> dict:
    py = ROOT / ".venv-vllm" / "bin" / "python"  # both engines; .venv has transformers only
    subprocess.run([str(py if py.is_file() else sys.executable), str(ROOT / "bench" / "lora_swap.py")], check=True)
    return {**_from_json(RESULTS / "lora_swap.json"), "source": "measured in this run (bench/lora_swap.py)"}


def part_learning() -> dict:
    subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--lora-ranks", "0,8", "--seeds", "3"],
                   check=True)
    return {**_from_json(RESULTS / "learning_lora.json"), "source": "measured in this run (bench/learning.py)"}


def _guard(part: str, fn, *args) -> dict:
    """A part that fails is reported as such; the other parts of the run still come out."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (any failure: it goes into the table and the JSON)
        import traceback

        traceback.print_exc()
        return {"source": "measured in this run", "error": f"{type(e).__name__}: {e}"}


# -- the table ------------------------------------------------------------------------------------
def print_table(doc: dict) -> None:
    if (b := doc.get("bytes")) and "error" not in b:
        print(f"\nBYTES PER STEP [{b['source']}]  (bf16, zstd 3; 'full/adapter' over the adapter steps)")
        print(f"{'model':<34} {'targets':<24} {'rank':>4} {'adapter MB':>10} {'sparse MB':>9} {'xor MB':>8} "
              f"{'full MB':>8} {'full/adapter':>13} {'>=100x':>6}")
        for run in b.get("runs", []):
            rows = [r for r in run["rows"] if r["step"]]
            mean = lambda k: sum(r.get(k, 0) for r in rows) / len(rows) / 1e6  # noqa: E731
            print(f"{run['model']:<34} {','.join(t.removesuffix('_proj') for t in run['target_modules']):<24} "
                  f"{run['rank']:>4} {mean('published_bytes'):>10.2f} {mean('sparse_delta_bytes'):>9.2f} "
                  f"{mean('xor_delta_bytes'):>8.2f} {mean('full_bytes'):>8.1f} "
                  f"{run['min_full_over_adapter']:>5}-{run['max_full_over_adapter']:<6}x "
                  f"{'yes' if run['min_full_over_adapter'] >= 100 else 'no':>6}")
    if (b := doc.get("broadcast")) and "error" not in b:
        print(f"\nTIME UNTIL ALL {b['nodes']} NODES HOLD STEP 1 [{b['source']}]  ({b['model']}, {b['mode']}, "
              f"origin cap {b['cap'] / 1e6:.2f} MB/s = {b['cap'] * 8 / 1e6:.0f} Mbit/s, nodes seeded with step 0)")
        print(f"{'step 1 as':<22} {'MB':>8} {'one copy s':>10} {'all hold s':>10} {'publish s':>9} "
              f"{'origin MB':>9} {'peers MB':>9}")
        for r in b.get("rows", []):
            secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None else f">{r['timed_out_s']:.0f}"
            name = r["encoding"] + (" unmerged" if r.get("unmerged") else "")
            print(f"{name:<22} {r['step_bytes'] / 1e6:>8.2f} {r['one_copy_seconds']:>10.1f} {secs:>10} "
                  f"{r['publish_seconds']:>9.2f} {r.get('bytes_from_origin', 0) / 1e6:>9.1f} "
                  f"{r.get('bytes_from_peers', 0) / 1e6:>9.1f}")
        for lb in b.get("lower_bounds", []):
            print(f"  lower bound, {lb['model']} step 1 as {lb['encoding']}: {lb['bytes'] / 1e6:.1f} MB / cap = "
                  f"{lb['seconds']:.1f} s ({lb['why']})")
    if (s := doc.get("swap")) and "error" not in s:
        print(f"\nADAPTER SWAP PER STEP [{s['source']}]  ({s['model']}, rank {s['rank']})")
        print(f"{'backend':<14} {'merged swap s':>13} {'adapter swap s':>14} {'speedup':>8} {'tok/s merged':>12} "
              f"{'tok/s adapter':>13}")
        for r in s.get("rows", []):
            print(f"{r['backend']:<14} {r['swap_merged_s']:>13.3f} {r['swap_adapter_s']:>14.3f} "
                  f"{r['swap_speedup']:>7.1f}x {r['tokens_per_s_merged']:>12.1f} {r['tokens_per_s_adapter']:>13.1f}")
    if (lr := doc.get("learning")) and "error" not in lr:
        print(f"\nLEARNING PARITY, LoRA vs full fine-tuning [{lr['source']}]")
        print(f"{'task':<14} {'k':>2} {'lora':>5} {'seeds':>5} {'eval step 0':>11} {'final eval (range)':>22} "
              f"{'reward last 5 (range)':>24}")
        for r in lr.get("rows", []):
            if not r.get("summary"):
                continue
            print(f"{r['task']:<14} {r['k']:>2} {r['lora_rank'] or 'off':>5} {len(r['seeds']):>5} "
                  f"{r['eval_mean_by_step']['0']:>11.3f} {r['final_eval_mean']:>8.3f} "
                  f"({r['final_eval_range'][0]:.3f}-{r['final_eval_range'][1]:.3f}) {r['reward_last5_mean']:>9.3f} "
                  f"({r['reward_last5_range'][0]:.3f}-{r['reward_last5_range'][1]:.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bytes,broadcast", help=f"parts run now, of {','.join(PARTS)}")
    ap.add_argument("--from-json", default="swap,learning", help="parts read from their earlier JSON (not run)")
    ap.add_argument("--models", default="smollm2,qwen05b", help="bytes: smollm2, qwen05b, tiny")
    ap.add_argument("--targets", nargs="+", default=["q_proj,k_proj,v_proj,o_proj", "q_proj,v_proj"],
                    help="bytes: one trainer.lora.target_modules set per argument (comma-separated)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="bytes: adapter steps after step 0")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--cap", type=int, default=2_500_000, help="origin upload cap, bytes/s (2.5 MB/s = 20 Mbit/s)")
    ap.add_argument("--mode", default="swarm", help="broadcast mode of bench/broadcast.py (swarm, swarm-http, ...)")
    ap.add_argument("--encodings", default=",".join(ENCODINGS), help="broadcast: step 1 as each of these")
    ap.add_argument("--round-timeout", type=float, default=900, help="broadcast: seconds before a round is "
                    "given up (reported as '>' that)")
    ap.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    a = ap.parse_args()
    run = [p for p in a.parts.split(",") if p]
    read = [p for p in a.from_json.split(",") if p and p not in run]
    if bad := set(run + read) - set(PARTS):
        ap.error(f"unknown part(s) {', '.join(sorted(bad))}: choose from {', '.join(PARTS)}")
    doc: dict = {"benchmark": "lora", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "machine": f"{os.cpu_count()} cores", "parts_run": run, "parts_from_json": read}
    t0 = time.monotonic()

    def save() -> None:  # after every part: a run cut short keeps what it measured
        doc["seconds"] = round(time.monotonic() - t0, 1)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")

    earlier = _from_json(a.out) if a.out.is_file() and ({"bytes", "broadcast"} & set(read)) else {}
    # the broadcast first: the slowest and the part no other script measures
    if "broadcast" in run:
        doc["broadcast"] = _guard("broadcast", part_broadcast, a.encodings.split(","), a.nodes, a.cap, a.mode,
                                  a.rank, a.alpha, a.round_timeout)
    elif "broadcast" in read:
        doc["broadcast"] = earlier["broadcast"] | {"source": f"from JSON ({a.out.name}, an earlier bench/lora.py)"}
    save()
    if "bytes" in run:
        doc["bytes"] = _guard("bytes", part_bytes, a.models.split(","), [t.split(",") for t in a.targets], a.rank,
                              a.alpha, a.steps)
    elif "bytes" in read:
        doc["bytes"] = earlier["bytes"] | {"source": f"from JSON ({a.out.name}, an earlier bench/lora.py)"}
    save()
    if "rows" in doc.get("broadcast", {}) and "runs" in doc.get("bytes", {}):  # the models not broadcast here: what the cap alone allows
        doc["broadcast"]["lower_bounds"] = [
            {"model": r["model"], "encoding": enc, "bytes": b, "seconds": b / doc["broadcast"]["cap"],
             "why": "not broadcast on this 2-core box (16 nodes would each rebuild a 1 GB bf16 payload); no node "
                    "can hold it before the origin sent one copy at its cap"}
            for r in doc["bytes"]["runs"] if r["kind"] == "qwen05b" and r["target_modules"] == doc["bytes"]["runs"][0][
                "target_modules"]
            for enc, b in (("lora-adapter", r["rows"][1]["published_bytes"]),
                           ("xor-delta", r["rows"][1]["xor_delta_bytes"]), ("full", r["rows"][1]["full_bytes"]))]
    for part, fn, path in (("swap", part_swap, "lora_swap.json"), ("learning", part_learning, "learning_lora.json")):
        if part in run:
            doc[part] = _guard(part, fn)
        elif part in read:
            doc[part] = _from_json(RESULTS / path)
    save()
    print_table(doc)
    for part in PARTS:
        if "error" in doc.get(part, {}):
            print(f"\n{part}: FAILED: {doc[part]['error']}")
    print(f"\nwrote {a.out.relative_to(ROOT) if a.out.is_relative_to(ROOT) else a.out} in {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
