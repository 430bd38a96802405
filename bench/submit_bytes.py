"""What a submission weighs on the wire, and what zstd makes of it: real SmolLM2-135M-Instruct rollouts.

A worker uploads its rollouts to the coordinator as one signed JSON body (`POST /v1/submit`): per rollout the
completion's token ids, its logprobs and the activation commitment (docs/PROTOCOL.md). At the realistic size
(8 prompts x 16 samples of up to 512 tokens) that is about a megabyte, and most contributors send it up a home
uplink of 10-50 Mbit/s. This bench generates real rollouts on the node's own evidence path (TransformersBackend:
seeded sampler, logprobs, commitments) for chat prompts, builds the body exactly as the node's client does
(`CoordinatorClient._signed`: json.dumps of the SubmitRequest), with the logprobs as the engine gives them (float32
values as Python floats: 17 digits) and as the worker sends them (`M.wire_logprobs`: 9 digits, the same float32
values), and prints per field its bytes, and for the whole body zstd's ratio and CPU at levels 1 and 3, and the
upload time at 20 Mbit/s, per token and scaled to 8 x 16 x 512.

Run: .venv/bin/python bench/submit_bytes.py [--rollouts 16] [--max-tokens 256]  -> bench/results/submit_bytes.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zstandard

from protocol import messages as M

UPLINK_BYTES_S = 20e6 / 8  # a home uplink of 20 Mbit/s (the WAN lab's)
REALISTIC_TOKENS = 8 * 16 * 512  # the realistic submission, every completion at its cap (an upper bound)


def best_of(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def measure(body: bytes, tokens: int) -> dict:
    """Sizes and zstd's ratio and CPU (ms, best of 5, this process) for one body of `tokens` completion tokens."""
    out: dict = {"raw_bytes": len(body), "tokens": tokens, "raw_bytes_per_token": len(body) / tokens}
    d = json.loads(body)
    rolls = d["rollouts"]
    out["fields"] = {f: sum(len(json.dumps(r[f])) for r in rolls) for f in ("completion_ids", "logprobs", "commitment")}
    for level in (1, 3):
        z = zstandard.ZstdCompressor(level=level).compress(body)
        out[f"zstd{level}"] = {
            "bytes": len(z), "ratio": len(body) / len(z),
            "compress_ms": 1e3 * best_of(lambda: zstandard.ZstdCompressor(level=level).compress(body)),
            "decompress_ms": 1e3 * best_of(lambda: zstandard.ZstdDecompressor().decompress(z)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench/results/submit_bytes.json"))
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.real_model import model_dir
    from node.worker.backends.base import GenRequest
    from node.worker.backends.transformers_backend import TransformersBackend
    from tests.integration.test_real_cuda import chat_prompts
    from bench.bf16_token_tail import LONG_QUESTIONS

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    backend = TransformersBackend(model, dtype="bfloat16", device="cpu", max_batch_size=64)
    prompts = chat_prompts(tok, a.rollouts, 7, LONG_QUESTIONS)
    t0 = time.perf_counter()
    res = backend.generate([GenRequest(p, 1000 + i) for i, p in enumerate(prompts)], temperature=1.0, top_p=1.0,
                           max_tokens=a.max_tokens, eos_token_id=eos)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(r.completion_ids) for r in res)
    scale = REALISTIC_TOKENS / tokens
    print(f"{len(res)} real rollouts, {tokens} completion tokens (generated in {gen_s:.1f} s)")
    print(f"{'logprobs':<22} {'body':<13} {'bytes':>9} {'ratio':>6} {'B/token':>8} {'compress ms':>12} "
          f"{'decompress ms':>14} {'8x16x512: MB':>13} {'upload 20 Mbit/s':>17}")
    result: dict = {"benchmark": "submit_bytes", "model": "SmolLM2-135M-Instruct", "rollouts": len(res),
                    "max_tokens": a.max_tokens, "generate_s": gen_s, "realistic_tokens": REALISTIC_TOKENS}
    # as the engine gives them (17 digits), and as the worker sends them since M.wire_logprobs (9 digits)
    for name, lps in (("float32 as 17 digits", lambda r: r.logprobs), ("9 digits (wire_logprobs)",
                                                                         lambda r: M.wire_logprobs(r.logprobs))):
        sub = M.SubmitRequest(assignment_id="a" * 32, policy_step=3, rollouts=[
            M.RolloutSubmission(prompt_id=f"p{i // 16}", sample_index=i % 16, completion_ids=r.completion_ids,
                                logprobs=lps(r), finish_reason=r.finish_reason, commitment=r.commitment)
            for i, r in enumerate(res)])
        body = json.dumps(sub.model_dump()).encode()  # as CoordinatorClient._signed builds it
        m = measure(body, tokens)
        result[name] = m
        rows = [("JSON", m["raw_bytes"], 1.0, 0.0, 0.0)] + [
            (f"zstd level {lv}", m[f"zstd{lv}"]["bytes"], m[f"zstd{lv}"]["ratio"], m[f"zstd{lv}"]["compress_ms"],
             m[f"zstd{lv}"]["decompress_ms"]) for lv in (1, 3)]
        for body_name, n, ratio, c_ms, d_ms in rows:
            print(f"{name:<22} {body_name:<13} {n:>9,} {ratio:>6.2f} {n / tokens:>8.2f} {c_ms:>12.1f} {d_ms:>14.1f} "
                  f"{n * scale / 1e6:>13.2f} {n * scale / UPLINK_BYTES_S:>15.2f} s")
        print(f"{'':<22} fields, B/token: " + ", ".join(f"{k} {v / tokens:.1f}" for k, v in m["fields"].items()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
