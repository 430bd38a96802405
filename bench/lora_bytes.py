"""Bytes per step of a LoRA run's checkpoints (issue #29), side by side in one run: the signed `lora-adapter`
checkpoint the publisher sends (node/coordinator/publisher.py), an xor-delta of that adapter against the previous
step's adapter (would deltas between adapters pay?), and what full fine-tuning's formats would send for the same
merged weights: full, xor-delta and sparse-delta against the previous step. `--targets` picks
trainer.lora.target_modules (q,k,v,o by default; peft's own llama default is q,v). bench/lora.py calls `measure`.

A real Trainer with trainer.lora on the real SmolLM2-135M-Instruct (node/real_model.py; `--tiny` for the test
model), a few RL steps on synthetic groups, broadcast in bf16, zstd level 3 (the coordinator's default shards).
Heavy (minutes of CPU): run under the shared lock, `flock /tmp/heavy.lock nice .venv/bin/python bench/lora_bytes.py`.
Writes bench/results/lora_bytes.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


QWEN05B_SHAPE: dict[str, Any] = dict(hidden_size=896, layers=24, heads=14, seed=11, intermediate_size=4864, num_key_value_heads=2,
                     vocab_size=151936, attention_bias=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # trainer.lora.target_modules' default (node/trainer/config.py)
PEFT_LLAMA = ["q_proj", "v_proj"]  # peft's own default targets for llama and qwen2 (TRANSFORMERS_MODELS_TO_LORA_...)


def model_for(kind: str, work: Path) -> tuple[Path, str]:
    """The model directory and its name: "smollm2" (the real SmolLM2-135M-Instruct, node/real_model.py, from the
    cache `make real-model` builds), "qwen05b" (Qwen2-0.5B's shape, random init) or "tiny" (the test model)."""
    from node.trainer.model import build_tiny_model_dir

    if kind == "tiny":
        return build_tiny_model_dir(work / "tiny", hidden_size=32, layers=2, heads=4, seed=11), "tiny"
    if kind == "qwen05b":  # Llama-architecture, as the tiny model (node/trainer/model.py says why), Qwen2's shape
        return build_tiny_model_dir(work / "qwen05b", **QWEN05B_SHAPE), "Qwen2-0.5B-shaped (random init)"
    from node.real_model import model_dir

    return model_dir(download=False), "SmolLM2-135M-Instruct"


def measure(model: Path, *, rank: int = 16, alpha: int = 32, steps: int = 3, warm: int = 1,
            targets: list[str] | None = None, sparse: bool = True, work: Path | None = None) -> dict:
    """Steps 0..`steps` of a real LoRA run published by the real Publisher (step 0 full, then `lora-adapter`),
    each adapter step beside what the other encodings would send for it. Returns {"rows": [...], ...}."""
    from node.checkpoint_dir import CheckpointDir
    from node.coordinator.publisher import Publisher
    from node.trainer import Trainer
    from node.trainer.config import TrainerConfig
    from protocol.checkpoint import DirShardReader, pack_checkpoint, reconstruct_payload
    from protocol.identity import Identity
    from tests.unit.test_trainer_step import make_groups, train_batches

    work = work or Path(tempfile.mkdtemp(prefix="lora-bytes-"))
    lora: dict = dict(rank=rank, alpha=alpha)
    if targets:
        lora["target_modules"] = list(targets)
    cfg = TrainerConfig(lr=1e-3, broadcast_dtype="bfloat16", lora=lora)
    trainer = Trainer(model, cfg, batch_prompts=4)
    if warm:  # supervised on reference answers, as node/trainer/warm_start.py builds them
        from node.trainer import Group, Rollout

        trainer.sft([[Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [0.0] * len(r.completion_ids), 1.0)
                                                         for r in g.rollouts[:1]], [0.0])
                      for g in make_groups(4, seed=900 + i)] for i in range(warm)])
    key, shard = Identity.generate(), 32 << 20
    store = CheckpointDir(work / "coord")
    pub = Publisher(store, key, "bench", async_level=steps + 1, shard_size=shard, level=3, full_every=10 ** 6)
    rows = []
    for step in range(steps + 1):
        if step:
            train_batches(trainer, [make_groups(4, seed=100 + step)])
        t0 = time.perf_counter()
        p = pub.publish(step, trainer.weights_for_broadcast(), adapter=trainer.adapter_for_broadcast())
        seconds = time.perf_counter() - t0
        row = {"step": step, "encoding": p.encoding, "published_bytes": p.compressed_bytes,
               "publish_seconds": round(seconds, 2)}
        if step:
            m = store.manifest(step)
            assert m is not None and m.lora is not None  # published just now, as an adapter
            row["adapter_rank"] = m.lora.rank
            adapter = work / f"adapter-{step}.safetensors"

            reconstruct_payload(m, DirShardReader(store.step_dir(step), m), adapter)
            prev_adapter = work / f"adapter-{step - 1}.safetensors"
            if prev_adapter.is_file():  # deltas between adapters: same layout, xor against the previous one
                x = pack_checkpoint(adapter, work / f"ax-{step}", identity=key, step=step, run_id="x",
                                    base_payload=prev_adapter, base_step=step - 1, shard_size=shard, level=3)
                row["adapter_xor_delta_bytes"] = x.compressed_size
            full = pack_checkpoint(store.payload_path(step), work / f"full-{step}", identity=key, step=step,
                                   run_id="x", shard_size=shard, level=3)
            delta: dict[str, Any] = dict(identity=key, step=step, run_id="x", base_payload=store.payload_path(step - 1),
                         base_step=step - 1, shard_size=shard, level=3)
            xor = pack_checkpoint(store.payload_path(step), work / f"xor-{step}", **delta)
            row.update(full_bytes=full.compressed_size, xor_delta_bytes=xor.compressed_size)
            if sparse:  # the merged update B @ A touches every weight of a target matrix: little for sparse to skip
                sp = pack_checkpoint(store.payload_path(step), work / f"sparse-{step}", encoding="sparse-delta",
                                     **delta)
                row["sparse_delta_bytes"] = sp.compressed_size
                shutil.rmtree(work / f"sparse-{step}", ignore_errors=True)
            row.update(full_over_adapter=round(full.compressed_size / p.compressed_bytes, 1),
                       xor_over_adapter=round(xor.compressed_size / p.compressed_bytes, 1))
            for d in (f"full-{step}", f"xor-{step}", f"ax-{step}"):  # the 0.5B model's would fill the disk
                shutil.rmtree(work / d, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    last = trainer.adapter_for_broadcast()
    assert last is not None  # trainer.lora is on
    return {"rank": rank, "alpha": alpha, "warm": warm, "target_modules": list(cfg.lora.target_modules),
            "adapter_parameters": sum(t.numel() for t in last.tensors.values()), "rows": rows, "work": str(work)}


def print_table(name: str, doc: dict) -> None:
    rows = doc["rows"]
    print(f"\n{name}, rank {doc['rank']}, alpha {doc['alpha']}, targets {','.join(doc['target_modules'])}, bf16, "
          f"zstd 3 (warm-started adapter: {bool(doc['warm'])})")
    print(f"{'step':>4} {'adapter B':>11} {'rank':>4} {'adapter xor B':>13} {'xor-delta B':>12} {'sparse B':>12} "
          f"{'full B':>12} {'full/adapter':>12} {'xor/adapter':>11}")
    for r in rows[1:]:
        print(f"{r['step']:>4} {r['published_bytes']:>11,} {r['adapter_rank']:>4} "
              f"{r.get('adapter_xor_delta_bytes', 0):>13,} {r['xor_delta_bytes']:>12,} "
              f"{r.get('sparse_delta_bytes', 0):>12,} {r['full_bytes']:>12,} "
              f"{r['full_over_adapter']:>12} {r['xor_over_adapter']:>11}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warm", type=int, default=1, help="warm-start (Trainer.sft) steps before step 0: they train "
                    "the base, as a run's warm start does, and leave the adapter at init")
    ap.add_argument("--targets", default=",".join(ATTENTION), help="trainer.lora.target_modules, comma-separated "
                    f"(peft's llama default: {','.join(PEFT_LLAMA)})")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of SmolLM2-135M")
    ap.add_argument("--qwen05b", action="store_true", help="a randomly initialised model of Qwen2-0.5B's shape "
                    "(494M parameters: 24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4,864, vocabulary 151,936, "
                    "q/k/v biases, tied embeddings) instead of SmolLM2-135M")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_bytes.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lora-bytes-"))
    model, name = model_for("tiny" if args.tiny else "qwen05b" if args.qwen05b else "smollm2", work)
    doc = measure(model, rank=args.rank, alpha=args.alpha, steps=args.steps, warm=args.warm,
                  targets=args.targets.split(","), work=work)
    print_table(name, doc)
    doc.pop("work")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": name, **doc}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
