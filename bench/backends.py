"""Inference backends side by side: transformers vs vLLM, each with and without our evidence.

One Qwen2-shaped model of ~100M parameters (hidden 768, 12 layers, vocab 32000, random weights, bf16
checkpoint), the same prompts (32 tokens) and per-sequence seeds, batches of 1, 16 and 64 sequences x
256 new tokens. Engines compute in `--dtype` (default: float32 on the CPU, whose bf16 matmuls are
emulated without AVX-512-BF16/AMX; bfloat16 on CUDA). Four engines, each in its own process (so that peak memory is its own):

  hf-native      transformers `model.generate(do_sample=True)`: the engine alone
  transformers   prime-node's transformers backend: replayable sampler + hidden-state capture + commitments
  vllm-native    `vllm.LLM.generate` with vLLM's own seeded sampler: the engine alone
  vllm           prime-node's vLLM backend (as `prime-node join` starts it): the same evidence, taken from
                 the engine's own forward pass

Reported per engine and batch: generated tokens/s, evidence overhead (time over the engine alone, %),
peak resident memory of the process (CPU) or peak GPU memory (CUDA), and the ratio to the engine alone.
Targets (#8): evidence overhead <= 10 % of generation; node memory <= 1.15x vLLM alone; on a GPU, vLLM
>= 3x transformers at batch 64.

`--real` measures the real pretrained model instead (SmolLM2-135M-Instruct, node/real_model.py: 135M
parameters, 30 layers of hidden 576, a 49,152-token vocabulary; issue #27): the same workload, its prompts
drawn from the real vocabulary, completions forced to the full length so every engine does the same work.

Run in the vLLM venv (`make venv-vllm`): .venv-vllm/bin/python bench/backends.py [--quick] [--real]
[--device cpu] -> bench/results/backends.json (backends_real.json with --real). Without vLLM installed only
the transformers rows are measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ("hf-native", "transformers", "vllm-native", "vllm")
NATIVE = {"transformers": "hf-native", "vllm": "vllm-native"}
PROMPT_TOKENS, NEW_TOKENS, VOCAB = 32, 256, 32000


def write_payload(model, out: Path) -> tuple[Path, int]:
    """The model's bf16 checkpoint payload beside `out` (what a node starts from; a tied head is not stored)."""
    import torch

    from protocol.checkpoint.payload import serialize_state

    tied = model.config.tie_word_embeddings
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    payload = out.parent / "payload.safetensors"
    payload.write_bytes(serialize_state(state))
    return payload, sum(p.numel() for p in model.parameters())


def build_real(out: Path) -> tuple[Path, int, int]:
    """The real SmolLM2-135M-Instruct directory (built once from PyPI's wheel, cached), linked at `out`."""
    from transformers import AutoModelForCausalLM

    from node.real_model import model_dir

    src = model_dir()
    out.symlink_to(src, target_is_directory=True)
    model = AutoModelForCausalLM.from_pretrained(src)
    payload, n_params = write_payload(model, out)
    return payload, n_params, int(model.config.vocab_size)


def build_model(out: Path, *, hidden: int, layers: int) -> tuple[Path, int]:
    """A random Qwen2-shaped model directory and its bf16 checkpoint payload (what a node starts from)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.02)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return write_payload(model, out)


def workload(batch: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    import random

    rng = random.Random(batch)
    return [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)], \
        [1000 + i for i in range(batch)]


def peak_memory(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_reserved())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_engine(engine: str, model_dir: Path, payload: Path, batches: list[int], device: str, dtype: str,
               vocab: int = VOCAB, new_tokens: int = NEW_TOKENS) -> dict:
    """In a fresh process: warm up, then time each batch size. Returns {batch: seconds, tokens} + memory."""
    import torch

    # The last id of the vocabulary as "EOS": random weights almost never sample it, and the real model's is a
    # rare merge, so completions run to NEW_TOKENS (the native engines are told to ignore EOS outright).
    eos = vocab - 1
    if engine == "hf-native":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()

        def gen(prompts, seeds, n):
            torch.manual_seed(seeds[0])
            ids = torch.tensor(prompts, device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 temperature=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=eos)
            return int((out.shape[1] - ids.shape[1]) * out.shape[0])
    elif engine == "vllm-native":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams

        on_cpu = device == "cpu"
        llm = LLM(model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True, enforce_eager=on_cpu,
                  kv_cache_memory_bytes=2**30 if on_cpu else None, gpu_memory_utilization=0.85,
                  enable_prefix_caching=True, async_scheduling=False)

        def gen(prompts, seeds, n):
            params = [SamplingParams(temperature=1.0, seed=s, max_tokens=n, ignore_eos=True, detokenize=False)
                      for s in seeds]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        from node.worker.backends import GenRequest, start_backend

        be = start_backend(engine, model_dir, payload, 0, dtype=dtype, device=device)

        def gen(prompts, seeds, n):
            res = be.generate([GenRequest(p, s) for p, s in zip(prompts, seeds)], temperature=1.0, top_p=1.0,
                              max_tokens=n, eos_token_id=eos)
            return sum(len(r.completion_ids) for r in res)

    gen(*workload(2, vocab), 8)  # warm-up (kernels, allocator)
    out = {}
    for b in batches:
        prompts, seeds = workload(b, vocab)
        t0 = time.perf_counter()
        tokens = gen(prompts, seeds, new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        out[str(b)] = {"seconds": time.perf_counter() - t0, "tokens": tokens}
    return {"batches": out, "peak_memory_bytes": peak_memory(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, batches 1 and 16")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--real", action="store_true", help="the real SmolLM2-135M-Instruct (node/real_model.py)")
    ap.add_argument("--child", nargs=4, metavar=("ENGINE", "MODEL_DIR", "PAYLOAD", "VOCAB"), help=argparse.SUPPRESS)
    ap.add_argument("--batches", default=None)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"tokens generated per sequence ({NEW_TOKENS})")
    ap.add_argument("--out", default=None, help="default bench/results/backends.json (backends_real.json with --real)")
    args = ap.parse_args()
    batches = [int(b) for b in (args.batches or ("1,16" if args.quick else "1,16,64")).split(",")]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.child:
        engine, model_dir, payload, vocab = args.child
        print(json.dumps(run_engine(engine, Path(model_dir), Path(payload), batches, args.device, dtype, int(vocab),
                                    args.new_tokens)))
        return
    args.out = args.out or str(ROOT / "bench/results" / ("backends_real.json" if args.real else "backends.json"))

    try:
        import vllm  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
    engines = [e for e in args.engines.split(",") if have_vllm or not e.startswith("vllm")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.real:
            payload, n_params, vocab = build_real(Path(tmp) / "model")
        else:
            payload, n_params = build_model(Path(tmp) / "model", hidden=768, layers=4 if args.quick else 12)
            vocab = VOCAB
        for engine in engines:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, __file__, "--child", engine, str(Path(tmp) / "model"), str(payload),
                                   str(vocab), "--new-tokens", str(args.new_tokens),
                                   "--device", args.device, "--dtype", dtype, "--batches", ",".join(map(str, batches))],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
            results[engine] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {engine}: done in {time.monotonic() - t0:.0f} s", file=sys.stderr)

    rows = []
    for engine in engines:
        r = results[engine]
        for b in batches:
            m = r["batches"][str(b)]
            row = {"engine": engine, "batch": b, "new_tokens": args.new_tokens, "tokens": m["tokens"],
                   "seconds": round(m["seconds"], 3), "tokens_per_s": round(m["tokens"] / m["seconds"], 1),
                   "peak_memory_mb": round(r["peak_memory_bytes"] / 2**20, 1)}
            native = NATIVE.get(engine)
            if native in results:
                n = results[native]["batches"][str(b)]
                per_token, native_per_token = m["seconds"] / m["tokens"], n["seconds"] / n["tokens"]
                row["evidence_overhead_pct"] = round(100 * (per_token / native_per_token - 1), 1)
                row["memory_vs_native"] = round(r["peak_memory_bytes"] / results[native]["peak_memory_bytes"], 3)
            rows.append(row)
    by = {(r["engine"], r["batch"]): r for r in rows}
    for b in batches:
        if ("vllm", b) in by and ("transformers", b) in by:
            by[("vllm", b)]["vs_transformers"] = round(by[("vllm", b)]["tokens_per_s"]
                                                       / by[("transformers", b)]["tokens_per_s"], 2)

    name = "SmolLM2-135M-Instruct" if args.real else "random Qwen2-shaped"
    print(f"\nbackends: {name}, {n_params / 1e6:.0f}M params, {dtype} (bf16 checkpoint), {PROMPT_TOKENS}-token prompts, "
          f"{args.new_tokens} new tokens, device {args.device}")
    print(f"{'engine':<13} {'batch':>5} {'tok/s':>9} {'evidence':>9} {'peak MB':>9} {'mem/native':>10} {'vs tf':>6}")
    for r in rows:
        ev = f"{r['evidence_overhead_pct']:+.1f}%" if "evidence_overhead_pct" in r else "-"
        mem = f"{r['memory_vs_native']:.2f}x" if "memory_vs_native" in r else "-"
        vs = f"{r['vs_transformers']:.2f}x" if "vs_transformers" in r else "-"
        print(f"{r['engine']:<13} {r['batch']:>5} {r['tokens_per_s']:>9.1f} {ev:>9} {r['peak_memory_mb']:>9.0f} "
              f"{mem:>10} {vs:>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "backends", "model": name, "params": n_params, "dtype": dtype, "checkpoint_dtype": "bfloat16",
        "device": args.device,
        "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens, "rows": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
