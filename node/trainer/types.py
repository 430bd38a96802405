"""What the coordinator hands the trainer: one prompt's group of rollouts. Plain Python, no torch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.errors import PrimeNodeError


MAX_ROLLOUTS_PER_GROUP = 1024


class RolloutError(PrimeNodeError):
    """A rollout or group that cannot be trained on (wrong shapes, bad numbers, unknown token ids)."""


@dataclass
class Rollout:
    completion_ids: list[int]
    inference_logprobs: list[float]  # the sampler's logprob of each completion token
    reward: float
    policy_step: int = 0
    finish_reason: str = "stop"  # "stop" | "length"
    teacher_logprobs: list[float] | None = None  # opd mode only
    turns: int = 1  # model turns (multi-turn tasks; the `turns` length penalty counts them)
    loss_mask: list[bool] | None = None  # multi-turn: False on the environment's tokens; None: train on all


@dataclass
class Group:
    prompt_id: str
    prompt_ids: list[int]
    rollouts: list[Rollout]
    # Filled by the trainer: one advantage per rollout (after penalties), aligned with `rollouts`.
    advantages: list[float] = field(default_factory=list)


def validate_group(group: Group, *, vocab_size: int, max_tokens: int, need_teacher: bool) -> None:
    """Reject malformed input before it reaches torch: ids in range, one finite logprob per token."""
    if not isinstance(group.prompt_id, str) or not group.prompt_id or len(group.prompt_id) > 256:
        raise RolloutError("group.prompt_id must be a non-empty string of at most 256 characters")
    if not group.prompt_ids:
        raise RolloutError(f"group {group.prompt_id}: empty prompt")
    if not group.rollouts:
        raise RolloutError(f"group {group.prompt_id}: no rollouts")
    if len(group.rollouts) > MAX_ROLLOUTS_PER_GROUP:
        raise RolloutError(f"group {group.prompt_id}: more than {MAX_ROLLOUTS_PER_GROUP} rollouts")
    _check_ids(group.prompt_ids, vocab_size, f"group {group.prompt_id} prompt")
    for i, r in enumerate(group.rollouts):
        where = f"group {group.prompt_id} rollout {i}"
        if not r.completion_ids:
            raise RolloutError(f"{where}: empty completion")
        if len(group.prompt_ids) + len(r.completion_ids) > max_tokens:
            raise RolloutError(f"{where}: prompt + completion longer than {max_tokens} tokens")
        _check_ids(r.completion_ids, vocab_size, where)
        if len(r.inference_logprobs) != len(r.completion_ids):
            raise RolloutError(f"{where}: {len(r.inference_logprobs)} logprobs for {len(r.completion_ids)} tokens")
        if not all(isinstance(x, (int, float)) and x <= 0 and math.isfinite(x) for x in r.inference_logprobs):
            raise RolloutError(f"{where}: logprobs must be finite numbers <= 0")
        if not (isinstance(r.reward, (int, float)) and math.isfinite(r.reward)):
            raise RolloutError(f"{where}: reward must be a finite number")
        if r.finish_reason not in ("stop", "length"):
            raise RolloutError(f"{where}: finish_reason must be 'stop' or 'length'")
        if not isinstance(r.turns, int) or r.turns < 1 or not isinstance(r.policy_step, int) or r.policy_step < 0:
            raise RolloutError(f"{where}: turns must be an int >= 1 and policy_step an int >= 0")
        if r.loss_mask is not None and (len(r.loss_mask) != len(r.completion_ids) or not any(r.loss_mask)
                                        or not all(isinstance(b, bool) for b in r.loss_mask)):
            raise RolloutError(f"{where}: loss_mask needs one bool per completion token, at least one True")
        if need_teacher:
            t = r.teacher_logprobs
            if t is None or len(t) != len(r.completion_ids):
                raise RolloutError(f"{where}: opd mode needs one teacher logprob per completion token")
            if not all(isinstance(x, (int, float)) and x <= 0 and math.isfinite(x) for x in t):
                raise RolloutError(f"{where}: teacher logprobs must be finite numbers <= 0")


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RolloutError(f"{where}: token id {t!r} outside the vocabulary (size {vocab_size})")
