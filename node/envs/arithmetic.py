"""arithmetic: small integer sums/differences/products with an exact-match answer."""
from __future__ import annotations

import random

from pydantic import Field

from node.envs.base import Problem, Task, TaskKwargs


class ArithmeticKwargs(TaskKwargs):
    max_value: int = Field(9, ge=1, le=10**6)  # operands are drawn from 0..max_value
    ops: str = Field("+-", pattern=r"^[+\-*]{1,3}$")


class Arithmetic(Task):
    name = "arithmetic"
    Kwargs = ArithmeticKwargs
    kwargs: ArithmeticKwargs

    def make_problem(self, rng: random.Random) -> tuple[str, str]:
        k = self.kwargs
        a, b, op = rng.randint(0, k.max_value), rng.randint(0, k.max_value), rng.choice(k.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a}{op}{b}=", str(value)

    def score(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip()[:64] == problem.answer else 0.0

    def reference(self, problem: Problem) -> str:
        return problem.answer
