"""Scale-out benchmark: the FSDP2 trainer (node.trainer.distributed) on 1 and 2 CPU ranks, and verification
in-process vs a pool of 1 and 2 `prime-node verifier` processes.

Rows (bench/results/scale_out.json, {"rows": [...]}):

- `step`: seconds per optimizer step of the same global batch on a single-process Trainer (all cores),
  a 1-rank and a 2-rank Trainer on an FSDPRunner ("DistributedTrainer" in the rows; cores split between the
  ranks; gloo). `--hidden/--layers` pick the model (a Llama of the tiny-model family).
- `save` / `resume`: trainer state (model + AdamW moments) written and read back: the single-rank
  safetensors format, and the sharded torch.distributed.checkpoint format on 2 ranks (resume = building
  the trainer, loading dcp/; the model build is reported separately as `build`).
- `gather` / `pack`: the full bf16 state dict for the broadcast checkpoint gathered to rank 0
  (get_model_state_dict full_state_dict + cpu_offload), then packed as a signed checkpoint
  (protocol.checkpoint.pack_checkpoint, zstd level 1, 2 threads) -- on the `--big-shape` model: `0.5b`
  is Qwen2.5-0.5B's shape (hidden 896, 24 layers, MLP 4864, 14 heads / 2 KV heads, vocabulary 151,936,
  tied embeddings), `100m` a ~110 M Llama (hidden 768, 12 layers, vocabulary 32,000); random weights,
  after one tiny step so that the optimizer moments exist for save/resume.

- `verify`: seconds from the first of `--verify-submissions` submissions of honest rollouts (16 each,
  generated before the clock starts) to the last verdict, on a fresh coordinator per mode: in-process
  (ranks 0: the coordinator replays in its verification thread) or a pool of 1 / 2 verifier processes
  (ranks = verifiers; torch threads split between them). One warm-up submission first.

    .venv/bin/python bench/scale_out.py            # writes bench/results/scale_out.json
    .venv/bin/python bench/scale_out.py --big-shape 0.5b   # Qwen2.5-0.5B's shape (~6 GB of RAM per rank)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.trainer import Group  # noqa: E402
from node.trainer.config import FiltersConfig, TrainerConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_packing import make_groups as _packing_groups  # noqa: E402  (the random groups of that bench)


def make_groups(n: int, prompt_len: int, g: int, completion_len: int, vocab: int, seed: int) -> list[Group]:
    return _packing_groups(n, prompt_len, g, completion_len, vocab, seed, prefix=f"s{seed}")


def _cfg(args) -> TrainerConfig:
    return TrainerConfig(lr=1e-4, micro_batch_tokens=args.micro_batch_tokens, packing="shared_prompt",
                         filters=FiltersConfig(enabled=[]))


def _steps(trainer, args, vocab: int) -> list[float]:
    times = []
    for s in range(args.steps + 1):  # the first step warms up (allocations, optimizer state)
        for g in make_groups(args.groups, args.prompt, args.group_size, args.completion, vocab, seed=s):
            trainer.add_group(g)
        t0 = time.perf_counter()
        trainer.step(force=True)
        # add_group only queues in batch mode: the whole forward/backward happens inside step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def single_rank(model_dir: str, args, state_dir: str) -> list[dict]:
    from node.trainer import Trainer

    torch.set_num_threads(args.threads)
    t = Trainer(model_dir, _cfg(args), batch_prompts=args.groups, state_dir=state_dir)
    times = _steps(t, args, _vocab(Path(model_dir)))
    t0 = time.perf_counter()
    t.save_state()
    save = time.perf_counter() - t0
    del t
    t0 = time.perf_counter()
    Trainer.resume(state_dir, _cfg(args), batch_prompts=args.groups)
    resume = time.perf_counter() - t0
    return [{"what": "step", "trainer": "Trainer", "ranks": 1, "seconds": statistics.median(times),
             "all_seconds": times},
            {"what": "save", "trainer": "Trainer", "ranks": 1, "format": "safetensors", "seconds": save},
            {"what": "resume", "trainer": "Trainer", "ranks": 1, "format": "safetensors", "seconds": resume}]


def ranked(model_dir: str, args, state_dir: str, mode: str):
    """One rank of a run of the Trainer on an FSDPRunner (under node.trainer.distributed.run_ranks); its rows keep
    the label "DistributedTrainer" that bench/results/scale_out.json has."""
    from node.trainer import Trainer
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group, serve_follower

    rank, world = init_process_group(threads=max(1, args.threads // int(os.environ["WORLD_SIZE"])))
    try:
        if rank != 0:
            serve_follower()
            return None
        rows = []
        base = {"trainer": "DistributedTrainer", "ranks": world}
        t0 = time.perf_counter()
        t = Trainer(model_dir, _cfg(args), batch_prompts=args.groups, state_dir=state_dir, runner=FSDPRunner)
        rows.append({**base, "what": "build", "seconds": time.perf_counter() - t0})
        if mode == "step":
            times = _steps(t, args, _vocab(Path(model_dir)))
            rows.append({**base, "what": "step", "seconds": statistics.median(times), "all_seconds": times})
        else:  # the big model: one tiny step (optimizer moments exist), then state and broadcast costs
            for g in make_groups(1, 8, 2, 8, 1000, seed=0):
                t.add_group(g)
            t0 = time.perf_counter()
            t.step(force=True)
            rows.append({**base, "what": "tiny_step", "seconds": time.perf_counter() - t0})
            t0 = time.perf_counter()
            weights = t.weights_for_broadcast()
            rows.append({**base, "what": "gather", "seconds": time.perf_counter() - t0,
                         "bytes": sum(w.numel() * w.element_size() for w in weights.values())})
            rows.append(_pack(weights, base))
            del weights
        t0 = time.perf_counter()
        t.save_state()
        rows.append({**base, "what": "save", "format": "dcp", "seconds": time.perf_counter() - t0,
                     "bytes": _du(Path(state_dir))})
        t.close()
        return rows
    finally:
        destroy_process_group()


def ranked_resume(model_dir: str, args, state_dir: str):
    from node.trainer import Trainer
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group, serve_follower

    rank, world = init_process_group(threads=max(1, args.threads // int(os.environ["WORLD_SIZE"])))
    try:
        if rank != 0:
            serve_follower()
            return None
        t0 = time.perf_counter()
        t = Trainer.resume(state_dir, _cfg(args), batch_prompts=args.groups, runner=FSDPRunner)
        row = {"trainer": "DistributedTrainer", "ranks": world, "what": "resume", "format": "dcp",
               "seconds": time.perf_counter() - t0, "note": "includes building the model (see build)"}
        t.close()
        return [row]
    finally:
        destroy_process_group()


def _pack(weights, base) -> dict:
    from protocol.checkpoint import pack_checkpoint
    from protocol.identity import Identity

    out = Path(tempfile.mkdtemp(prefix="scale-out-pack-"))
    try:
        t0 = time.perf_counter()
        m = pack_checkpoint(weights, out / "ckpt", identity=Identity.generate(), step=1, run_id="bench", threads=2)
        return {**base, "what": "pack", "seconds": time.perf_counter() - t0, "bytes": m.total_size,
                "compressed_bytes": sum(s.zsize for s in m.shards)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


BIG_SHAPES = {
    # Qwen2.5-0.5B's shape (494 M parameters)
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    # a ~110 M model (GPT-2-small-like widths, Llama blocks, 32k vocabulary)
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
}


def build_big_model_dir(out: Path, shape: str) -> Path:
    """A model of the given shape as a Llama (random weights, no tokenizer: the trainer needs none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**BIG_SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         attention_bias=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# --- verification part: in-process replays vs a pool of 1 and 2 `prime-node verifier` processes ---------
def _honest(backend, assignment: dict, eos: int) -> list[dict]:
    from node.worker.backends.base import GenRequest

    reqs = [GenRequest(p["prompt_ids"], seed) for p in assignment["prompts"] for seed in p["seeds"]]
    s = assignment["sampling"]
    results = iter(backend.generate(reqs, temperature=s["temperature"], top_p=s["top_p"],
                                    max_tokens=s["max_tokens"], eos_token_id=eos))
    return [{"prompt_id": p["prompt_id"], "sample_index": j, **{k: getattr(r, k) for k in (
        "completion_ids", "logprobs", "finish_reason", "commitment")}}
            for p in assignment["prompts"] for j, r in zip(range(len(p["seeds"])), results)]


async def _verify_mode(work: Path, args, verifiers: int) -> dict:
    """Submissions of honest rollouts (generated before the clock starts) to a fresh coordinator; seconds
    from the first submission until every verdict is in. One warm-up submission first (model loads)."""
    import asyncio
    import subprocess

    import aiohttp

    from node.config import load_config
    from node.coordinator.app import start_server
    from node.coordinator.service import Coordinator
    from node.trainer.model import load_model
    from node.worker.backends.transformers_backend import TransformersBackend
    from node.worker.client import CoordinatorClient
    from protocol import messages as M
    from protocol.checkpoint import load_payload
    from protocol.identity import Identity

    keys = [Identity.generate() for _ in range(verifiers)]
    for i, k in enumerate(keys):
        k.save(work / f"v{i}.key")
    cfg = load_config(ROOT / "configs" / "local.toml", [
        f"storage.dir={work / 'coord'}", "trainer.warm_start_steps=0", "eval.every_steps=0",
        f"model.tiny_hidden_size={args.verify_hidden}", f"model.tiny_layers={args.verify_layers}",
        "model.tiny_heads=4", f"sampling.max_tokens={args.verify_tokens}", "run.batch_prompts=128",
        "run.max_assignments_per_node=64", "server.rate_limit_per_second=1000", "server.rate_limit_burst=1000",
        "verification.verifier_keys=[" + ",".join(f'"{k.public_hex}"' for k in keys) + "]"])
    coord = Coordinator(cfg, Identity.generate())
    runner, port = await start_server(coord, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    procs = [subprocess.Popen([sys.executable, "-m", "node.cli", "verifier", "--coordinator", base,
                               "--key", str(work / f"v{i}.key"), "--dir", str(work / f"v{i}")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // max(1, verifiers)))})
             for i in range(verifiers)]
    try:
        async with aiohttp.ClientSession() as session:
            node = CoordinatorClient(base, Identity.generate(), session)
            await node.join()
            backend = TransformersBackend(load_model(coord.model_dir))
            backend.load_state_dict(load_payload(coord.checkpoints.payload_path(0)), 0)
            subs = []
            for _ in range(args.verify_submissions + 1):
                a = await node.work(0)
                subs.append(M.SubmitRequest(assignment_id=a.assignment_id, policy_step=0, rollouts=_honest(
                    backend, a.model_dump(), coord.eos_token_id)))

            async def settle() -> None:
                while coord.ledger.undecided_submissions() or coord.verdicts.pending():
                    await asyncio.sleep(0.02)

            await node.submit(subs[0])  # warm-up: the verifiers fetch step 0 and load the model
            await asyncio.wait_for(settle(), 300)
            t0 = time.perf_counter()
            for sub in subs[1:]:
                await node.submit(sub)
            await asyncio.wait_for(settle(), 900)
            seconds = time.perf_counter() - t0
            counts = coord.ledger.verdict_counts()
            rollouts = sum(len(s.rollouts) for s in subs[1:])
            assert set(counts) == {"verified"}, counts  # every submission replayed and passed, none passed over
            tokens = sum(len(r.completion_ids) for s in subs[1:] for r in s.rollouts)
            return {"model": f"llama h{args.verify_hidden} L{args.verify_layers}", "what": "verify",
                    "trainer": "in-process" if not verifiers else "verifier pool", "ranks": verifiers,
                    "seconds": round(seconds, 3), "rollouts": rollouts, "completion_tokens": tokens,
                    "rollouts_per_s": round(rollouts / seconds, 1)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        await runner.cleanup()
        await coord.stop()


def verification_rows(work: Path, args) -> list[dict]:
    import asyncio

    rows = []
    for n in (0, 1, 2):
        d = work / f"verify-{n}"
        d.mkdir()
        rows.append(asyncio.run(_verify_mode(d, args, n)))
    return rows


def main() -> None:
    from node.trainer.distributed import run_ranks
    from node.trainer.model import build_tiny_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--micro-batch-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores, split between the ranks")
    p.add_argument("--big", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--big-shape", choices=sorted(BIG_SHAPES), default="100m",
                   help="model for the gather/pack/save/resume rows (0.5b: ~6 GB of RAM per rank)")
    p.add_argument("--small", action=argparse.BooleanOptionalAction, default=True, help="the step-time rows")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="the verification rows: in-process vs a pool of 1 and 2 verifier processes")
    p.add_argument("--verify-submissions", type=int, default=24, help="timed submissions (16 rollouts each)")
    p.add_argument("--verify-hidden", type=int, default=256)
    p.add_argument("--verify-layers", type=int, default=4)
    p.add_argument("--verify-tokens", type=int, default=32, help="sampling.max_tokens of the replayed rollouts")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale_out.json"))
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    rows: list[dict] = json.loads(Path(args.out).read_text())["rows"] if args.append else []

    def write(final: bool) -> None:
        result = {
            "benchmark": "scale_out",
            "part": "trainer and verification",
            "complete": final,
            "workload": {"groups_per_step": args.groups, "group_size": args.group_size, "prompt_len": args.prompt,
                         "completion_len": args.completion, "micro_batch_tokens": args.micro_batch_tokens,
                         "timed_steps": args.steps, "packing": "shared_prompt"},
            "machine": {"cpu_threads": args.threads, "torch": torch.__version__, "platform": platform.platform(),
                        "device": "cpu", "backend": "gloo", "load_average_at_end": os.getloadavg()},
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    def add(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        write(False)

    try:
        if args.small:
            small = build_tiny_model_dir(work / "small", hidden_size=args.hidden, layers=args.layers, heads=args.heads)
            from safetensors.torch import load_file
            small_params = sum(t.numel() for t in load_file(str(small / "model.safetensors")).values())
            model_small = {"model": f"llama h{args.hidden} L{args.layers}", "params": small_params}
            print(f"step model: {model_small}", flush=True)
            for r in single_rank(str(small), args, str(work / "state-1")):
                add({**model_small, **r})
            for world in (1, 2):
                state = str(work / f"state-dcp-{world}")
                for r in run_ranks(world, ranked, str(small), args, state, "step", timeout=1200)[0]:
                    add({**model_small, **r})
                for r in run_ranks(world, ranked_resume, str(small), args, state, timeout=1200)[0]:
                    add({**model_small, **r})
        if args.verify:
            for r in verification_rows(work, args):
                add(r)
        if args.big:
            big = build_big_model_dir(work / "big", args.big_shape)
            from safetensors import safe_open
            with safe_open(str(big / "model.safetensors"), "pt") as f:
                n = sum(int(torch.Size(f.get_slice(k).get_shape()).numel()) for k in f.keys())
            model_big = {"model": f"{args.big_shape}-shaped llama", "params": n}
            state = str(work / "state-big")
            for r in run_ranks(2, ranked, str(big), args, state, "big", timeout=1800)[0]:
                add({**model_big, **r})
            for r in run_ranks(2, ranked_resume, str(big), args, state, timeout=1800)[0]:
                add({**model_big, **r})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'model':28} | {'what':9} | {'trainer':18} | {'ranks':>5} | {'seconds':>8} | {'MB':>8}")
    print("-" * 92)
    for r in rows:
        mb = f"{r['bytes'] / 2**20:8.0f}" if "bytes" in r else " " * 8
        rate = f" | {r['rollouts_per_s']:.1f} rollouts/s ({r['rollouts']})" if "rollouts_per_s" in r else ""
        print(f"{r['model']:28} | {r['what']:9} | {r['trainer']:18} | {r['ranks']:>5} | {r['seconds']:8.2f} | {mb}{rate}")
    write(True)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
