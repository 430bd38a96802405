"""The task interface: deterministic problems from a seed, and a reward function in [0, 1]."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import PrimeNodeError


class TaskError(PrimeNodeError):
    pass


@dataclass(frozen=True)
class Problem:
    prompt_id: str
    prompt: str  # the user message (the chat template is applied by encode_prompt)
    answer: Any  # whatever the task's score() needs; must be JSON-serialisable
    system: str | None = None  # an optional system message (see prompt.encode_prompt)


class TaskKwargs(BaseModel):
    """Base for a task's keyword arguments: unknown keys are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class Task:
    """Subclass, set `name` and `Kwargs`, implement `make_problem` and `score`.

    `sample(seed, index)` is a pure function of (task kwargs, seed, index): the coordinator and
    every verifier get the same problem for the same numbers, on every machine.
    """

    name: str = "task"  # a class attribute; tasks that wrap a library's environments set it per instance
    Kwargs: ClassVar[type[TaskKwargs]] = TaskKwargs
    # an instance of Kwargs; a subclass narrows the annotation (tasks wrapping a library keep a plain dict)
    kwargs: TaskKwargs | dict[str, Any]

    def __init__(self, **kwargs: Any) -> None:
        try:
            self.kwargs = self.Kwargs(**kwargs)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise TaskError(f"invalid arguments for task {self.name!r}: {problems}") from None

    def sample(self, seed: int, index: int) -> Problem:
        # A string seed is hashed with SHA-512 by `random`: stable across processes and Python builds.
        rng = random.Random(f"{self.name}:{seed}:{index}")
        prompt, answer = self.make_problem(rng)
        return Problem(prompt_id=f"{self.name}:{seed}:{index}", prompt=prompt, answer=answer)

    def make_problem(self, rng: random.Random) -> tuple[str, Any]:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str) -> float:
        """Reward of `completion` (decoded text, special tokens removed) for `problem`, in [0, 1]."""
        raise NotImplementedError

    # -- multi-turn tasks (max_turns > 1): the environment answers between the model's turns -------------
    max_turns: int = 1

    def env_response(self, problem: Problem, model_turns: list[str]) -> str | None:
        """The environment's next message after the model's turns so far (decoded text, special tokens
        removed), or None when the episode is over. Deterministic, and a function of `problem.answer` and
        the turns only: the worker runs it with a problem rebuilt from the answer the coordinator sent
        (`PromptWork.env_state`), and the coordinator re-runs it to check every environment token."""
        return None

    def score_turns(self, problem: Problem, model_turns: list[str]) -> float:
        """Reward of a whole episode in [0, 1]; single-turn tasks score their one completion."""
        return self.score(problem, model_turns[-1])

    def reference(self, problem: Problem) -> str | None:
        """A correct completion, if the task knows one (used for the SFT warm start)."""
        return None
