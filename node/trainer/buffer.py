"""Difficulty pools (easy / normal / hard per problem, persisted) and online difficulty filtering.

The pools record, per problem, whether its last group was solved by every sample (easy), by none (hard) or
in between; they are saved with the trainer and shown in the step metrics. The coordinator's scheduler
oversamples by 1 / `keep_rate` so that a batch still fills when all-0 / all-1 groups are dropped.
"""
from __future__ import annotations

import json
import random
from collections import deque
from typing import Any

from protocol.errors import PrimeNodeError

POOLS = ("easy", "normal", "hard")
MAX_TRACKED_PROBLEMS = 1_000_000  # bound the persisted JSON


class BufferStateError(PrimeNodeError):
    pass


class DifficultyPools:
    def __init__(self, easy_threshold: float = 1.0, hard_threshold: float = 0.0) -> None:
        self.easy_threshold = easy_threshold
        self.hard_threshold = hard_threshold
        self.pool: dict[str, str] = {}  # prompt_id -> pool; absent means normal

    def classify(self, mean_reward: float) -> str:
        if mean_reward >= self.easy_threshold:
            return "easy"
        if mean_reward <= self.hard_threshold:
            return "hard"
        return "normal"

    def update(self, prompt_id: str, mean_reward: float) -> str:
        """Record a problem's latest group mean reward; returns its pool."""
        pool = self.classify(mean_reward)
        if pool == "normal":
            self.pool.pop(prompt_id, None)
        elif prompt_id in self.pool or len(self.pool) < MAX_TRACKED_PROBLEMS:
            self.pool[prompt_id] = pool
        return pool

    def pool_of(self, prompt_id: str) -> str:
        return self.pool.get(prompt_id, "normal")

    def counts(self) -> dict[str, int]:
        c = {"easy": 0, "hard": 0}
        for p in self.pool.values():
            c[p] += 1
        return c

    def lift(self, easy_fraction: float, hard_fraction: float, seed: int) -> dict[str, int]:
        """Move a random share of easy/hard problems back to normal (done on resume)."""
        rng = random.Random(seed)
        lifted = {"easy": 0, "hard": 0}
        for name, frac in (("easy", easy_fraction), ("hard", hard_fraction)):
            members = sorted(pid for pid, p in self.pool.items() if p == name)
            for pid in rng.sample(members, round(len(members) * frac)):
                del self.pool[pid]
                lifted[name] += 1
        return lifted

    def to_json(self) -> dict[str, Any]:
        return {"easy_threshold": self.easy_threshold, "hard_threshold": self.hard_threshold,
                "pool": dict(sorted(self.pool.items()))}

    @classmethod
    def from_json(cls, data: Any) -> "DifficultyPools":
        try:
            pools = cls(float(data["easy_threshold"]), float(data["hard_threshold"]))
            raw = data["pool"]
            if not isinstance(raw, dict) or len(raw) > MAX_TRACKED_PROBLEMS:
                raise BufferStateError("difficulty pools: 'pool' must be a bounded object")
            for pid, p in raw.items():
                if not isinstance(pid, str) or p not in ("easy", "hard"):
                    raise BufferStateError(f"difficulty pools: bad entry {pid!r}: {p!r}")
                pools.pool[pid] = p
        except (KeyError, TypeError, ValueError) as e:
            raise BufferStateError(f"difficulty pools state is malformed: {e}") from None
        return pools

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path) -> "DifficultyPools":
        with open(path) as f:
            return cls.from_json(json.load(f))


def uninformative(rewards: list[float], low: float = 0.0, high: float = 1.0) -> bool:
    """All rewards at the floor or all at the ceiling: the group carries no learning signal."""
    return all(r <= low for r in rewards) or all(r >= high for r in rewards)


class KeepRate:
    """Share of recently offered groups that were trained on (for the scheduler's oversampling)."""

    def __init__(self, window: int = 256) -> None:
        self.recent: deque[bool] = deque(maxlen=window)

    def record(self, kept: bool) -> None:
        self.recent.append(kept)

    @property
    def value(self) -> float:
        # Optimistic before any evidence: the scheduler starts without oversampling.
        return sum(self.recent) / len(self.recent) if self.recent else 1.0

    def to_json(self) -> list[int]:
        return [int(x) for x in self.recent]

    def load_json(self, data: Any) -> None:
        if not isinstance(data, list) or not all(x in (0, 1) for x in data):
            raise BufferStateError("keep-rate history must be a list of 0/1")
        self.recent.extend(bool(x) for x in data[-(self.recent.maxlen or 0):])
