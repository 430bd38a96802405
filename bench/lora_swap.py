"""LoRA adapter swap per step and generation with the adapter merged vs unmerged (issue #29, Workers), side by side in
one run, in each backend: worker.lora_serving = "merged" (the fetcher merges the adapter into the pinned base and
writes a full payload, the engine reloads every weight) against "adapter" (the engine keeps the base, the adapter is
rebuilt from the step's verified shards and applied unmerged: forward hooks in transformers, vLLM's own LoRA support).

A real Trainer with trainer.lora on the real SmolLM2-135M-Instruct (node/real_model.py; `--tiny` for the test model)
publishes step 0 full and steps 1..S as signed `lora-adapter` checkpoints (node/coordinator/publisher.py), then for
each backend:
  swap, merged:  merge_adapter_payload (what node/worker/fetcher.py does) + load_payload of the merged payload;
  swap, adapter: rebuild + verify the adapter from its shards (what the fetcher of a worker serving adapters
                 commits, node/checkpoint_dir.py `unmerged_adapters`; it no longer merges them) + load_adapter;
each swap timed alone, and the 1-token probe generate after it beside it (vLLM activates an adapter at its first use,
the worker probes after every swap). vLLM at two max_lora_rank values (its CPU ops pad every token's adapter to it).
Generation:
the same requests with step S merged and unmerged, alternated `--repeats` times, tokens/s and the largest |dlogprob|
between the two forms. transformers runs first: vLLM's CPU engine drops torch to one thread for the whole process.
Heavy (minutes): `flock /tmp/heavy.lock nice .venv-vllm/bin/python bench/lora_swap.py` (the vLLM venv has both
engines; with .venv only transformers is measured). Writes bench/results/lora_swap.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def publish_run(work: Path, *, tiny: bool, rank: int, alpha: int, steps: int):
    """Steps 0..steps of a real LoRA run, published into a CheckpointDir; returns (store, model config dir, name)."""
    from node.checkpoint_dir import CheckpointDir
    from node.coordinator.publisher import Publisher
    from node.trainer import Trainer
    from node.trainer.config import TrainerConfig
    from node.trainer.model import build_tiny_model_dir
    from protocol.identity import Identity
    from tests.unit.test_trainer_step import make_groups, train_batches

    if tiny:
        src, name = build_tiny_model_dir(work / "tiny", hidden_size=128, layers=2, heads=4, seed=11), "tiny Qwen2"
    else:
        from node.real_model import model_dir

        src, name = model_dir(download=False), "SmolLM2-135M-Instruct"
    trainer = Trainer(src, TrainerConfig(lr=1e-3, broadcast_dtype="bfloat16", lora=dict(rank=rank, alpha=alpha)),
                      batch_prompts=4)
    store = CheckpointDir(work / "coord")
    pub = Publisher(store, Identity.generate(), "bench", async_level=steps + 1, shard_size=32 << 20, level=3,
                    full_every=10 ** 6)
    for step in range(steps + 1):
        if step:
            train_batches(trainer, [make_groups(4, seed=100 + step)])
        pub.publish(step, trainer.weights_for_broadcast(), adapter=trainer.adapter_for_broadcast())
    config_dir = work / "model"  # what a worker holds: the config, no weights (the engine starts from step 0)
    config_dir.mkdir()
    shutil.copy(Path(src) / "config.json", config_dir / "config.json")
    return store, config_dir, name


def worker_merge(store, step: int, out: Path) -> float:
    """What the fetcher does for an adapter step: rebuild the adapter payload, merge it into the base, write it."""
    from protocol.checkpoint import DirShardReader, merge_adapter_payload, reconstruct_payload

    m, base = store.manifest(step), store.manifest(0)
    t0 = time.perf_counter()
    adapter = out.with_suffix(".adapter")
    reconstruct_payload(m, DirShardReader(store.step_dir(step), m), adapter)
    merge_adapter_payload(m, adapter, base, store.payload_path(0), out)
    adapter.unlink()
    return time.perf_counter() - t0


def measure(backend_name: str, store, config_dir: Path, work: Path, *, dtype: str, steps: int, requests, sampling,
            repeats: int, max_lora_rank: int | None = None) -> dict:
    from node.worker.backends import GenRequest, LoraAdapter, start_backend

    base_hash, base_payload = store.manifest(0).canonical_hash(), store.payload_path(0)
    probe = [GenRequest([1, 2, 3, 4], 1)]
    label = backend_name if max_lora_rank is None else f"{backend_name}-r{max_lora_rank}"
    model_dir = work / f"model-{label}"
    shutil.copytree(config_dir, model_dir)
    t0 = time.perf_counter()
    be = start_backend(backend_name, model_dir, base_payload, 0, dtype=dtype, device="cpu", base=base_hash,
                       lora_serving="adapter", vllm=None if max_lora_rank is None else {"max_lora_rank": max_lora_rank})
    start_s = time.perf_counter() - t0

    probe_s: dict[str, list[float]] = {"merged": [], "adapter": []}

    def swapped(fn, form: str) -> float:
        """The swap's own time; the 1-token probe after it (where vLLM activates an adapter) kept beside it."""
        t = time.perf_counter()
        fn()
        loaded = time.perf_counter()
        be.generate(probe, temperature=1.0, top_p=1.0, max_tokens=1, eos_token_id=0)
        probe_s[form].append(time.perf_counter() - loaded)
        return loaded - t

    merged = {s: work / f"merged-{label}-{s}.safetensors" for s in range(1, steps + 1)}
    merge_s = [worker_merge(store, s, merged[s]) for s in merged]
    reload_s = [swapped(lambda s=s: be.load_payload(merged[s], s), "merged") for s in merged]
    be.load_payload(base_payload, 0, base=base_hash)
    rebuild_s, load_s = [], []
    for s in merged:
        t = time.perf_counter()
        adapter = LoraAdapter.from_store(store, s)
        rebuild_s.append(time.perf_counter() - t)
        load_s.append(swapped(lambda s=s, a=adapter: be.load_adapter(a, s), "adapter"))

    last, adapter = steps, LoraAdapter.from_store(store, steps)
    tps: dict[str, list[float]] = {"merged": [], "adapter": []}
    out: dict[str, list] = {}
    be.generate(requests, **sampling)  # warm-up (first-call allocations), untimed
    for _ in range(repeats):  # alternated, so drift in the machine's load hits both forms alike
        for form in ("merged", "adapter"):
            if form == "merged":
                be.load_payload(merged[last], last)
            else:
                be.load_payload(base_payload, 0, base=base_hash)
                be.load_adapter(adapter, last)
            t = time.perf_counter()
            res = be.generate(requests, **sampling)
            tps[form].append(sum(len(r.completion_ids) for r in res) / (time.perf_counter() - t))
            out[form] = res
    same = [a.completion_ids == b.completion_ids for a, b in zip(out["merged"], out["adapter"])]
    gap = max((abs(x - y) for a, b, ok in zip(out["merged"], out["adapter"], same) if ok
               for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    med = statistics.median
    return {"backend": label, "dtype": dtype, "max_lora_rank": max_lora_rank, "engine_start_s": round(start_s, 2),
            "swap_merged_s": round(med(merge_s) + med(reload_s), 3), "fetcher_merge_s": round(med(merge_s), 3),
            "engine_reload_s": round(med(reload_s), 3),
            "swap_adapter_s": round(med(rebuild_s) + med(load_s), 3), "adapter_rebuild_s": round(med(rebuild_s), 3),
            "engine_adapter_load_s": round(med(load_s), 3),
            "swap_speedup": round((med(merge_s) + med(reload_s)) / (med(rebuild_s) + med(load_s)), 1),
            "tokens_per_s_merged": round(med(tps["merged"]), 1), "tokens_per_s_adapter": round(med(tps["adapter"]), 1),
            "adapter_over_merged_speed": round(med(tps["adapter"]) / med(tps["merged"]), 3),
            "token_identical": f"{sum(same)}/{len(same)}", "max_abs_dlogprob_identical": round(gap, 4),
            "probe_after_merged_s": round(med(probe_s["merged"]), 3),
            "probe_after_adapter_s": round(med(probe_s["adapter"]), 3),
            "tokens_per_s_all": tps, "swaps": {"merge": merge_s, "reload": reload_s, "rebuild": rebuild_s,
                                               "load": load_s, "probe": probe_s}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of SmolLM2-135M")
    ap.add_argument("--backends", default="transformers,vllm")
    # vLLM's CPU LoRA ops gather each token's adapter padded to max_lora_rank: measured at the adapter's own rank
    # and at the worker's default (node/worker/config.py)
    ap.add_argument("--vllm-max-lora-ranks", default="16,32")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_swap.json"))
    args = ap.parse_args()

    import random

    from node.worker.backends import GenRequest

    work = Path(tempfile.mkdtemp(prefix="lora-swap-"))
    try:
        t0 = time.perf_counter()
        store, config_dir, name = publish_run(work, tiny=args.tiny, rank=args.rank, alpha=args.alpha,
                                              steps=args.steps)
        print(f"published steps 0..{args.steps} of {name} in {time.perf_counter() - t0:.0f} s", flush=True)
        vocab = json.loads((config_dir / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        requests = [GenRequest([rng.randrange(1, vocab) for _ in range(32)], 1000 + i) for i in range(args.prompts)]
        # EOS never sampled in practice (a token id the prompts avoid is as likely as any other): fixed-length work
        sampling = dict(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, eos_token_id=0)
        rows = []
        for b in args.backends.split(","):
            if b == "vllm":
                try:
                    import vllm  # noqa: F401
                except ImportError:
                    print("vllm: not installed in this venv (run with .venv-vllm/bin/python); skipped")
                    continue
            dtype = "float32"  # the CPU's dtype (vLLM's CPU bf16 ran at 31 tokens/s here against 88 in fp32)
            ranks = [int(r) for r in args.vllm_max_lora_ranks.split(",")] if b == "vllm" else [None]
            for rank in ranks:
                rows.append(measure(b, store, config_dir, work, dtype=dtype, steps=args.steps, requests=requests,
                                    sampling=sampling, repeats=args.repeats, max_lora_rank=rank))
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("tokens_per_s_all", "swaps")}),
                      flush=True)
        adapter_mb = store.manifest(args.steps).compressed_size / 1e6
        full_mb = store.manifest(0).compressed_size / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{name}, rank {args.rank}, alpha {args.alpha}; step {args.steps}'s adapter {adapter_mb:.2f} MB vs the "
          f"full step 0 {full_mb:.1f} MB compressed; {args.prompts} prompts x {args.max_tokens} tokens")
    print(f"{'backend':>12} {'dtype':>8} {'swap merged s':>13} {'(merge+reload)':>15} {'swap adapter s':>14} "
          f"{'(rebuild+load)':>15} {'speedup':>7} {'tok/s merged':>12} {'tok/s adapter':>13} {'ratio':>6} "
          f"{'identical':>9} {'max|dlp|':>8}")
    for r in rows:
        print(f"{r['backend']:>12} {r['dtype']:>8} {r['swap_merged_s']:>13} "
              f"{r['fetcher_merge_s']:>7}+{r['engine_reload_s']:<7} {r['swap_adapter_s']:>14} "
              f"{r['adapter_rebuild_s']:>7}+{r['engine_adapter_load_s']:<7} {r['swap_speedup']:>7} "
              f"{r['tokens_per_s_merged']:>12} {r['tokens_per_s_adapter']:>13} {r['adapter_over_merged_speed']:>6} "
              f"{r['token_identical']:>9} {r['max_abs_dlogprob_identical']:>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": name, "rank": args.rank, "alpha": args.alpha, "steps": args.steps,
                                          "prompts": args.prompts, "max_tokens": args.max_tokens,
                                          "adapter_mb": round(adapter_mb, 3), "full_mb": round(full_mb, 1),
                                          "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
