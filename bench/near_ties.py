"""Near-ties in the sampling replay: how much an honest node's tokens stray from the replayed sampler's
first choice (numerical noise), and how much room that margin leaves a node that steers on purpose.

The verifier accepts a token when its perturbed score is within `sample_margin` (logit units, x T) of the
best one: bf16 generation verified in fp32 needs some slack. A steering node uses the same slack: at a
position where another token is also within the margin, it may submit whichever it prefers (a higher
reward, a shorter answer) and still pass. Two defences follow from measurement:

1. the margin itself, as tight as honest nodes allow (0 false rejections);
2. a per-node near-tie rate (tokens that were not the first choice, out of all replayed tokens): honest
   nodes stay near the noise rate, a steering node is far above it, and is banned.

Models: the tests' tiny Qwen2 (hidden 64, vocab 96) and a larger one (hidden 384, 4 layers, vocab 8192),
random init (flat distributions: the worst case for near-ties), plus the tiny one after 300 SFT steps
on a fixed text (peaked, as a trained policy is). Honest rollouts: transformers backend in bf16 (batch 16)
verified in fp32. Steering: at every position, the share where some other token passes the margin (the
node's room), and the rate a greedy steerer reaches (it takes every such chance).

Run: .venv/bin/python bench/near_ties.py [--quick]  -> bench/results/near_ties.json
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.worker.backends.base import GenRequest  # noqa: E402
from node.worker.backends.transformers_backend import TransformersBackend  # noqa: E402
from verify.rollouts import Thresholds, recompute  # noqa: E402
from verify.sampler import replay_scores, token_margins  # noqa: E402

MARGINS = (0.6, 0.4, 0.3, 0.2, 0.1)
TAUS = (0.05, 0.1, 0.2)
SAMPLING = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)]


def qwen2(seed: int, *, hidden: int, layers: int, vocab: int, heads: int, init: float = 0.2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
                      initializer_range=init, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def trained(model, vocab: int, steps: int):
    """A peaked policy: SFT on a few fixed sequences."""
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(3, vocab, (16, 40), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def measure(name: str, model, vocab: int, n_prompts: int, max_tokens: int) -> list[dict]:
    rows = []
    gen = TransformersBackend(copy.deepcopy(model), dtype="bfloat16", device="cpu", max_batch_size=16)
    ref = copy.deepcopy(model).float()
    rng = random.Random(0)
    for temperature, top_p in SAMPLING:
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))] for _ in range(n_prompts)]
        seeds = [rng.randrange(2**62) for _ in prompts]
        res = gen.generate([GenRequest(p, s) for p, s in zip(prompts, seeds)], temperature=temperature, top_p=top_p,
                           max_tokens=max_tokens, eos_token_id=2)
        logits, _ = recompute(ref, prompts, [r.completion_ids for r in res])
        honest, room = [], []
        for i, r in enumerate(res):
            n = len(r.completion_ids)
            pos = torch.arange(n)
            rep = replay_scores(logits[i, :n], seeds[i], pos, temperature, top_p, torch.tensor(r.completion_ids),
                                nucleus_slack=Thresholds().nucleus_slack)
            honest += (rep.margin * temperature).tolist()
            if top_p == 1.0:  # the steering room: other tokens within each margin
                m = token_margins(logits[i, :n], seeds[i], pos, temperature)
                room.append(m)
        honest_t = torch.tensor(honest)
        row = {"model": name, "temperature": temperature, "top_p": top_p, "positions": len(honest),
               "honest_near_tie_rate": round(float((honest_t > 1e-6).float().mean()), 5),
               "honest_max_margin": round(float(honest_t.max()), 4),
               "honest_p999_margin": round(float(honest_t.quantile(0.999)), 4)}
        for tau in TAUS:  # near-ties counted only above tau: honest noise is mostly smaller
            row[f"honest_rate>{tau}"] = round(float((honest_t > tau).float().mean()), 5)
        if room:
            m = torch.cat(room)
            for th in MARGINS:
                # positions where a token other than the winner also passes: the steerer's chances
                row[f"steer_rate@{th}"] = round(float(((m <= th).sum(-1) > 1).float().mean()), 4)
            for tau in TAUS:  # ...with a margin above tau (what the near-tie count sees)
                th = Thresholds().sample_margin
                row[f"steer_rate>{tau}"] = round(float(((m > tau) & (m <= th)).any(-1).float().mean()), 4)
        rows.append(row)
        print(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, t = (32, 24) if args.quick else (96, 48)
    tiny = qwen2(0, hidden=64, layers=2, vocab=96, heads=2)
    rows = measure("tiny-random", tiny, 96, n, t)
    rows += measure("tiny-trained", trained(tiny, 96, 100 if args.quick else 300), 96, n, t)
    rows += measure("h384-v8192-random", qwen2(1, hidden=384, layers=4, vocab=8192, heads=6, init=0.05), 8192,
                    n // 2, t)
    th = Thresholds()
    print(f"\n{'model':<20} {'T':>4} {'top_p':>5} {'honest>0':>9} {'max':>6} "
          + " ".join(f"{'hon>' + str(t):>9} {'steer>' + str(t):>9}" for t in TAUS)
          + " " + " ".join(f"{'room@' + str(m):>8}" for m in MARGINS))
    nan = float("nan")
    for r in rows:
        print(f"{r['model']:<20} {r['temperature']:>4} {r['top_p']:>5} {r['honest_near_tie_rate']:>9.4f} "
              f"{r['honest_max_margin']:>6.3f} "
              + " ".join(f"{r[f'honest_rate>{t}']:>9.4f} {r.get(f'steer_rate>{t}', nan):>9.4f}" for t in TAUS)
              + " " + " ".join(f"{r.get(f'steer_rate@{m}', nan):>8.4f}" for m in MARGINS))
    out = ROOT / "bench/results/near_ties.json"
    out.write_text(json.dumps({"benchmark": "near_ties", "sample_margin_now": th.sample_margin,
                               "nucleus_slack": th.nucleus_slack, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
