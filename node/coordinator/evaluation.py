"""Evaluation during training: greedy decoding of held-out prompts with the coordinator's current policy.

Every `eval.every_steps` published steps (and once for θ_0 and once for the run's last step,
`run.max_steps`, so a run's curve ends with the policy it ends with) the training thread, between two steps,
decodes `eval.prompts` held-out prompts greedily with the trainer's own model (the fp32 weights of
θ_n, of which workers sample the broadcast dtype) and scores them with the task's reward. That is the
simplest correct choice: the trainer thread owns the model, so nothing is copied or locked, and on the
demo's tiny model one evaluation costs a few tens of milliseconds. On a large model it costs a batch of
generation on the trainer's device each time, during which the next step waits: keep it infrequent.

With `trainer.ranks > 1` the trainer's model is sharded (FSDP2) over processes that execute only what
rank 0 broadcasts, so decoding with it from rank 0 alone waited for ever in its first all-gather. There,
every rank takes part in one GATHER command -- the one each publish already issues, so no new lockstep
protocol -- and rank 0 decodes with a plain, unsharded copy of the same fp32 weights on the CPU
(`model_to_evaluate`). Decoding then runs no collective at all: it cannot hang on a rank, its numbers are
those of a single-rank run, and its variable length (early EOS, environment turns that only rank 0 can
play) needs no agreement between ranks. Cost: one gather per evaluation and one CPU copy of the model
on rank 0 (the verifier's PolicyStore already keeps several).

Held out: training draws problems `task.sample(run.seed, i)` for i = 0, 1, 2, ... (the scheduler, and
intake's rescoring). Evaluation draws `task.sample(eval_seed(run.seed), i)` for i < eval.prompts, a
separate seed stream of the task's generator that the training run never reads. (Where a task's problem
space is tiny, e.g. 4-character strings, the same *text* can appear in both streams; the *draws* are
disjoint.)

The curve is kept in memory and appended to `<storage>/eval.jsonl` (one JSON object per evaluation), so
a restarted coordinator shows it again; points newer than the step it resumes from are dropped.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from node.envs import encode_prompt
from node.envs.prompt import decode_completions
from node.envs.episode import next_env_ids, score_episode

log = logging.getLogger("prime_node.evaluation")

EVAL_SEED_OFFSET = 1_000_003  # eval's seed stream: run.seed + this, never run.seed itself
WARM_START_SEED_OFFSET = 2_000_003  # the warm start's reference answers: a third stream
EVAL_FILE = "eval.jsonl"
CURVE_POINTS = 1000  # status lists at most this many points (thinned like the reward curve)


def model_to_evaluate(trainer):
    """The model whose greedy decoding is the evaluation (Trainer.full_model): the trainer's own on one rank,
    rank 0's unsharded copy when its runner shards the model over ranks (node/trainer/distributed.py)."""
    return trainer.full_model()


def eval_seed(run_seed: int) -> int:
    return int(run_seed) + EVAL_SEED_OFFSET


def warm_start_seed(run_seed: int) -> int:
    return int(run_seed) + WARM_START_SEED_OFFSET


class Evaluator:
    """Owned by the training thread (run() touches the trainer's model); `curve` may be read from any
    thread (a list that is only ever appended to or replaced whole)."""

    def __init__(self, *, task, tokenizer, run_seed: int, prompts: int, every_steps: int, max_tokens: int,
                 batch_size: int, root: Path | None = None, metrics=None, final_step: int = 0):
        self.task = task
        self.every_steps = every_steps
        self.final_step = final_step  # run.max_steps (0: none): the policy a run ends with is always evaluated
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.metrics = metrics
        self.path = Path(root) / EVAL_FILE if root is not None else None
        seed = eval_seed(run_seed)
        self.problems = [task.sample(seed, i) for i in range(prompts)]
        self.prompt_ids = [list(encode_prompt(tokenizer, p)) for p in self.problems]
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.tokenizer = tokenizer
        self.curve: list[dict] = []

    @classmethod
    def for_run(cls, cfg, model, *, storage, metrics) -> "Evaluator | None":
        """From the config's `eval` section (None when evaluation is off), for the run's model and task."""
        e = cfg.eval
        if e.every_steps <= 0:
            return None
        return cls(task=model.task, tokenizer=model.tokenizer, run_seed=cfg.run.seed, prompts=e.prompts,
                   every_steps=e.every_steps, max_tokens=cfg.sampling.max_tokens, batch_size=e.batch_size,
                   root=storage, metrics=metrics, final_step=cfg.run.max_steps)

    # -- persistence -------------------------------------------------------------------------------
    def restore(self, published_step: int) -> None:
        """Read the curve back, keeping points up to the step the run resumes from (a crash may have
        evaluated a step that the ledger never recorded: it is redone)."""
        rows: list[dict] = []
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= published_step:
                    rows.append(row)
            rows = list({r["step"]: r for r in rows}.values())  # one point per step, the newest
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.curve = rows
        if rows:
            self._export(rows[-1])

    def due(self, step: int) -> bool:
        """Every `every_steps` steps, θ_0, and the run's last step (`run.max_steps`), each once."""
        if self.every_steps <= 0 or (self.curve and self.curve[-1]["step"] >= step):
            return False
        return step % self.every_steps == 0 or step == self.final_step

    # -- evaluation --------------------------------------------------------------------------------
    def run(self, model, step: int) -> dict:
        t0 = time.monotonic()
        # Episodes, played greedily turn by turn (a single-turn task's episode is its one completion).
        sequences = [list(ids) for ids in self.prompt_ids]
        turns: list[list[list[int]]] = [[] for _ in sequences]
        live = list(range(len(sequences)))
        while live:
            outs = greedy_decode(model, [sequences[i] for i in live], max_tokens=self.max_tokens, eos_id=self.eos_id,
                                 pad_id=self.pad_id, batch_size=self.batch_size)
            going = []
            for i, c in zip(live, outs):
                turns[i].append(c)
                finish = "stop" if c and c[-1] == self.eos_id else "length"
                env = next_env_ids(self.task, self.tokenizer, self.problems[i], turns[i], finish)
                if env is not None:
                    sequences[i] += c + env
                    going.append(i)
            live = going
        rewards = [score_episode(self.task, p, decode_completions(self.tokenizer, ts))
                   for p, ts in zip(self.problems, turns)]
        row = {"step": int(step), "reward": sum(rewards) / max(1, len(rewards)), "n": len(rewards),
               "exact": sum(r >= 1.0 for r in rewards), "seconds": round(time.monotonic() - t0, 4)}
        self.curve = self.curve + [row]
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        self._export(row)
        log.info("eval at step %d: mean reward %.3f over %d held-out prompts (%d exact), %.2f s",
                 step, row["reward"], row["n"], row["exact"], row["seconds"])
        return row

    def _export(self, row: dict) -> None:
        if self.metrics is not None:
            self.metrics.eval_reward.set(row["reward"])
            self.metrics.eval_step.set(row["step"])


def greedy_decode(model, prompts: list[list[int]], *, max_tokens: int, eos_id: int, pad_id: int,
                  batch_size: int = 64) -> list[list[int]]:
    """Greedy completions (EOS included when produced), batched with left padding and a KV cache.

    Leaves the model's train/eval mode as it found it and the global RNG untouched (argmax only)."""
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[int]] = []
    try:
        with torch.no_grad():
            for b in range(0, len(prompts), batch_size):
                chunk = prompts[b:b + batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                res = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
                past, logits = res.past_key_values, res.logits[:, -1]
                tokens: list[list[int]] = [[] for _ in chunk]
                done = [False] * len(chunk)
                for _ in range(max_tokens):
                    nxt = logits.float().argmax(-1)
                    for i, t in enumerate(nxt.tolist()):
                        if not done[i]:
                            tokens[i].append(t)
                            done[i] = t == eos_id
                    if all(done):
                        break
                    mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=mask.dtype, device=device)], dim=1)
                    positions = positions[:, -1:] + 1
                    res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                                past_key_values=past, use_cache=True)
                    past, logits = res.past_key_values, res.logits[:, -1]
                out.extend(tokens)
    finally:
        model.train(was_training)
    return out
