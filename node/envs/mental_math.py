"""mental-math: one-step integer arithmetic asked in words, answered with the bare number; partial credit.

Made for a real small instruct model (the demo on SmolLM2-135M-Instruct, `make demo-real`, docs/BENCHMARKS.md
"Learning on a real model"): such a model mostly knows 7 * 8, but answers "7 * 8 = 56" (or a sentence)
however firmly it is told to reply with only the number. The reward shapes both sides of that:

- 1.0: the reply is the correct number and nothing else (surrounding whitespace and one final '.' allowed);
- `partial` (0.25 by default): the correct number is the last number of a longer reply ("7 * 8 = 56");
- 0: anything else (a wrong last number, no number, an empty reply).

Partial credit gives a gradient towards the right number from the start (GRPO needs rewards that differ
within a group), and full credit only for the bare answer gives RL something to learn that the model's
prior does not already do: θ_0 scores about `partial` x its accuracy.
"""
from __future__ import annotations

import random
import re

from pydantic import Field, model_validator

from node.envs.base import Problem, Task, TaskKwargs

_NUMBER = re.compile(r"-?\d+")
SCORED_CHARS = 256  # only this much of a reply is read: bounded work on untrusted text


class MentalMathKwargs(TaskKwargs):
    min_value: int = Field(0, ge=0, le=10**6)  # operands are drawn from min_value..max_value
    max_value: int = Field(9, ge=0, le=10**6)
    ops: str = Field("+*", pattern=r"^[+\-*]{1,3}$")
    partial: float = Field(0.25, ge=0, le=1)  # the correct number last in a longer reply
    # The system message (None: the chat template's own default, e.g. SmolLM2's "You are a helpful AI
    # assistant named SmolLM..."). A short one keeps the prompt short: every step reads it ~G times.
    system: str | None = Field("Reply with only the final number.", max_length=1000)

    @model_validator(mode="after")
    def _ordered(self) -> "MentalMathKwargs":
        if self.min_value > self.max_value:
            raise ValueError("min_value must not exceed max_value")
        return self


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text[:SCORED_CHARS])
    return found[-1] if found else None


class MentalMath(Task):
    name = "mental-math"
    Kwargs = MentalMathKwargs
    kwargs: MentalMathKwargs

    def sample(self, seed: int, index: int) -> Problem:
        problem = super().sample(seed, index)
        return Problem(problem.prompt_id, problem.prompt, problem.answer, system=self.kwargs.system)

    def make_problem(self, rng: random.Random) -> tuple[str, str]:
        k = self.kwargs
        a, b, op = rng.randint(k.min_value, k.max_value), rng.randint(k.min_value, k.max_value), rng.choice(k.ops)
        if op == "-" and b > a:
            a, b = b, a  # answers stay non-negative: a "-" sign is one more thing to get wrong
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return f"What is {a} {op} {b}?", str(value)

    def score(self, problem: Problem, completion: str) -> float:
        text = completion[:SCORED_CHARS].strip()
        bare = text[:-1].rstrip() if text.endswith(".") else text
        if bare == problem.answer:
            return 1.0
        return self.kwargs.partial if last_number(text) == problem.answer else 0.0

    def reference(self, problem: Problem) -> str:
        return problem.answer
