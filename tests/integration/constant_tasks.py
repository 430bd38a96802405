"""A test-only task whose reward is a constant, loaded by import path
(`task.name = "tests.integration.constant_tasks:ConstantReward"`, `task.kwargs = {reward = 0.0}`): every
group it produces has equal rewards, so a run on it can never fill a batch with the default filters."""
from __future__ import annotations

import random

from pydantic import Field

from node.envs.base import Problem, Task, TaskKwargs


class ConstantRewardKwargs(TaskKwargs):
    reward: float = Field(0.0, ge=0, le=1)


class ConstantReward(Task):
    name = "constant-reward"
    Kwargs = ConstantRewardKwargs

    def make_problem(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice("abcdef") for _ in range(3))
        return text, text[::-1]

    def score(self, problem: Problem, completion: str) -> float:
        return self.kwargs.reward

    def reference(self, problem: Problem) -> str:
        return problem.answer
