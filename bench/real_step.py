"""Where a real step's time goes: one RL step of SmolLM2-135M-Instruct (node/real_model.py) broken down by stage.

The stages are those of a coordinator with one transformers node at verification fraction 1, run in one process
on the components' own code, in the order the critical path takes them (with one node nothing overlaps: the
trainer waits for the node's rollouts and their replays, the node waits for the next step's weights):

  generate      the node's TransformersBackend.generate: P prompts x G samples x T tokens, fp32 (model.dtype)
  verify        the coordinator's replay of every rollout against the claimed step (verify.rollouts.judge, fp32)
  train         Trainer.add_group for each group and Trainer.step (forward, backward, AdamW)
  save_state    the trainer's crash-safe snapshot written before publishing (node/trainer/state.py)
  publish       weights_for_broadcast + Publisher.publish: pack, sign, zstd (xor-delta against the last step)
  policy_store  the coordinator's verifier copy of the new weights (PolicyStore.put)
  node_unpack   the node's verify + unpack of that checkpoint and the load into its backend (the loopback
                HTTP transfer itself is left out: bench/pipeline.py measures it)

`--before REV` runs the same stages with the code of an older revision (exported with `git archive`) in a
second child process, one after the other in the same run, with the same prompts and seeds: the before/after
ratios are what count on a shared machine. Load averages before and after each child are recorded.

    .venv/bin/python bench/real_step.py [--before REV] [--prompts 8 --samples 8 --tokens 48 --steps 2]

Writes bench/results/real_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("generate", "verify", "train", "save_state", "publish", "policy_store", "node_unpack")
TASK = "reasoning-gym:basic_arithmetic"


def child(a: argparse.Namespace) -> None:
    """Run the stages with whatever code is first on sys.path (this tree or an exported older one)."""
    import torch

    from node.checkpoint_dir import CheckpointDir
    from node.config import TrainerConfig
    from node.coordinator.publisher import Publisher
    from node.coordinator.verification import PolicyStore
    from node.envs import load_task
    from node.envs.prompt import decode_completion, encode_prompt
    from node.trainer import Group, Rollout, Trainer
    from node.trainer.tokenizer import load_tokenizer
    from node.worker.backends.base import GenRequest
    from node.worker.backends.transformers_backend import TransformersBackend
    from protocol.checkpoint import unpack_checkpoint
    from protocol.identity import Identity
    from verify.rollouts import judge, turn_items

    model_dir = Path(a.model)
    work = Path(a.work)
    replay_only = a.replay_only  # generate + verify only (the stages the --before comparison is about)
    tok = load_tokenizer(model_dir)
    eos = int(tok.eos_token_id)
    task = load_task(TASK, {})
    problems = [task.sample(a.seed, i) for i in range(a.prompts * (a.steps + 1))]
    backend = TransformersBackend(model_dir, dtype="float32", device="cpu")
    # Rewards on this task are ~0 for a 135M model: keep every group so that each step trains on a full batch.
    cfg = TrainerConfig(lr=2e-6, buffer={"online_difficulty_filtering": False})
    policies = PolicyStore(model_dir, keep=3)
    if replay_only:
        policies.put(0, {})  # the model directory's own weights
    else:
        trainer = Trainer(model_dir, cfg, batch_prompts=a.prompts, state_dir=work / "trainer_state")
        identity = Identity.generate()
        store = CheckpointDir(work / "ckpt")
        publisher = Publisher(store, identity, "real-step", async_level=1, shard_size=32 << 20, level=1,
                              full_every=1000)
        state = trainer.weights_for_broadcast()
        publisher.publish(0, state)
        policies.put(0, state)
    node_dir = work / "node"
    rows = []
    for n in range(1, a.steps + 1):
        t: dict[str, float] = {}
        probs = problems[(n - 1) * a.prompts: n * a.prompts]
        prompts = [encode_prompt(tok, p) for p in probs]
        reqs = [GenRequest(prompt_ids=p, seed=(n * 1000 + i) * 100 + j) for i, p in enumerate(prompts)
                for j in range(a.samples)]
        t0 = time.perf_counter()
        res = backend.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=a.tokens, eos_token_id=eos)
        t["generate"] = time.perf_counter() - t0
        items = [it for q, r in zip(reqs, res)
                 for it in turn_items(q.prompt_ids, r, q.seed, 1.0, 1.0, a.tokens, eos)]
        t0 = time.perf_counter()
        verdicts = judge(policies.get(0 if replay_only else n - 1), items)
        t["verify"] = time.perf_counter() - t0
        rejected = sum(v.reason is not None for v in verdicts)
        rewards = [task.score(probs[i // a.samples], decode_completion(tok, r.completion_ids))
                   for i, r in enumerate(res)]
        if replay_only:
            rows.append({"step": n, "seconds": t, "rollouts": len(res), "rejected": rejected,
                         "completion_tokens": sum(len(r.completion_ids) for r in res),
                         "prompt_tokens": sum(len(p) for p in prompts), "loadavg": os.getloadavg()[0]})
            print(f"  step {n}: " + ", ".join(f"{k} {v:.1f}s" for k, v in t.items()) + f"; rejected {rejected}",
                  flush=True)
            continue
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            rs = [Rollout(completion_ids=r.completion_ids, inference_logprobs=r.logprobs, reward=rewards[i * a.samples + j],
                          policy_step=n - 1, finish_reason=r.finish_reason)
                  for j, r in enumerate(res[i * a.samples:(i + 1) * a.samples])]
            trainer.add_group(Group(prompt_id=f"p{n}-{i}", prompt_ids=p, rollouts=rs))
        metrics = trainer.step()
        t["train"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.save_state()
        t["save_state"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = trainer.weights_for_broadcast()
        pub = publisher.publish(n, state)
        t["publish"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        policies.put(n, state)
        t["policy_store"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = store.payload_path(n - 1)
        unpack_checkpoint(store.step_dir(n), node_dir / str(n), trusted_keys={identity.public_hex},
                          base=base if pub.encoding != "full" else None, threads=2)
        backend.load_payload(node_dir / str(n) / "model.safetensors", n)
        t["node_unpack"] = time.perf_counter() - t0
        shutil.rmtree(node_dir / str(n - 1), ignore_errors=True)
        tokens = sum(len(r.completion_ids) for r in res)
        rows.append({"step": n, "seconds": t, "total_seconds": sum(t.values()), "rollouts": len(res),
                     "completion_tokens": tokens, "prompt_tokens": sum(len(p) for p in prompts),
                     "rejected": rejected, "reward_mean": sum(rewards) / len(rewards), "encoding": pub.encoding,
                     "compressed_bytes": pub.compressed_bytes, "train_metrics_seconds": float(metrics.get("seconds", 0)),
                     "loadavg": os.getloadavg()[0], "torch_threads": torch.get_num_threads()})
        print(f"  step {n}: " + ", ".join(f"{k} {v:.1f}s" for k, v in t.items()) + f"; rejected {rejected}",
              flush=True)
    Path(a.json).write_text(json.dumps(rows))


def run_tree(tree: Path, label: str, a: argparse.Namespace, work: Path, replay_only: bool = False) -> dict:
    out = work / f"{label}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "real_step.py"), "--child", "--json", str(out), "--model", a.model,
           "--work", str(work / label), "--prompts", str(a.prompts), "--samples", str(a.samples),
           "--tokens", str(a.tokens), "--steps", str(a.steps), "--seed", str(a.seed)]
    cmd += ["--replay-only"] if replay_only else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load0 = os.getloadavg()
    print(f"{label}: {tree}", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return {"tree": label, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "steps": json.loads(out.read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", metavar="REV", help="also run the stages with the code of this git revision")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="model directory (default: the cached real model)")
    ap.add_argument("--before-replay-only", action="store_true", help="run only generate + verify with the --before "
                    "code (the other stages' code is the same; saves most of the run on a loaded machine)")
    ap.add_argument("--replay-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "real_step.json"))
    ap.add_argument("--work", default="")
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not a.model:
        from node.real_model import model_dir

        a.model = str(model_dir())
    work = Path(tempfile.mkdtemp(prefix="real-step-"))
    try:
        runs = []
        if a.before:
            before = work / "before-tree"
            before.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
            runs.append(run_tree(before, f"before {a.before}", a, work, replay_only=a.before_replay_only))
        runs.append(run_tree(ROOT, "after", a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The first step of a child includes warm-up (first forward passes, page faults): report the later ones.
    table = {}
    for r in runs:
        steps = r["steps"][1:] or r["steps"]
        table[r["tree"]] = {s: sum(x["seconds"].get(s, 0.0) for x in steps) / len(steps) for s in STAGES}
        table[r["tree"]]["total"] = sum(table[r["tree"]][s] for s in STAGES)
    names = list(table)
    print(f"\n{a.prompts} prompts x {a.samples} samples x {a.tokens} tokens, {TASK}, verification fraction 1 "
          "(seconds per step, " + (f"mean of steps 2..{a.steps} of each run)" if a.steps > 1 else
                                   "step 1 of each run: includes each run's first-call warm-up)"))
    print(f"{'stage':<14}" + "".join(f"{n:>22}" for n in names) + ("   after/before" if len(names) == 2 else ""))
    for s in (*STAGES, "total"):
        vals = [table[n][s] for n in names]
        line = f"{s:<14}" + "".join(f"{v:>22.1f}" for v in vals)
        if len(vals) == 2 and vals[0] > 0:
            line += f"   {vals[1] / vals[0]:.2f}x"
        print(line)
    for r in runs:
        print(f"{r['tree']}: load average {r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after; "
              f"rejected {sum(x['rejected'] for x in r['steps'])}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({
        "config": {"prompts": a.prompts, "samples": a.samples, "tokens": a.tokens, "steps": a.steps, "task": TASK,
                   "model": Path(a.model).name, "before": a.before, "cpus": os.cpu_count()},
        "mean_seconds_per_step": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
