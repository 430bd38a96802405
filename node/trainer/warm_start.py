"""A short supervised warm start on a task's reference answers, run before RL step 1.

From random init a tiny model almost never emits a correct character, so policy gradient has no
signal to amplify. A few SFT steps on reference completions give it a foothold (deliberately small:
reward should still be low enough that RL's improvement is visible). Uses its own AdamW so that the
RL optimizer starts clean; does not advance `trainer.step_count`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from node.envs import encode_prompt
from node.trainer.types import Group, Rollout

if TYPE_CHECKING:
    from node.trainer.trainer import Trainer


def reference_groups(task, tokenizer, *, seed: int, start: int, count: int) -> list[Group]:
    groups = []
    for index in range(start, start + count):
        problem = task.sample(seed, index)
        ref = task.reference(problem)
        if ref is None:
            raise ValueError(f"task {getattr(task, 'name', task)!r} has no reference answers for a warm start")
        ids = tokenizer(ref, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        groups.append(Group(problem.prompt_id, encode_prompt(tokenizer, problem),
                            [Rollout(ids, [0.0] * len(ids), 1.0)], [0.0]))
    return groups


def sft_warm_start(trainer: Trainer, task, tokenizer, *, steps: int, batch_size: int = 16, lr: float | None = None,
                   seed: int = 10_000) -> list[float]:
    """Run `steps` SFT steps on the trainer's model (Trainer.sft, whichever its runner); returns the per-token
    NLL of each step.

    `seed` defaults to a range the RL run does not sample from (the RL run uses its own seed).
    """
    batches = (reference_groups(task, tokenizer, seed=seed, start=s * batch_size, count=batch_size)
               for s in range(steps))  # built one step at a time, as the steps run
    return trainer.sft(batches, lr)
