"""Rollout filters: drop samples that would only teach noise. Each returns True to DROP a rollout."""
from __future__ import annotations

from typing import Any, Callable

from node.trainer.types import Rollout

RolloutFilter = Callable[[Rollout, float], bool]  # (rollout, its advantage) -> drop?


def is_gibberish(rollout: Rollout, *, min_mean_logprob: float) -> bool:
    """The sampler itself found the text very unlikely on average: typical of degenerate noise."""
    lps = rollout.inference_logprobs
    return bool(lps) and sum(lps) / len(lps) < min_mean_logprob


def repetition_fraction(ids: list[int], n: int) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same sequence."""
    total = len(ids) - n + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(total):
        gram = tuple(ids[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / total


def is_repetitive(rollout: Rollout, *, n: int, threshold: float, min_tokens: int) -> bool:
    ids = rollout.completion_ids
    return len(ids) >= min_tokens and repetition_fraction(ids, n) > threshold


def build_filters(cfg: Any) -> dict[str, RolloutFilter]:
    """The filters named in `trainer.filters.enabled`, in order, bound to their thresholds."""
    available: dict[str, RolloutFilter] = {
        "gibberish": lambda r, a: is_gibberish(r, min_mean_logprob=cfg.gibberish_min_mean_logprob),
        "repetition": lambda r, a: is_repetitive(r, n=cfg.repetition_ngram, threshold=cfg.repetition_threshold,
                                                 min_tokens=cfg.repetition_min_tokens),
        "zero_advantage": lambda r, a: abs(a) <= cfg.zero_advantage_eps,
    }
    return {name: available[name] for name in cfg.enabled}


def apply_filters(filters: dict[str, RolloutFilter], rollouts: list[Rollout],
                  advantages: list[float]) -> tuple[list[int], dict[str, int]]:
    """Indices of the rollouts kept, and how many each filter dropped (first matching filter counts)."""
    kept: list[int] = []
    dropped = {name: 0 for name in filters}
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        for name, f in filters.items():
            if f(r, a):
                dropped[name] += 1
                break
        else:
            kept.append(i)
    return kept, dropped
