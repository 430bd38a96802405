"""The real model on a GPU: generation throughput (transformers backend, bf16, CUDA) against the CPU replay that
verifies it (fp32), side by side in one run.

What a home GPU produces per second and what a coordinator's CPU can check per second decide how large a
verification fraction one coordinator core sustains. Needs CUDA (run it in the device lane); prints a table
and writes bench/results/gpu_real.json.

    python bench/gpu_real.py [--tokens 64] [--batches 1,16,64]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from node.real_model import model_dir
from node.worker.backends.base import GenRequest
from node.worker.backends.transformers_backend import TransformersBackend
from verify.rollouts import RolloutClaim, RolloutVerifier, VerifyItem

OUT = Path(__file__).parent / "results" / "gpu_real.json"


def prompts(tok, n: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        q = f"What is {rng.randrange(10, 99)} + {rng.randrange(10, 99)}? Think step by step."
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--verify-rollouts", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu only to dry-run the script")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_real.py needs a CUDA GPU")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    be = TransformersBackend(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), dtype="bfloat16",
                             device=args.device, max_batch_size=max(int(b) for b in args.batches.split(",")))
    # A stop token that is almost never sampled (the vocabulary's last id): every row decodes all the tokens,
    # so tokens/s counts real decode work; it is a valid id, so the verifier checks the rollouts as usual.
    never = be.vocab_size - 1
    rows, last = [], None
    for b in (int(x) for x in args.batches.split(",")):
        reqs = [GenRequest(p, i) for i, p in enumerate(prompts(tok, b))]
        be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=8, eos_token_id=never)  # warm-up (kernels, cache)
        sync()
        t = time.perf_counter()
        res = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=args.tokens, eos_token_id=never)
        sync()
        dt = time.perf_counter() - t
        n = sum(len(r.completion_ids) for r in res)
        rows.append({"what": f"generate bf16 {args.device}, batch {b}", "tokens": n, "seconds": dt, "tokens_per_s": n / dt})
        last = (reqs, res)
    reqs, res = last
    k = min(args.verify_rollouts, len(res))
    verifier = RolloutVerifier(model)
    items = [VerifyItem(r.prompt_ids, RolloutClaim(x.completion_ids, x.logprobs, x.finish_reason, x.commitment),
                        r.seed, 1.0, 1.0, args.tokens, never) for r, x in zip(reqs[:k], res[:k])]
    t = time.perf_counter()
    verdicts = verifier.verify_many(items)
    dt = time.perf_counter() - t
    n = sum(len(it.rollout.completion_ids) for it in items)
    rows.append({"what": f"verify fp32 cpu ({torch.get_num_threads()} threads), {k} rollouts", "tokens": n,
                 "seconds": dt, "tokens_per_s": n / dt, "rejected": sum(not v.ok for v in verdicts)})
    print(f"{'what':48} {'tokens':>8} {'s':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['what']:48} {r['tokens']:8d} {r['seconds']:8.2f} {r['tokens_per_s']:10.0f}")
    gen = rows[-2]["tokens_per_s"]
    ratio = rows[-1]["tokens_per_s"] / gen
    print(f"CPU verification keeps up with {ratio:.2f} of one GPU's batch-{rows[-2]['what'].split()[-1]} output")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "model": Path(path).name,
                               "torch": torch.__version__, "rows": rows, "verify_over_generate": ratio}, indent=2))


if __name__ == "__main__":
    main()
