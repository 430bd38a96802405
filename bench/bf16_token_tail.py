"""The tail of honest bf16 logprob noise, per token, against the fp32 replay: how far one honest token strays.

The verifier's `Thresholds.logprob_max` (0.6 in logit units) bounds a completion's worst single token. CI's
real-model lane once banned an honest transformers-bf16 node on the CPU for one token at 0.648 (its mean 0.031,
commitment 0.31 of its limit), on weights one or two RL steps on; bench/verify_vllm_bf16.py saw at most 0.414 on
vLLM-on-CPU (8,157 tokens). This bench measures many more honest tokens, on the node's own evidence path
(TransformersBackend: seeded sampler, logprobs, commitments), and where each lands:

  engines   transformers bf16 on the CPU (the flake's) and, where CUDA is present, on the GPU (home GPU nodes)
  policies  the pretrained weights and the same after 1 and 2 AdamW steps at lr 2e-5 (the real run's optimiser)
  prompts   mental-math as configs/real.toml (T 1, 24 tokens) and chat prompts at T 1 / 0.8 (top-p 0.9) / 0.6

Every rollout is replayed by RolloutVerifier in fp32 (on the CPU as the coordinator does, or on the GPU with
TF32 off for speed: the two fp32 replays differ by ~1e-5, the bf16 noise by ~1e-1). Printed and written:
per-token deviation by the fp32 logprob of the chosen token (count, p99, p99.9, max), the rollouts each
verdict class holds under the current thresholds (passed / failed and banned / failed but voided as a single-
token outlier), and the 20 worst tokens.

Run: .venv/bin/python bench/bf16_token_tail.py [--engines cpu,cuda] [--rollouts 96] [--verify-device cuda] [--quick]
     -> bench/results/bf16_token_tail.json; with --long N --only-long, N rollouts of up to 512 tokens alone
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from bench.verify_vllm_bf16 import mental_math_prompts, token_table
from tests.integration.test_real_cuda import QUESTIONS, chat_prompts
from node.worker.backends.base import GenRequest
from node.worker.backends.transformers_backend import TransformersBackend
from verify.rollouts import RolloutClaim, RolloutVerifier, Thresholds, VerifyItem

# (name, temperature, top_p, max_tokens)
CONDITIONS = [("mental-math T1", 1.0, 1.0, 24), ("chat T1", 1.0, 1.0, 32), ("chat T0.8 p0.9", 0.8, 0.9, 32),
              ("chat T0.6", 0.6, 1.0, 32)]
# --long: the realistic completion length (a submission of 8 x 16 x 512 tokens): does the noise grow with the
# position (bf16 rounding accumulating through the KV cache), and how does the worst of 16 chunks' commitment fare?
LONG = ("long T1", 1.0, 1.0, 512)
LONG_QUESTIONS = ["Write a long story about a {a}-year-old sailor and a lighthouse.",
                  "Explain in detail, step by step, how to multiply {a} by {b} by hand, then check the result.",
                  "Write a detailed essay about the history of the number {a}.",
                  "Describe a walk through a city you invent, street by street, with at least {a} details."]
POSITIONS = [(0, 64), (64, 256), (256, 512)]
BUCKETS = [(-1.0, 0.0, "> -1"), (-2.0, -1.0, "-1..-2"), (-4.0, -2.0, "-2..-4"), (-8.0, -4.0, "-4..-8"),
           (float("-inf"), -8.0, "< -8")]  # (above, at most, name): the fp32 logprob of the chosen token


def rl_steps(model, steps: int, broadcast: str, lr: float = 2e-5):
    """`steps` AdamW steps on a next-token loss over the model's own vocabulary (weights as the run moves them),
    then cast to `broadcast` and back to fp32, as the trainer publishes them (trainer.broadcast_dtype): nodes and
    the verifier then hold the same values, whatever dtype each computes in."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        batch = torch.randint(0, model.config.vocab_size, (8, 48), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, broadcast)).float())
    return model.eval()


def measure(engine: str, verify_device: str, policy, tok, eos: int, n: int, seed: int,
            conditions: list[tuple[str, float, float, int]]) -> list[dict]:
    """One engine and policy: n rollouts per condition, each replayed in fp32; per rollout its token rows."""
    backend = TransformersBackend(copy.deepcopy(policy), dtype="bfloat16", device=engine, max_batch_size=64)
    fp32 = copy.deepcopy(policy).to(verify_device).float().eval()
    verifier = RolloutVerifier(fp32)
    out = []
    for ci, (name, temperature, top_p, max_tokens) in enumerate(conditions):
        prompts = mental_math_prompts(tok, n // 8, 8, seed + ci) if name.startswith("mental") \
            else chat_prompts(tok, n, seed + ci, LONG_QUESTIONS if name.startswith("long") else QUESTIONS)
        seeds = [seed * 1000 + ci * 100_000 + i for i in range(len(prompts))]
        t0 = time.perf_counter()
        res = backend.generate([GenRequest(p, s) for p, s in zip(prompts, seeds)], temperature=temperature,
                               top_p=top_p, max_tokens=max_tokens, eos_token_id=eos)
        gen_s = time.perf_counter() - t0
        items = [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s,
                            temperature, top_p, max_tokens, eos) for p, s, r in zip(prompts, seeds, res)]
        verdicts = verifier.verify_many(items)
        tables = token_table(fp32, items)
        for it, v, tab in zip(items, verdicts, tables):
            scale = temperature if temperature > 0 else 1.0
            dev = [(max(lo - s, 0) + max(s - hi, 0)) * scale
                   for s, lo, hi in zip(it.rollout.logprobs, tab["lp_lo"], tab["lp_hi"])]
            row = {"condition": name, "tokens": len(dev), "ok": v.ok, "reason": v.reason, "outlier": v.outlier,
                   "dev": dev, "fp32": tab["lp_hi"], "p": tab["p"], "rank": tab["rank"], "gen_s": gen_s,
                   "commitment_ratio": v.scores.get("commitment_ratio", 0.0),
                   "mean_ratio": v.scores.get("logprob_mean", 0.0) / verifier.thresholds.logprob_mean_limit(
                       max(len(dev) - 1, 1))}
            if not v.ok:  # in full: what it takes to replay it elsewhere
                row["failure"] = {"scores": v.scores, "seed": it.seed, "temperature": temperature, "top_p": top_p,
                                  "max_tokens": max_tokens, "prompt_ids": it.prompt_ids,
                                  "completion_ids": it.rollout.completion_ids, "logprobs": it.rollout.logprobs,
                                  "finish_reason": it.rollout.finish_reason, "commitment": it.rollout.commitment}
            out.append(row)
    return out


def summarize(rows: list[dict]) -> dict:
    toks = [(d, lp, p, r) for row in rows for d, lp, p, r in zip(row["dev"], row["fp32"], row["p"], row["rank"])]
    by_bucket = {}
    for lo, hi, name in BUCKETS:
        ds = sorted(d for d, lp, _, _ in toks if lo < lp <= hi)
        if ds:
            by_bucket[name] = {"tokens": len(ds), "p99": ds[int(0.99 * (len(ds) - 1))],
                               "p999": ds[int(0.999 * (len(ds) - 1))], "max": ds[-1],
                               "over_0.6": sum(d > 0.6 for d in ds)}
    by_position = {}
    for lo, hi in POSITIONS:
        ds = sorted(d for row in rows for d in row["dev"][lo:hi])
        if ds:
            by_position[f"{lo}-{hi - 1}"] = {"tokens": len(ds), "p99": ds[int(0.99 * (len(ds) - 1))],
                                             "p999": ds[int(0.999 * (len(ds) - 1))], "max": ds[-1],
                                             "over_0.6": sum(d > 0.6 for d in ds)}
    failed = [r for r in rows if not r["ok"]]
    return {"rollouts": len(rows), "tokens": len(toks), "passed": len(rows) - len(failed),
            "failed_ban": sum(not r["outlier"] for r in failed), "failed_outlier": sum(r["outlier"] for r in failed),
            "reasons": sorted({str(r["reason"]) for r in failed}), "by_fp32_logprob": by_bucket,
            "by_position": by_position, "worst_commitment_ratio": max(r["commitment_ratio"] for r in rows),
            "worst_mean_ratio": max(r["mean_ratio"] for r in rows),
            "failures": [dict(r["failure"], reason=r["reason"], outlier=r["outlier"], dev=r["dev"], fp32=r["fp32"],
                              p=r["p"], rank=r["rank"], condition=r["condition"]) for r in failed],
            "worst": [{"dev": d, "fp32": lp, "p": p, "rank": r} for d, lp, p, r in sorted(toks, key=lambda t: -t[0])[:20]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="cpu" + (",cuda" if torch.cuda.is_available() else ""))
    ap.add_argument("--steps", default="0,2", help="policies: AdamW steps at lr 2e-5 from the pretrained weights")
    ap.add_argument("--rollouts", type=int, default=96, help="per condition and policy on CUDA")
    ap.add_argument("--cpu-rollouts", type=int, default=32, help="per condition and policy on the CPU")
    ap.add_argument("--cpu-steps", default="2", help="the policies the CPU engine runs (it is the slow one)")
    ap.add_argument("--verify-device", default="cpu")
    ap.add_argument("--broadcast", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the trainer's broadcast_dtype: float32 leaves the bf16 node's weights rounded apart")
    ap.add_argument("--long", type=int, default=0, help="rollouts of up to 512 tokens per policy and engine (else none)")
    ap.add_argument("--only-long", action="store_true", help="the long condition alone")
    ap.add_argument("--quick", action="store_true", help="16 rollouts, the CPU, the pretrained weights; no JSON")
    ap.add_argument("--out", default=str(ROOT / "bench/results/bf16_token_tail.json"))
    a = ap.parse_args()
    if a.quick:
        a.engines, a.steps, a.cpu_steps, a.cpu_rollouts = "cpu", "0", "0", 16
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.real_model import model_dir

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(eos, int)
    result: dict = {"benchmark": "bf16_token_tail", "model": "SmolLM2-135M-Instruct", "machine": platform.machine(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch": torch.__version__, "verify_device": a.verify_device,
                    "broadcast_dtype": a.broadcast, "thresholds": asdict(Thresholds()), "runs": {}}
    all_rows = []
    for steps in [int(s) for s in a.steps.split(",")]:
        policy = rl_steps(base, steps, a.broadcast) if steps else base
        for engine in a.engines.split(","):
            if engine == "cpu" and str(steps) not in a.cpu_steps.split(","):
                continue
            t0 = time.perf_counter()
            n = a.cpu_rollouts if engine == "cpu" else a.rollouts
            rows = [] if a.only_long else measure(engine, a.verify_device, policy, tok, eos, n, 17 + steps, CONDITIONS)
            if a.long:
                rows += measure(engine, a.verify_device, policy, tok, eos, a.long, 17 + steps, [LONG])
            s = summarize(rows)
            s["seconds"] = time.perf_counter() - t0
            result["runs"][f"{engine} bf16, {steps} steps"] = s
            all_rows += rows
            print(f"{engine} bf16, policy +{steps} steps: {s['rollouts']} rollouts, {s['tokens']} tokens, "
                  f"failed {s['failed_ban'] + s['failed_outlier']} ({s['failed_outlier']} as outliers), "
                  f"worst token {s['worst'][0]['dev']:.3f} at fp32 logprob {s['worst'][0]['fp32']:.2f}, "
                  f"{s['seconds']:.0f} s", flush=True)
    total = summarize(all_rows)
    result["all"] = total
    print(f"\n{'fp32 logprob':>12} {'tokens':>8} {'p99':>7} {'p99.9':>7} {'max':>7} {'> 0.6':>6}")
    for name, b in total["by_fp32_logprob"].items():
        print(f"{name:>12} {b['tokens']:8d} {b['p99']:7.3f} {b['p999']:7.3f} {b['max']:7.3f} {b['over_0.6']:6d}")
    print(f"\n{'position':>12} {'tokens':>8} {'p99':>7} {'p99.9':>7} {'max':>7} {'> 0.6':>6}")
    for name, b in total["by_position"].items():
        print(f"{name:>12} {b['tokens']:8d} {b['p99']:7.3f} {b['p999']:7.3f} {b['max']:7.3f} {b['over_0.6']:6d}")
    print(f"worst commitment ratio {total['worst_commitment_ratio']:.2f}, worst logprob mean / its limit "
          f"{total['worst_mean_ratio']:.2f}")
    print(f"all: {total['rollouts']} rollouts, {total['passed']} passed, {total['failed_outlier']} voided as "
          f"outliers, {total['failed_ban']} failed as forgeries {total['reasons']}")
    if not a.quick:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
