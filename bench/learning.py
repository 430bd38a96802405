"""Learning curves at max staleness k = 0 and k = 2 on the demo's task (or another, --set task.name=...),
several seeds each.

In one process, with the demo's settings read from configs/local.toml (model size, warm start, learning
rate, task, batch, group size, sampling): the real Trainer (warm start, losses, advantages, filters) and
a plain sampler loop standing in for the workers. With staleness k, batch n is sampled by the policy of
step max(0, n - 1 - k), the oldest the coordinator's window allows (what the demo's fast workers mostly
see: its staleness histogram is dominated by k), from a separate model fed the broadcast (bf16) weights,
as a worker would be. Every `--eval-every` steps the trainer's model is evaluated as the coordinator
does (node/coordinator/evaluation.py: greedy, held-out prompts).

    .venv/bin/python bench/learning.py [--steps 60] [--seeds 3] [--quick] [--set KEY=VALUE ...]
    .venv/bin/python bench/learning.py --set task.name=reasoning-gym:spell_backward \
        --set 'task.kwargs={min_word_len=3, max_word_len=3}'

Writes bench/results/learning.json ({"rows": [...]}: one row per (task, k, seed) with the reward and eval
curves and wall-clock seconds, plus one summary row per (task, k) with its settings; rows of other tasks
are kept) and docs/learning.png for the demo's task, docs/learning-<task>.png for others (mean ± min/max).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_one(cfg, k: int, seed: int, steps: int, eval_every: int, eval_prompts: int) -> dict:
    import torch

    from node.coordinator.evaluation import Evaluator, warm_start_seed
    from node.envs import decode_completion, encode_prompt, load_task
    from node.trainer import Group, Rollout, Trainer, build_tiny_model_dir, load_tokenizer, sft_warm_start
    from node.trainer.local_sampling import sample_group
    from node.trainer.model import load_model

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        m = cfg.model
        model_dir = build_tiny_model_dir(Path(tmp) / "model", hidden_size=m.tiny_hidden_size, layers=m.tiny_layers,
                                         heads=m.tiny_heads, seed=seed)
        tcfg = cfg.trainer.model_copy(update={"seed": seed})
        trainer = Trainer(model_dir, tcfg, batch_prompts=cfg.run.batch_prompts, temperature=cfg.sampling.temperature)
        tok = load_tokenizer(model_dir)
        task = load_task(cfg.task.name, cfg.task.kwargs)
        ev = Evaluator(task=task, tokenizer=tok, run_seed=seed, prompts=eval_prompts, every_steps=eval_every,
                       max_tokens=cfg.sampling.max_tokens, batch_size=64)
        t0 = time.perf_counter()
        if tcfg.warm_start_steps:
            sft_warm_start(trainer, task, tok, steps=tcfg.warm_start_steps, lr=tcfg.warm_start_lr,
                           seed=warm_start_seed(seed))
        ev.run(trainer.model, 0)
        gen = torch.Generator().manual_seed(seed)
        # The sampler is a plain model fed the broadcast weights, as a worker's engine is: with trainer.lora the
        # trainer's model is peft-wrapped and the broadcast is merged (W + alpha/r * B@A) under the plain names.
        sampler = load_model(model_dir)
        sampler.eval()
        history = [trainer.weights_for_broadcast()]
        rewards, index = [], 0
        G, T, max_tokens, eos = cfg.run.group_size, cfg.sampling.temperature, cfg.sampling.max_tokens, tok.eos_token_id
        for _ in range(steps):
            policy = max(0, trainer.step_count - k)
            res = sampler.load_state_dict(history[policy], strict=False)
            if res.unexpected_keys or set(res.missing_keys) - {"lm_head.weight"}:  # only a tied head may be absent
                raise RuntimeError(f"broadcast weights do not fit the sampler: {res}")
            offered = []
            while not trainer.batch_complete:
                problem = task.sample(seed, index)
                index += 1
                prompt = encode_prompt(tok, problem)
                samples = sample_group(sampler, prompt, G, max_tokens, eos, gen, T)
                rs = [Rollout(completion_ids=c, inference_logprobs=lp, policy_step=policy,
                              reward=task.score(problem, decode_completion(tok, c)),
                              finish_reason="stop" if c[-1] == eos else "length") for c, lp in samples]
                offered += [r.reward for r in rs]
                trainer.add_group(Group(problem.prompt_id, prompt, rs))
            trainer.step()
            rewards.append(sum(offered) / len(offered))  # every offered rollout, as the coordinator counts
            history.append(trainer.weights_for_broadcast())
            if ev.due(trainer.step_count):
                ev.run(trainer.model, trainer.step_count)
        wall = time.perf_counter() - t0
    return {"k": k, "seed": seed, "steps": steps, "wall_seconds": round(wall, 1),
            "reward_by_step": [round(r, 4) for r in rewards],
            "eval": [{"step": e["step"], "reward": round(e["reward"], 4), "n": e["n"]} for e in ev.curve],
            "reward_last5_mean": round(sum(rewards[-5:]) / len(rewards[-5:]), 4)}


def summarize(rows: list[dict], k: int, lora_rank: int = 0) -> dict:
    mine = [r for r in rows if r["k"] == k and r.get("lora_rank", 0) == lora_rank]
    steps = min(len(r["reward_by_step"]) for r in mine)
    per_step = [[r["reward_by_step"][s] for r in mine] for s in range(steps)]
    evals = {}
    for r in mine:
        for e in r["eval"]:
            evals.setdefault(e["step"], []).append(e["reward"])
    last5 = [r["reward_last5_mean"] for r in mine]
    final_eval = [r["eval"][-1]["reward"] for r in mine]
    return {"k": k, "lora_rank": lora_rank, "summary": True, "seeds": [r["seed"] for r in mine],
            "reward_mean_by_step": [round(sum(v) / len(v), 4) for v in per_step],
            "reward_min_by_step": [min(v) for v in per_step], "reward_max_by_step": [max(v) for v in per_step],
            "eval_mean_by_step": {s: round(sum(v) / len(v), 4) for s, v in sorted(evals.items())},
            "eval_min_by_step": {s: min(v) for s, v in sorted(evals.items())},
            "eval_max_by_step": {s: max(v) for s, v in sorted(evals.items())},
            "reward_last5_mean": round(sum(last5) / len(last5), 4), "reward_last5_range": [min(last5), max(last5)],
            "final_eval_mean": round(sum(final_eval) / len(final_eval), 4),
            "final_eval_range": [min(final_eval), max(final_eval)],
            "wall_seconds_mean": round(sum(r["wall_seconds"] for r in mine) / len(mine), 1)}


def plot_path(task: str) -> Path:
    """docs/learning.png for the demo's task; docs/learning-<task>.png for any other."""
    if task == "reverse-text":
        return REPO / "docs" / "learning.png"
    return REPO / "docs" / f"learning-{re.sub(r'[^A-Za-z0-9_-]+', '-', task)}.png"


def plot(summaries: list[dict], out: Path, temperature: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120, sharey=True)
    colors = {(0, 0): "tab:blue", (2, 0): "tab:red", (0, 1): "tab:cyan", (2, 1): "tab:orange"}
    for s in summaries:
        r = s.get("lora_rank", 0)
        c = colors.get((s["k"], int(r > 0)), None)
        label = f"k = {s['k']}" + (f", LoRA r = {r}" if r else (", full" if len(summaries) > 2 else ""))
        xs = list(range(1, len(s["reward_mean_by_step"]) + 1))
        axes[0].plot(xs, s["reward_mean_by_step"], color=c, ls="--" if r else "-", label=label)
        axes[0].fill_between(xs, s["reward_min_by_step"], s["reward_max_by_step"], color=c, alpha=0.15)
        es = [int(x) for x in s["eval_mean_by_step"]]
        axes[1].plot(es, list(s["eval_mean_by_step"].values()), color=c, marker="s", ms=3, ls="--" if r else "-",
                     label=label)
        axes[1].fill_between(es, list(s["eval_min_by_step"].values()), list(s["eval_max_by_step"].values()),
                             color=c, alpha=0.15)
    n = len(summaries[0]["seeds"])
    axes[0].set_title(f"sampled rollouts (T={temperature:g}): mean, min-max of {n} seeds", fontsize=9)
    axes[1].set_title(f"held-out eval (greedy, 64 prompts): mean, min-max of {n} seeds", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("mean reward")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> int:
    import torch

    from node.config import load_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--ks", default="0,2")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--quick", action="store_true", help="2 seeds x 10 steps, results not written")
    p.add_argument("--plot-only", action="store_true", help="redraw docs/learning.png from the results file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of configs/local.toml, e.g. task.name=reasoning-gym:spell_backward")
    p.add_argument("--no-write", action="store_true", help="print the table only (for trying settings)")
    p.add_argument("--lora-ranks", default="0", help="trainer.lora.rank per variant, side by side in one run "
                   "(0 = full fine-tuning), e.g. 0,8: LoRA against full, written to bench/results/learning_lora.json and "
                   "docs/learning-lora.png")
    a = p.parse_args()
    results = REPO / "bench" / "results" / "learning.json"
    if a.plot_only:
        summaries = [r for r in json.loads(results.read_text())["rows"] if r.get("summary")]
        for task in sorted({r["task"] for r in summaries}):
            mine = [r for r in summaries if r["task"] == task]
            plot(mine, plot_path(task), mine[0]["settings"]["sampling"]["temperature"])
        return 0
    torch.set_num_threads(a.threads)
    if a.quick:
        a.steps, a.seeds = 10, 2
    ranks = [int(x) for x in a.lora_ranks.split(",")]
    cfgs = {rank: load_config(REPO / "configs" / "local.toml", [*a.set, f"trainer.lora.rank={rank}"]) for rank in ranks}
    cfg = cfgs[ranks[0]]
    task = cfg.task.name
    rows = []
    for k in (int(x) for x in a.ks.split(",")):
        for seed in range(a.seeds):
            for rank in ranks:
                r = {"task": task, "lora_rank": rank,
                     **run_one(cfgs[rank], k, seed, a.steps, a.eval_every, a.eval_prompts)}
                rows.append(r)
                print(f"k={k} seed={seed} lora={rank or 'off'}: reward {r['reward_by_step'][0]:.3f} -> last5 "
                      f"{r['reward_last5_mean']:.3f}, eval {r['eval'][0]['reward']:.3f} -> {r['eval'][-1]['reward']:.3f}, "
                      f"{r['wall_seconds']:.0f} s", flush=True)
    settings = {"model": cfg.model.model_dump(), "task": cfg.task.model_dump(), "lr": cfg.trainer.lr,
                "warm_start_steps": cfg.trainer.warm_start_steps, "batch_prompts": cfg.run.batch_prompts,
                "group_size": cfg.run.group_size, "sampling": cfg.sampling.model_dump(), "steps": a.steps,
                "torch_threads": a.threads}
    summaries = [{"task": task, "settings": {**settings, "lora": cfgs[rank].trainer.lora.model_dump()},
                  **summarize(rows, k, rank)}
                 for k in sorted({r["k"] for r in rows}) for rank in ranks]
    print(f"\n{task}\n{'k':>2} {'lora':>5} {'reward last 5 (range)':>24} {'final eval (range)':>22}"
          f" {'eval vs full':>12} {'wall s/run':>10}")
    for s in summaries:
        full = next((f for f in summaries if f["k"] == s["k"] and f["lora_rank"] == 0), None)
        vs = f"{s['final_eval_mean'] / full['final_eval_mean']:.3f}x" if full and full["final_eval_mean"] else "-"
        print(f"{s['k']:>2} {s['lora_rank'] or 'off':>5} {s['reward_last5_mean']:>8.3f} "
              f"({s['reward_last5_range'][0]:.3f}-{s['reward_last5_range'][1]:.3f})"
              f"   {s['final_eval_mean']:>8.3f} ({s['final_eval_range'][0]:.3f}-{s['final_eval_range'][1]:.3f})"
              f" {vs:>12} {s['wall_seconds_mean']:>10.1f}")
    if a.quick or a.no_write:
        return 0
    if ranks != [0]:  # a LoRA comparison: its own file, every variant from this one run
        results, kept = results.with_name("learning_lora.json"), []
    else:  # rows of the other tasks stay (one task per run); a row without a task is from before tasks were recorded
        kept = [r for r in json.loads(results.read_text())["rows"] if r.get("task") not in (task, None)] \
            if results.is_file() else []
    results.write_text(json.dumps({"rows": kept + rows + summaries}, indent=1))
    out = plot_path(task) if ranks == [0] else REPO / "docs" / "learning-lora.png"
    plot(summaries, out, cfg.sampling.temperature)
    print(f"wrote {results} and {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
