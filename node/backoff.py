"""One retry policy for every loop that talks to the network: exponential backoff with jitter, so that
after a coordinator restart a thousand workers do not all retry in the same instant."""
from __future__ import annotations

import random
from typing import Callable


class Backoff:
    """`next()` gives the next delay: `base * 2**n` capped at `cap`, times a random factor in [0.5, 1]
    ("equal jitter": never less than half the nominal wait, never in lockstep); `reset()` after success."""

    def __init__(self, base: float, cap: float, *, rng: Callable[[], float] = random.random):
        if base <= 0 or cap < base:
            raise ValueError("backoff needs 0 < base <= cap")
        self.base, self.cap, self.rng = base, cap, rng
        self.attempts = 0

    def next(self) -> float:
        nominal = min(self.cap, self.base * 2 ** min(self.attempts, 62))
        self.attempts += 1
        return nominal * (0.5 + 0.5 * self.rng())

    def reset(self) -> None:
        self.attempts = 0
