"""Per-group advantages: reward − group mean (DR-GRPO) by default, length penalties layered on top."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from node.plugins import PluginError, import_object
from node.trainer.types import Rollout


@dataclass
class AdvantageInputs:
    rollouts: list[Rollout]  # one group: the G samples of one prompt


@dataclass
class AdvantageOutputs:
    advantages: list[float]  # one per rollout, same order


def drgrpo_advantages(inputs: AdvantageInputs, *, std_normalize: bool = False, eps: float = 1e-6) -> AdvantageOutputs:
    """reward − mean(rewards of the group); divided by the group's std when `std_normalize` (GRPO)."""
    rewards = [float(r.reward) for r in inputs.rollouts]
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if std_normalize:
        std = math.sqrt(sum(a * a for a in adv) / len(adv))
        adv = [a / (std + eps) for a in adv]
    return AdvantageOutputs(advantages=adv)


def apply_length_penalty(advantages: list[float], rollouts: list[Rollout], kind: str, coef: float) -> list[float]:
    """Subtract coef · (relative excess length) so that, among equally rewarded samples, shorter wins.

    The penalty is centred on the group mean, so it never shifts the group's average advantage:
    `tokens` uses completion length relative to the group mean length, `turns` the number of turns.
    """
    if kind == "none" or coef == 0 or len(rollouts) < 2:
        return list(advantages)
    if kind == "tokens":
        sizes = [float(len(r.completion_ids)) for r in rollouts]
    elif kind == "turns":
        sizes = [float(r.turns) for r in rollouts]
    else:
        raise ValueError(f"unknown length penalty {kind!r}")
    mean = sum(sizes) / len(sizes)
    scale = max(mean, 1.0)
    return [a - coef * (s - mean) / scale for a, s in zip(advantages, sizes)]


def resolve_advantage(cfg: Any) -> Callable[[list[Rollout]], list[float]]:
    """From `trainer.advantage`: a function rollouts -> advantages (base estimator, then penalties)."""
    if cfg.type == "custom":
        fn = import_object(cfg.import_path)
        if not callable(fn):
            raise PluginError(f"advantage {cfg.import_path!r} is not callable")
        kwargs = dict(cfg.kwargs)
        base = lambda inputs: fn(inputs, **kwargs)  # noqa: E731
    else:
        base = lambda inputs: drgrpo_advantages(inputs, std_normalize=cfg.std_normalize)  # noqa: E731

    def compute(rollouts: list[Rollout]) -> list[float]:
        out = base(AdvantageInputs(rollouts=rollouts))
        adv = [float(a) for a in out.advantages]
        if len(adv) != len(rollouts) or not all(math.isfinite(a) for a in adv):
            raise ValueError("advantage function must return one finite value per rollout")
        return apply_length_penalty(adv, rollouts, cfg.length_penalty, cfg.length_penalty_coef)

    return compute
