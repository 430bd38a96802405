"""Training throughput: padded batches vs packed rows vs packed rows with the shared-prompt mask.

Each configuration trains full steps (forward, backward, AdamW) of the real Trainer on the same
groups: `--groups` prompts of P tokens, each with G completions of C tokens. Throughput is counted
in completion (loss) tokens per second, the tokens that carry a training signal; the padded layout
recomputes the shared prompt G times, the shared-prompt layout once.

    .venv/bin/python bench/trainer_packing.py            # writes bench/results/trainer_packing.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from node.trainer import Group, Rollout, Trainer, build_tiny_model_dir
from node.trainer.config import FiltersConfig, TrainerConfig

LAYOUTS = ("padded", "packed", "shared_prompt")


def make_groups(n: int, prompt_len: int, g: int, completion_len: int, vocab: int, seed: int,
                prefix: str = "") -> list[Group]:
    """n groups of g random rollouts (rewards alternate 0/1), prompt ids `{prefix}g{i}`."""
    rng = random.Random(seed)
    groups = []
    for i in range(n):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        rollouts = [Rollout([rng.randrange(5, vocab) for _ in range(completion_len)], [-3.0] * completion_len,
                            reward=float(j % 2)) for j in range(g)]
        groups.append(Group(f"{prefix}g{i}", prompt, rollouts))
    return groups


def one_step(trainer: Trainer, groups: list[Group]) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of this process, step metrics) of one full training step."""
    t0, c0 = time.perf_counter(), time.process_time()
    for g in groups:
        trainer.add_group(g)
    metrics = trainer.step()
    return time.perf_counter() - t0, time.process_time() - c0, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--groups", type=int, default=2, help="groups (prompts) per training step")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/trainer_packing.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = build_tiny_model_dir(Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden,
                                     layers=args.layers, heads=args.heads, seed=0, max_positions=4096)
    rows = []
    warmed: set[str] = set()
    for prompt_len in args.prompts:
        trainers = {layout: Trainer(model_dir, TrainerConfig(packing=layout, micro_batch_tokens=args.micro_batch_tokens,
                                                             filters=FiltersConfig(enabled=[])),
                                    batch_prompts=args.groups) for layout in LAYOUTS}
        groups = make_groups(args.groups, prompt_len, args.group_size, args.completion,
                             trainers["padded"].vocab_size, seed=1)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        cpu: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        computed: dict[str, int] = {}
        # One warm-up step per layout (allocator, kernels) on the first, smallest workload; then
        # interleaved repetitions, so load from anything else on the machine hits every layout alike;
        # the fastest of each is compared (medians are recorded too).
        for layout in LAYOUTS:
            if layout not in warmed:
                one_step(trainers[layout], groups)
                warmed.add(layout)
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                seconds, cpu_seconds, metrics = one_step(trainers[layout], groups)
                computed[layout] = metrics["tokens_processed"]  # tokens through the model, padding included
                times[layout].append(seconds)
                cpu[layout].append(cpu_seconds)
        loss_tokens = args.groups * args.group_size * args.completion
        # The fastest repetition is the one least disturbed by other processes on a shared machine.
        base = loss_tokens / min(times["padded"])
        base_cpu = loss_tokens / min(cpu["padded"])
        for layout in LAYOUTS:
            step_s = min(times[layout])
            tps = loss_tokens / step_s
            tpcs = loss_tokens / min(cpu[layout])  # CPU time is far less disturbed by other jobs
            rows.append({"prompt_len": prompt_len, "layout": layout, "step_seconds": step_s,
                         "step_seconds_median": statistics.median(times[layout]),
                         "step_seconds_all": times[layout], "loss_tokens_per_step": loss_tokens,
                         "computed_tokens_per_step": computed[layout], "loss_tokens_per_s": tps,
                         "vs_padded": tps / base, "cpu_seconds": min(cpu[layout]), "cpu_seconds_all": cpu[layout],
                         "loss_tokens_per_cpu_s": tpcs, "vs_padded_cpu": tpcs / base_cpu})
            print(f"P={prompt_len:5d} {layout:14s} {step_s:7.2f} s/step {tps:9.1f} loss tok/s  x{tps / base:.2f} "
                  f"| {tpcs:8.1f} loss tok/cpu-s x{tpcs / base_cpu:.2f} ({computed[layout]} tokens computed)",
                  flush=True)
    print()
    print(f"{'prompt':>6} | {'layout':14} | {'computed':>8} | {'s/step':>7} | {'loss tok/s':>10} | {'vs padded':>9} | "
          f"{'tok/cpu-s':>9} | {'vs padded':>9}")
    print("-" * 97)
    for r in rows:
        print(f"{r['prompt_len']:>6} | {r['layout']:14} | {r['computed_tokens_per_step']:>8} | "
              f"{r['step_seconds']:7.2f} | {r['loss_tokens_per_s']:10.1f} | {r['vs_padded']:8.2f}x | "
              f"{r['loss_tokens_per_cpu_s']:9.1f} | {r['vs_padded_cpu']:8.2f}x")
    result = {
        "benchmark": "trainer_packing",
        "model": {"arch": "llama", "hidden": args.hidden, "layers": args.layers, "heads": args.heads},
        "workload": {"groups_per_step": args.groups, "group_size": args.group_size,
                     "completion_len": args.completion, "micro_batch_tokens": args.micro_batch_tokens,
                     "repeats": args.repeats},
        "machine": {"cpu_threads": args.threads, "torch": torch.__version__, "platform": platform.platform(),
                    "device": "cpu"},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
