"""Rollout verification: cost relative to generation, commitment size, and threshold calibration.

Part 1 (cost): a Qwen2-style model (hidden 384, 4 layers, vocab 8192, fp32, CPU, 1 thread)
generates 256-token completions with the transformers backend (batch 8); the verifier checks them
with one batched prefill. Reported: verification / generation time per rollout (interleaved
repeats, minimum of each), commitment bytes per 32 tokens, polynomial interpolation time per chunk.

Part 2 (calibration): the tests' tiny Qwen2 generates honest rollouts in bf16 and fp32 with several
batch sizes and thread counts, verified in fp32; dishonest rollouts come from other weights (another
init, training steps of several sizes), other seeds, another temperature, forged logprobs. The
score distributions against the default thresholds go to docs/verify_calibration.png.

Run: .venv/bin/python bench/verify_cost.py [--quick]   -> bench/results/verify_cost.json
"""
from __future__ import annotations

import argparse
import base64
import copy
import json
import platform
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from node.worker.backends.base import GenRequest  # noqa: E402
from node.worker.backends.transformers_backend import TransformersBackend  # noqa: E402
from verify.commitment import TOPK, interpolate  # noqa: E402
from verify.rollouts import RolloutClaim, RolloutVerifier, Thresholds, VerifyItem  # noqa: E402

EOS_NEVER = -1  # an id no sampler emits: every cost-benchmark completion runs to max_tokens


def qwen2(seed: int, *, hidden: int, layers: int, vocab: int, init: float):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=max(4, hidden // 64), num_key_value_heads=max(2, hidden // 128),
                      max_position_embeddings=1024, initializer_range=init, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def items(prompts, seeds, results, temperature, top_p, max_tokens, eos):
    return [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s, temperature,
                       top_p, max_tokens, eos) for p, s, r in zip(prompts, seeds, results)]


# --- part 1: cost -----------------------------------------------------------------------------------

def real_prompts(tokenizer, n_prompts: int, samples: int) -> list[list[int]]:
    """`samples` copies of each of `n_prompts` reasoning-gym prompts through the real chat template (a group)."""
    from node.envs import load_task
    from node.envs.prompt import encode_prompt

    task = load_task("reasoning-gym:basic_arithmetic", {})
    return [encode_prompt(tokenizer, task.sample(0, i)) for i in range(n_prompts) for _ in range(samples)]


def bench_cost(n_rollouts: int, max_tokens: int, repeats: int, *, real: str | None = None, samples: int = 1) -> dict:
    """Random-weight Qwen2 with random 64-token prompts, or (`real`: a model directory) the real model with
    reasoning-gym prompts, `samples` rollouts per prompt (the coordinator's groups: they share the prompt)."""
    if real:
        from node.trainer.model import load_model
        from node.trainer.tokenizer import load_tokenizer

        model = load_model(real, dtype="float32")
        prompts = real_prompts(load_tokenizer(real), n_rollouts // samples, samples)
        name = f"{Path(real).name} (SmolLM2-135M-Instruct, vocab 49152), fp32, CPU, {samples} samples per prompt"
    else:
        model = qwen2(0, hidden=384, layers=4, vocab=8192, init=0.05)
        rng = random.Random(0)
        prompts = [[rng.randrange(8192) for _ in range(64)] for _ in range(n_rollouts)]
        name = "Qwen2 hidden 384, 4 layers, vocab 8192, fp32, CPU"
    seeds = list(range(n_rollouts))
    backend = TransformersBackend(model, dtype="float32", device="cpu", max_batch_size=n_rollouts)
    verifier = RolloutVerifier(backend.model)
    reqs = [GenRequest(p, s) for p, s in zip(prompts, seeds)]
    its: list = []

    def generate():
        nonlocal its
        out = backend.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=max_tokens, eos_token_id=EOS_NEVER)
        its = items(prompts, seeds, out, 1.0, 1.0, max_tokens, EOS_NEVER)
        return out

    def verify():
        verdicts = verifier.verify_many(its)
        assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok][:1]

    backend.generate(reqs[:1], temperature=1.0, top_p=1.0, max_tokens=4, eos_token_id=EOS_NEVER)  # warm-up
    # Interleaved repeats, minimum of each: other processes on a shared machine only ever add time.
    gen_times, ver_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = generate()
        gen_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        verify()
        ver_times.append(time.perf_counter() - t0)
    gen_s, ver_s = min(gen_times), min(ver_times)
    raw = [len(base64.b64decode(r.commitment)) for r in results]
    tokens = sum(len(r.completion_ids) for r in results)
    # Interpolation alone, k = 128 points at the largest field prime.
    xs = np.random.default_rng(0).choice(65521, TOPK, replace=False)
    ys = np.random.default_rng(1).integers(0, 57000, TOPK)
    interpolate(xs, ys, 65521)
    t0 = time.perf_counter()
    for _ in range(50):
        interpolate(xs, ys, 65521)
    interp_ms = (time.perf_counter() - t0) / 50 * 1e3
    return {
        "model": name,
        "rollouts": n_rollouts, "completion_tokens": max_tokens,
        "prompt_tokens": sum(len(p) for p in prompts) / len(prompts),
        "generation_s_per_rollout": gen_s / n_rollouts, "verification_s_per_rollout": ver_s / n_rollouts,
        "verify_over_generate": ver_s / gen_s,
        "commitment_bytes_per_32_tokens": sum(raw) / tokens * 32, "commitment_bytes_per_token": sum(raw) / tokens,
        "interpolation_ms_per_chunk": interp_ms, "torch_threads": torch.get_num_threads(),
        "repeats": repeats, "generation_s_all": gen_times, "verification_s_all": ver_times,
    }


# --- part 2: calibration ----------------------------------------------------------------------------

TINY = dict(hidden=64, layers=2, vocab=96, init=0.2)
EOS, MAXT = 2, 24


def training_step(model, lr: float):
    model = copy.deepcopy(model).train()
    batch = torch.randint(0, TINY["vocab"], (8, 32), generator=torch.Generator().manual_seed(7))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    return model.eval()


@torch.no_grad()
def relative_change(a, b) -> float:
    """||theta_b - theta_a|| / ||theta_a|| over all parameters."""
    num = sum((pa - pb).float().pow(2).sum() for pa, pb in zip(a.parameters(), b.parameters()))
    den = sum(pa.float().pow(2).sum() for pa in a.parameters())
    return float((num / den).sqrt())


def gen(model, prompts, seeds, *, dtype="bfloat16", batch=16, threads=None, temperature=1.0, top_p=1.0):
    be = TransformersBackend(copy.deepcopy(model), dtype=dtype, device="cpu", max_batch_size=batch)
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        return be.generate([GenRequest(p, s) for p, s in zip(prompts, seeds)], temperature=temperature, top_p=top_p,
                           max_tokens=MAXT, eos_token_id=EOS)
    finally:
        torch.set_num_threads(old)


def bench_calibration(n: int) -> dict:
    base = qwen2(0, **TINY)
    verifier = RolloutVerifier(copy.deepcopy(base).float())
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY["vocab"]) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    seeds = list(range(n))
    groups: dict[str, list[dict]] = {}
    reasons: dict[str, dict] = {}

    def run(name, results, *, temperature=1.0, top_p=1.0, claimed_seeds=None):
        vs = verifier.verify_many(items(prompts, claimed_seeds or seeds, results, temperature, top_p, MAXT, EOS))
        groups[name] = [v.scores for v in vs]
        counts: dict[str, int] = {}
        for v in vs:
            counts[v.reason or "accepted"] = counts.get(v.reason or "accepted", 0) + 1
        reasons[name] = counts

    honest_cfgs = [("bfloat16", 1, 1, 1.0, 1.0), ("bfloat16", 16, 2, 1.0, 1.0), ("bfloat16", 7, 1, 0.8, 0.9),
                   ("float32", 16, 2, 1.0, 1.0)]
    for dtype, batch, threads, temperature, top_p in honest_cfgs:
        run(f"honest {dtype} b{batch} t{threads} T{temperature} p{top_p}",
            gen(base, prompts, seeds, dtype=dtype, batch=batch, threads=threads, temperature=temperature,
                top_p=top_p), temperature=temperature, top_p=top_p)
    honest_bf16 = gen(base, prompts, seeds)
    step_sizes = {}
    for lr in (3e-4, 1e-3, 2e-3, 5e-3):
        stepped = training_step(base, lr)
        step_sizes[f"{lr:g}"] = relative_change(base, stepped)
        run(f"next step (AdamW lr {lr:g})", gen(stepped, prompts, seeds))
    run("other model", gen(qwen2(1, **TINY), prompts, seeds))
    run("other seed", gen(base, prompts, [s + 10_000 for s in seeds]))
    run("temperature 0.6", gen(base, prompts, seeds, temperature=0.6))
    run("logprobs x0.75", [replace(r, logprobs=[x * 0.75 for x in r.logprobs]) for r in honest_bf16])
    return {"scores": groups, "verdicts": reasons, "relative_weight_change": step_sizes}


def plot(calib: dict, thresholds: Thresholds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("commitment_ratio", 1.0, "TOPLOC worst chunk statistic / its limit"),
              ("exp_mismatch_frac", thresholds.exp_mismatch_frac, "TOPLOC exponent mismatches (fraction)"),
              ("logprob_mean", thresholds.logprob_mean, "mean |logprob deviation| (nats)"),
              ("sample_margin_max", thresholds.sample_margin, "max sampling replay margin")]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    names = list(calib["scores"])
    colors = {n: ("tab:green" if n.startswith("honest") else None) for n in names}
    for ax, (key, thr, title) in zip(axes.flat, panels):
        for i, name in enumerate(names):
            xs = np.array([s[key] for s in calib["scores"][name]], dtype=float)
            ys = np.full_like(xs, i) + np.random.default_rng(i).uniform(-0.3, 0.3, len(xs))
            ax.scatter(np.maximum(xs, 1e-4), ys, s=6, alpha=0.6, color=colors[name] or f"C{i % 10}")
        ax.axvline(thr, color="red", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if ax in axes[:, 0] else [], fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.suptitle("Honest (green) vs dishonest rollout scores; red dashed = acceptance threshold; 0 drawn at 1e-4")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rollouts (smoke run)")
    ap.add_argument("--real", action="store_true", help="cost only: the random-weight model and the real one "
                    "(node/real_model.py) side by side, same shapes -> bench/results/verify_cost_real.json")
    ap.add_argument("--real-rollouts", type=int, default=8)
    ap.add_argument("--real-samples", type=int, default=8, help="rollouts per prompt in --real")
    ap.add_argument("--real-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.real:
        return main_real(args)
    # Cost at one thread: with two threads on a shared 2-core machine, decoding (thousands of tiny ops,
    # each a thread barrier) slows down by 3-15x under other load while one big prefill barely does.
    torch.set_num_threads(1)
    cost = bench_cost(n_rollouts=4 if args.quick else 8, max_tokens=64 if args.quick else 256,
                      repeats=1 if args.quick else 3)
    torch.set_num_threads(2)
    calib = bench_calibration(n=32 if args.quick else 128)
    th = Thresholds()
    summary = {}
    for name, scores in calib["scores"].items():
        summary[name] = {k: {"median": float(np.median([s[k] for s in scores])), "max": float(max(s[k] for s in scores))}
                         for k in ("logprob_mean", "logprob_max", "sample_margin_max", "exp_mismatch_frac",
                                   "mant_err_mean", "mant_err_median", "commitment_ratio")}
    out = {"bench": "verify_cost", "quick": args.quick, "host": platform.processor() or platform.machine(),
           "torch": torch.__version__, "cost": cost, "thresholds": asdict(th),
           "calibration": {"verdicts": calib["verdicts"], "score_summary": summary,
                           "relative_weight_change": calib["relative_weight_change"]}}
    res = ROOT / "bench" / "results" / "verify_cost.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps(out, indent=2) + "\n")
    plot(calib, th, ROOT / "docs" / "verify_calibration.png")

    print(f"{'metric':44s} value")
    for k in ("generation_s_per_rollout", "verification_s_per_rollout", "verify_over_generate",
              "commitment_bytes_per_32_tokens", "commitment_bytes_per_token", "interpolation_ms_per_chunk"):
        print(f"{k:44s} {cost[k]:.4f}")
    print(f"\n{'rollouts':44s} verdicts")
    for name, counts in calib["verdicts"].items():
        print(f"{name:44s} {counts}")
    print(f"\nwrote {res.relative_to(ROOT)} and docs/verify_calibration.png")
    return 0


def main_real(args) -> int:
    """Verification / generation cost on the real model beside the random-weight one, in one run, same shapes."""
    from node.real_model import model_dir

    torch.set_num_threads(1)  # as in main(): decoding's tiny ops under other load (see there)
    n, t, reps = args.real_rollouts, args.real_tokens, 1 if args.quick else 2
    rows = {"random-weight Qwen2": bench_cost(n, t, reps),
            "SmolLM2-135M-Instruct": bench_cost(n, t, reps, real=str(model_dir()), samples=args.real_samples)}
    out = {"bench": "verify_cost_real", "host": platform.processor() or platform.machine(), "torch": torch.__version__,
           "cost": rows}
    res = ROOT / "bench" / "results" / "verify_cost_real.json"
    res.write_text(json.dumps(out, indent=2) + "\n")
    keys = ("prompt_tokens", "generation_s_per_rollout", "verification_s_per_rollout", "verify_over_generate",
            "commitment_bytes_per_32_tokens")
    print(f"{'model':24s}" + "".join(f"{k:>30s}" for k in keys))
    for name, c in rows.items():
        print(f"{name:24s}" + "".join(f"{c[k]:>30.4f}" for k in keys))
    print(f"{n} rollouts x {t} tokens, 1 thread; wrote {res.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
