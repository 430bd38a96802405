"""Deltas over many steps: bytes on the wire per training step, for each checkpoint encoding.

Model: a Qwen2-shaped causal LM built with transformers from a config (hidden 768, 12 layers, 12 heads with
4 KV heads, intermediate 2048, vocab 32000, tied embeddings: ~100M parameters, ~200 MB in bf16), random
init (normal(0, 0.02)), fp32 master weights. Objective: next-token loss on fixed text (the .py files at
the top of this Python's standard library, tokenized with a byte-level BPE of 32000 tokens trained on
them), consecutive batches of 8 x 128 tokens, torch.optim.AdamW(lr, weight_decay=0.01). After every
step the weights are taken exactly as the trainer broadcasts them (node.trainer.Trainer
.weights_for_broadcast: bf16 copies, tied duplicates dropped) and packed with protocol.checkpoint
against the previous step's payload, as the coordinator would:

  full           zstd of the raw payload (what a node without the previous step fetches)
  xor-delta      bytewise XOR with the previous payload, then zstd (the encoding used until now)
  sparse-delta   changed words as position gaps + zigzag differences, byte planes, zstd (new)
  xor-planes     prototype, size only: the XOR split into low/high byte planes of bf16 words, then zstd

Per step and encoding: compressed bytes (the manifest's sum of zsize), ratio vs the raw bf16 payload,
the fraction of bf16 elements that changed, pack (encode) and verify+unpack (decode, to a file, against
the previous payload) throughput through the real code, 2 threads each. Entropy bounds for the changed
positions and values (independent positions, and positions conditioned on the base value's exponent
byte) show how much room is left. Every decoded payload is compared byte for byte with the original.

    .venv/bin/python bench/deltas.py [--steps 12] [--lrs 1e-6,1e-5] [--quick]
    # writes bench/results/deltas.json and docs/deltas.png (not with --quick)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULT = REPO / "bench" / "results" / "deltas.json"
PLOT = REPO / "docs" / "deltas.png"
ENCODINGS = ("full", "xor-delta", "sparse-delta")
PROTOTYPES = ("xor-planes",)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def corpus_tokens(vocab: int):
    """Token ids of the fixed text, and a description of it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = [i for t in texts for i in tok.encode(t).ids]
    about = {"source": f"{len(files)} *.py files of the Python {platform.python_version()} standard library",
             "bytes": sum(len(t.encode()) for t in texts), "tokens": len(ids), "tokenizer": f"byte-level BPE, "
             f"{tok.get_vocab_size()} tokens, trained on the same files"}
    return torch.tensor(ids, dtype=torch.long), about


def build_model(quick: bool, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if quick:
        cfg = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=768, vocab_size=vocab, tie_word_embeddings=True,
                          max_position_embeddings=512, initializer_range=0.02)
    else:
        cfg = Qwen2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          intermediate_size=2048, vocab_size=vocab, tie_word_embeddings=True,
                          max_position_embeddings=512, initializer_range=0.02)
    model = Qwen2ForCausalLM(cfg).float()
    return model, cfg


def broadcast_state(model) -> dict:
    """Exactly what the trainer broadcasts: Trainer.weights_for_broadcast on this model, bf16."""
    from node.trainer.trainer import Trainer

    shim = types.SimpleNamespace(cfg=types.SimpleNamespace(broadcast_dtype="bfloat16"), model=model)
    return Trainer.weights_for_broadcast(shim)


def xor_planes_size(new: bytes, old: bytes, shard_size: int, level: int) -> int:
    """Prototype: per shard, XOR, then the low bytes of all bf16 words followed by the high bytes, zstd."""
    import numpy as np
    import zstandard

    cctx = zstandard.ZstdCompressor(level=level)
    a, b = np.frombuffer(new, np.uint8), np.frombuffer(old, np.uint8)
    total = 0
    for off in range(0, len(a), shard_size):
        x = a[off:off + shard_size] ^ b[off:off + shard_size]
        even = x[:len(x) // 2 * 2]
        planes = np.concatenate([even[0::2], even[1::2], x[len(even):]])
        total += len(cctx.compress(planes.tobytes()))
    return total


def change_stats(new: bytes, old: bytes) -> dict:
    """Changed bf16 elements (data section only) and entropy bounds for coding them."""
    import numpy as np

    header = 8 + int.from_bytes(new[:8], "little")
    n = (len(new) - header) // 2
    a = np.frombuffer(new, "<u2", n, header)
    b = np.frombuffer(old, "<u2", n, header)
    changed = a != b
    k = int(changed.sum())
    p = k / n

    def h(q):
        q = np.asarray(q, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.nan_to_num(-(q * np.log2(q) + (1 - q) * np.log2(1 - q)))

    d = (a[changed] - b[changed]).view("<i2").astype(np.int32)
    _, counts = np.unique(d, return_counts=True)
    value_bits = float(-(counts / k * np.log2(counts / k)).sum() * k) if k else 0.0
    exponent = (b >> 7).astype(np.int64)  # sign + 8 exponent bits of the base value, known to the receiver
    per_class = np.bincount(exponent, minlength=512)
    changed_per_class = np.bincount(exponent, weights=changed, minlength=512)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(per_class > 0, changed_per_class / np.maximum(per_class, 1), 0)
    cond_bits = float((per_class * h(q)).sum())
    iid_bits = float(n * h(p))
    raw = len(new)
    return {"elements": n, "changed": k, "changed_fraction": p,
            "bound_ratio_iid_positions": raw * 8 / max(iid_bits + value_bits, 1),
            "bound_ratio_positions_by_exponent": raw * 8 / max(cond_bits + value_bits, 1),
            "value_entropy_bits": value_bits / max(k, 1)}


def measure_step(work: Path, key, step: int, state: dict, prev_payload: Path | None, shard_size: int,
                 level: int) -> tuple[list[dict], Path, dict | None]:
    from protocol.checkpoint import DirShardReader, reconstruct_payload
    from protocol.checkpoint import pack_checkpoint

    payload = work / f"p{step}.safetensors"
    rows = []
    stats = None
    for encoding in ENCODINGS:
        if encoding != "full" and prev_payload is None:
            continue
        out = work / f"c{step}-{encoding}"
        base = prev_payload if encoding != "full" else None
        t0, c0 = time.perf_counter(), cpu_s()
        m = pack_checkpoint(state, out, identity=key, step=step, run_id="deltas", base_payload=base,
                            base_step=step - 1 if base is not None else None, encoding=encoding,
                            shard_size=shard_size, level=level, threads=2,
                            payload_out=payload if encoding == "full" else None)
        enc_s, enc_cpu = time.perf_counter() - t0, cpu_s() - c0
        decoded = work / f"d{step}-{encoding}.safetensors"
        t0, c0 = time.perf_counter(), cpu_s()
        reconstruct_payload(m, DirShardReader(out, m), decoded, base_payload=base, threads=2)
        dec_s, dec_cpu = time.perf_counter() - t0, cpu_s() - c0
        if decoded.read_bytes() != payload.read_bytes():
            raise SystemExit(f"step {step} {encoding}: decoded payload differs from the original")
        decoded.unlink()
        shutil.rmtree(out)
        mb = m.total_size / 1e6
        rows.append({"encoding": encoding, "step": step, "raw_bytes": m.total_size,
                     "compressed_bytes": m.compressed_size, "ratio_vs_raw": m.total_size / m.compressed_size,
                     "shards": m.num_shards, "encode_seconds": enc_s, "encode_cpu_seconds": enc_cpu,
                     "encode_mb_s": mb / enc_s, "encode_mb_per_cpu_s": mb / max(enc_cpu, 1e-9),
                     "decode_seconds": dec_s, "decode_cpu_seconds": dec_cpu, "decode_mb_s": mb / dec_s,
                     "decode_mb_per_cpu_s": mb / max(dec_cpu, 1e-9)})
    if prev_payload is not None:
        new, old = payload.read_bytes(), prev_payload.read_bytes()
        size = xor_planes_size(new, old, shard_size, level)
        rows.append({"encoding": "xor-planes", "step": step, "raw_bytes": len(new), "compressed_bytes": size,
                     "ratio_vs_raw": len(new) / size, "prototype": True})
        stats = change_stats(new, old)
        for r in rows:
            r["changed_fraction"] = stats["changed_fraction"]
    return rows, payload, stats


def run_steps(lr: float, steps: int, train, weights, work: Path, key, shard_size: int, level: int,
              info: dict) -> list[dict]:
    """Step 0's weights, then `steps` times: `train(step)` (one optimizer step; its loss) and the new weights
    (`weights()`, as the trainer broadcasts them) packed against the previous payload by `measure_step`. Losses and
    training seconds go into `info`; returns the rows of every step and encoding."""
    import torch

    rows: list[dict] = []
    prev = None
    for step in range(steps + 1):
        if step > 0:
            t0 = time.perf_counter()
            info["losses"].append(train(step))
            info["train_seconds"].append(time.perf_counter() - t0)
        with torch.no_grad():
            state = weights()
        step_rows, payload, stats = measure_step(work, key, step, state, prev, shard_size, level)
        del state
        if prev is not None:
            prev.unlink()
        prev = payload
        for r in step_rows:
            r["lr"] = lr
            if stats:
                r.update({k: v for k, v in stats.items() if k.startswith("bound") or k == "value_entropy_bits"})
            if step > 0:
                r["loss"] = info["losses"][-1]
        rows.extend(step_rows)
        if step > 0:
            by = {r["encoding"]: r for r in step_rows}
            print(f"lr {lr:g} step {step:2d} loss {info['losses'][-1]:.3f} changed {stats['changed_fraction']:6.2%}  "
                  + "  ".join(f"{e} {by[e]['ratio_vs_raw']:6.1f}x" for e in ENCODINGS + PROTOTYPES)
                  + f"  bound {stats['bound_ratio_iid_positions']:.0f}x", file=sys.stderr, flush=True)
    prev.unlink()
    return rows


def run_lr(lr: float, steps: int, quick: bool, tokens, vocab: int, batch: int, seq: int, work: Path, key,
           shard_size: int, level: int) -> tuple[list[dict], dict]:
    import torch

    model, cfg = build_model(quick, vocab)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    info = {"params": sum(p.numel() for p in model.parameters()), "losses": [], "train_seconds": []}

    def train(step: int) -> float:
        start = ((step - 1) * batch * seq) % (len(tokens) - batch * seq - 1)
        x = tokens[start:start + batch * seq].view(batch, seq)
        loss = model(input_ids=x, labels=x).loss  # next-token loss (labels shifted inside)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    rows = run_steps(lr, steps, train, lambda: broadcast_state(model), work, key, shard_size, level, info)
    info["config"] = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "num_key_value_heads", "intermediate_size", "vocab_size",
                                                     "tie_word_embeddings", "initializer_range")}
    return rows, info


def real_groups(n_prompts: int, samples: int, max_tokens: int) -> tuple[str, list]:
    """RL groups from the real model (node/real_model.py): reasoning-gym basic_arithmetic prompts through its chat
    template, `samples` completions each from its own seeded sampler (the transformers backend). The reward is the
    task's score plus a shaped 0.1 x the share of digits in the answer (a 135M model scores ~0 on the task itself,
    and a group whose rewards are all equal has no advantage to learn from)."""
    from node.envs import load_task
    from node.envs.prompt import decode_completion, encode_prompt
    from node.real_model import model_dir
    from node.trainer import Group, Rollout
    from node.trainer.tokenizer import load_tokenizer
    from node.worker.backends.base import GenRequest
    from node.worker.backends.transformers_backend import TransformersBackend

    src = model_dir()
    tok = load_tokenizer(src)
    task = load_task("reasoning-gym:basic_arithmetic", {})
    backend = TransformersBackend(src, dtype="float32", device="cpu")
    groups = []
    for i in range(n_prompts):
        problem = task.sample(0, i)
        prompt = encode_prompt(tok, problem)
        res = backend.generate([GenRequest(prompt, i * 100 + j) for j in range(samples)], temperature=1.0, top_p=1.0,
                               max_tokens=max_tokens, eos_token_id=int(tok.eos_token_id))
        rollouts = []
        for r in res:
            text = decode_completion(tok, r.completion_ids)
            reward = task.score(problem, text) + 0.1 * sum(c.isdigit() for c in text) / max(1, len(text))
            rollouts.append(Rollout(completion_ids=r.completion_ids, inference_logprobs=r.logprobs, reward=reward,
                                    finish_reason=r.finish_reason))
        groups.append(Group(prompt_id=f"p{i}", prompt_ids=prompt, rollouts=rollouts))
    return str(src), groups


def run_lr_real(lr: float, steps: int, groups: list, src: str, per_step: int, work: Path, key, shard_size: int,
                level: int) -> tuple[list[dict], dict]:
    """RL steps of the project's own Trainer (node.trainer.Trainer: the run's loss, advantages and AdamW) on the
    real model, `per_step` groups a step taken in turn from `groups` (generated once, by the step-0 policy)."""
    from node.trainer import Group, Trainer
    from node.trainer.config import TrainerConfig

    cfg = TrainerConfig(lr=lr, buffer={"online_difficulty_filtering": False})
    trainer = Trainer(src, cfg, batch_prompts=per_step)
    info = {"params": sum(p.numel() for p in trainer.model.parameters()), "losses": [], "train_seconds": []}

    def train(step: int) -> float:
        for j in range(per_step):
            g = groups[((step - 1) * per_step + j) % len(groups)]
            trainer.add_group(Group(g.prompt_id, list(g.prompt_ids), list(g.rollouts)))
        return float(trainer.step().get("loss", 0.0))

    rows = run_steps(lr, steps, train, trainer.weights_for_broadcast, work, key, shard_size, level, info)
    info["config"] = {"model": Path(src).name, "groups_per_step": per_step}
    return rows, info


def summarize(rows: list[dict], lrs: list[float]) -> list[dict]:
    import statistics as st

    out = []
    for lr in lrs:
        for enc in ENCODINGS + PROTOTYPES:
            rs = [r for r in rows if r["lr"] == lr and r["encoding"] == enc and r["step"] > 0]
            if not rs:
                continue
            s = {"lr": lr, "encoding": enc, "steps": len(rs),
                 "mean_ratio_vs_raw": st.mean(r["ratio_vs_raw"] for r in rs),
                 "mean_compressed_bytes": st.mean(r["compressed_bytes"] for r in rs),
                 "ratio_of_mean_bytes": rs[0]["raw_bytes"] / st.mean(r["compressed_bytes"] for r in rs),
                 "min_ratio_vs_raw": min(r["ratio_vs_raw"] for r in rs),
                 "max_ratio_vs_raw": max(r["ratio_vs_raw"] for r in rs),
                 "mean_changed_fraction": st.mean(r["changed_fraction"] for r in rs)}
            if "encode_mb_s" in rs[0]:
                for k in ("encode_mb_s", "decode_mb_s", "encode_mb_per_cpu_s", "decode_mb_per_cpu_s"):
                    s[f"mean_{k}"] = st.mean(r[k] for r in rs)
            out.append(s)
    return out


def plot(rows: list[dict], lrs: list[float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lrs), figsize=(5.2 * len(lrs), 4), sharey=True, squeeze=False)
    styles = {"full": ("tab:gray", "s"), "xor-delta": ("tab:blue", "o"), "sparse-delta": ("tab:red", "^"),
              "xor-planes": ("tab:green", "x")}
    for ax, lr in zip(axes[0], lrs):
        for enc in ENCODINGS + PROTOTYPES:
            rs = sorted((r for r in rows if r["lr"] == lr and r["encoding"] == enc and r["step"] > 0),
                        key=lambda r: r["step"])
            color, marker = styles[enc]
            label = enc + (" (prototype)" if enc in PROTOTYPES else "")
            ax.plot([r["step"] for r in rs], [r["ratio_vs_raw"] for r in rs], marker=marker, color=color, label=label)
        bound = sorted((r for r in rows if r["lr"] == lr and r["encoding"] == "sparse-delta" and r["step"] > 0),
                       key=lambda r: r["step"])
        ax.plot([r["step"] for r in bound], [r["bound_ratio_iid_positions"] for r in bound], ls="--",
                color="black", lw=1, label="entropy bound (i.i.d. positions)")
        ax2 = ax.twinx()
        ax2.bar([r["step"] for r in bound], [100 * r["changed_fraction"] for r in bound], color="tab:orange",
                alpha=0.15, width=0.6)
        ax2.set_ylabel("bf16 values changed (%)", color="tab:orange")
        ax.set_yscale("log")
        ax.set_xlabel("training step (AdamW)")
        ax.set_title(f"lr {lr:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    axes[0][0].set_ylabel("raw bf16 bytes / bytes on the wire")
    axes[0][0].axhline(30, color="tab:red", lw=0.8, ls=":")
    axes[0][-1].legend(fontsize=7, loc="center right")
    fig.suptitle("Checkpoint bytes on the wire per step (~100M-parameter Qwen2-shaped model, bf16)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a 2-layer model and 3 steps (smoke run, writes nothing)")
    ap.add_argument("--real", action="store_true", help="RL steps of the Trainer on the real model (node/real_model.py)"
                    " -> bench/results/deltas_real.json (no plot)")
    ap.add_argument("--real-groups", type=int, default=4, help="--real: prompts generated once (groups)")
    ap.add_argument("--real-samples", type=int, default=4, help="--real: samples per prompt")
    ap.add_argument("--real-tokens", type=int, default=24, help="--real: tokens per completion")
    args = ap.parse_args()
    import torch

    from protocol.identity import Identity

    torch.set_num_threads(2)
    lrs = [float(x) for x in args.lrs.split(",")]
    steps = 3 if args.quick else args.steps
    vocab = 8000 if args.quick else 32000
    shard_size, level = 32 * 1024 * 1024, 1
    started = time.perf_counter()
    load_before = os.getloadavg()
    if args.real:
        src, groups = real_groups(args.real_groups, args.real_samples, args.real_tokens)
        corpus = {"source": f"{len(groups)} groups of {args.real_samples} rollouts x <= {args.real_tokens} tokens, "
                  "reasoning-gym basic_arithmetic, generated once by the step-0 policy (bench/deltas.py real_groups)"}
    else:
        tokens, corpus = corpus_tokens(vocab)
    rows: list[dict] = []
    infos = {}
    with tempfile.TemporaryDirectory(prefix="bench-deltas-") as tmp:
        key = Identity.generate()
        for lr in lrs:
            work = Path(tmp) / f"lr{lr:g}"
            work.mkdir()
            if args.real:
                lr_rows, infos[f"{lr:g}"] = run_lr_real(lr, steps, groups, src, 2, work, key, shard_size, level)
            else:
                lr_rows, infos[f"{lr:g}"] = run_lr(lr, steps, args.quick, tokens, vocab, args.batch, args.seq, work,
                                                   key, shard_size, level)
            rows.extend(lr_rows)
    summary = summarize(rows, lrs)
    params = next(iter(infos.values()))["params"]
    raw = rows[0]["raw_bytes"]
    print(f"\nmodel: Qwen2-shaped, {params / 1e6:.1f}M params, bf16 payload {raw / 1e6:.1f} MB; {steps} AdamW steps "
          f"of {args.batch}x{args.seq} tokens per lr; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'lr':>6} {'step':>4} {'encoding':<13}{'bytes':>12}{'ratio':>9}{'changed':>9}{'enc MB/s':>10}"
          f"{'dec MB/s':>10}")
    for r in rows:
        if r["step"] == 0:
            continue
        enc = f"{r['encode_mb_s']:10.0f}{r['decode_mb_s']:10.0f}" if "encode_mb_s" in r else f"{'-':>10}{'-':>10}"
        print(f"{r['lr']:6g} {r['step']:4d} {r['encoding']:<13}{r['compressed_bytes']:12,d}{r['ratio_vs_raw']:8.1f}x"
              f"{r['changed_fraction']:9.2%}{enc}")
    print(f"\nmean over steps 1..{steps}:")
    print(f"{'lr':>6} {'encoding':<13}{'ratio':>9}{'(min..max)':>16}{'MB/step':>9}{'changed':>9}{'enc MB/s':>10}"
          f"{'dec MB/s':>10}")
    for s in summary:
        speed = (f"{s['mean_encode_mb_s']:10.0f}{s['mean_decode_mb_s']:10.0f}" if "mean_encode_mb_s" in s
                 else f"{'-':>10}{'-':>10}")
        print(f"{s['lr']:6g} {s['encoding']:<13}{s['mean_ratio_vs_raw']:8.1f}x"
              f"{s['min_ratio_vs_raw']:8.1f}..{s['max_ratio_vs_raw']:<6.1f}{s['mean_compressed_bytes'] / 1e6:9.2f}"
              f"{s['mean_changed_fraction']:9.2%}{speed}")
    if args.quick:
        return
    if args.real:
        result = {"benchmark": "deltas_real", "machine": {"cpus": os.cpu_count()},
                  "model": {"name": Path(src).name, "params": params, "payload_bytes": raw, "dtype": "bfloat16"},
                  "training": {"trainer": "node.trainer.Trainer (RL, default loss and advantages), 2 groups per step",
                               "steps": steps, "rollouts": corpus, "per_lr": infos},
                  "codec": {"shard_size": shard_size, "zstd_level": level, "threads": 2},
                  "rows": rows, "summary": summary, "total_seconds": time.perf_counter() - started,
                  "load_average": {"before": load_before, "after": os.getloadavg()}}
        out = REPO / "bench" / "results" / "deltas_real.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out.relative_to(REPO)}")
        return
    result = {
        "benchmark": "deltas",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "model": {"arch": "Qwen2ForCausalLM", "params": params, "payload_bytes": raw, "dtype": "bfloat16",
                  **next(iter(infos.values()))["config"]},
        "training": {"optimizer": "torch.optim.AdamW(lr, weight_decay=0.01), default betas/eps",
                     "master_weights": "float32", "objective": "next-token cross-entropy on fixed text",
                     "batch": f"{args.batch}x{args.seq} consecutive tokens per step", "steps": steps,
                     "corpus": corpus,
                     "broadcast": "node.trainer.Trainer.weights_for_broadcast (bf16, tied duplicates dropped)",
                     "per_lr": infos},
        "codec": {"shard_size": shard_size, "zstd_level": level, "threads": 2,
                  "decode": "reconstruct_payload to a file against the previous step's payload (verify + unpack)"},
        "rows": rows, "summary": summary, "total_seconds": time.perf_counter() - started,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, lrs, PLOT)
    print(f"wrote {RESULT.relative_to(REPO)} and {PLOT.relative_to(REPO)} in {result['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
