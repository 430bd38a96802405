"""reverse-text: write the given string backwards; partial credit by longest common subsequence."""
from __future__ import annotations

import random

from pydantic import Field, model_validator

from node.envs.base import Problem, Task, TaskKwargs


class ReverseTextKwargs(TaskKwargs):
    min_len: int = Field(3, ge=1, le=64)
    max_len: int = Field(6, ge=1, le=64)
    alphabet: str = Field("abcdefghijklmnopqrstuvwxyz", min_length=2, max_length=128)

    @model_validator(mode="after")
    def _ordered(self) -> "ReverseTextKwargs":
        if self.min_len > self.max_len:
            raise ValueError("min_len must not exceed max_len")
        return self


def lcs_length(a: str, b: str) -> int:
    """Classic O(len(a)·len(b)) dynamic programme, one row at a time."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


class ReverseText(Task):
    name = "reverse-text"
    Kwargs = ReverseTextKwargs
    kwargs: ReverseTextKwargs

    def make_problem(self, rng: random.Random) -> tuple[str, str]:
        k = self.kwargs
        text = "".join(rng.choice(k.alphabet) for _ in range(rng.randint(k.min_len, k.max_len)))
        return text, text[::-1]

    def score(self, problem: Problem, completion: str) -> float:
        # Dividing by the longer length punishes both missing and extra characters.
        target, got = problem.answer, completion.strip()[:256]  # bounded work on untrusted text
        if not got:
            return 0.0
        return lcs_length(got, target) / max(len(got), len(target))

    def reference(self, problem: Problem) -> str:
        return problem.answer
