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
    """Length of the longest common subsequence, bit-parallel (Hyyrö 2004; Crochemore et al. 2001): one bit per
    character of the shorter string in a Python int, one addition and a few bit operations per character of the
    other. The same answer as the O(len(a)·len(b)) dynamic programme (tests/unit/test_envs.py compares them) for
    a fraction of the CPU: the coordinator's intake scores every rollout of a submission while holding the GIL."""
    if len(a) > len(b):
        a, b = b, a
    if not a:
        return 0
    match: dict[str, int] = {}
    for i, c in enumerate(a):
        match[c] = match.get(c, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full  # a 0 bit: that position of `a` is in the longest common subsequence so far
    get = match.get
    for c in b:
        m = get(c)
        if m:  # a character that is not in `a` leaves v as it is (u = 0)
            u = v & m
            v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


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
