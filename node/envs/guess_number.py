"""guess-number: a multi-turn game. The model guesses a secret number; the environment answers "higher" or
"lower" until the guess is right or the turns run out. Deterministic, so the coordinator re-runs every
environment turn to check the tokens a worker submitted."""
from __future__ import annotations

import random

from pydantic import Field

from node.envs.base import Problem, Task, TaskKwargs


class GuessNumberKwargs(TaskKwargs):
    max_value: int = Field(8, ge=2, le=1000)  # the secret is drawn from 1..max_value
    max_turns: int = Field(4, ge=1, le=16)  # model turns per episode


def parse_guess(text: str) -> int | None:
    """The number a turn says, or None (bounded work on untrusted text)."""
    digits = text.strip()[:8]
    return int(digits) if digits.isascii() and digits.isdigit() else None  # "²".isdigit() is True too


class GuessNumber(Task):
    name = "guess-number"
    Kwargs = GuessNumberKwargs
    kwargs: GuessNumberKwargs

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_turns = self.kwargs.max_turns

    def make_problem(self, rng: random.Random) -> tuple[str, int]:
        n = self.kwargs.max_value
        return f"guess my number, 1 to {n}.", rng.randint(1, n)

    def env_response(self, problem: Problem, model_turns: list[str]) -> str | None:
        guess = parse_guess(model_turns[-1])
        if guess == problem.answer or len(model_turns) >= self.max_turns:
            return None
        if guess is None or not 1 <= guess <= self.kwargs.max_value:
            return f"a number from 1 to {self.kwargs.max_value}, please."
        return "higher." if guess < problem.answer else "lower."

    def score_turns(self, problem: Problem, model_turns: list[str]) -> float:
        """1 for a right first guess, less for each turn it took, 0 if never found."""
        if parse_guess(model_turns[-1]) != problem.answer:
            return 0.0
        return (self.max_turns - len(model_turns) + 1) / self.max_turns

    def score(self, problem: Problem, completion: str) -> float:
        return self.score_turns(problem, [completion])

    def reference(self, problem: Problem) -> str:
        """A first guess for the SFT warm start: every prompt is the same, so this teaches the answer's form
        and a spread of first guesses (a number drawn from the problem id, not its secret). A constant would
        make every sample of a group play the same episode: equal rewards, nothing for RL to compare."""
        return str(random.Random(f"reference:{problem.prompt_id}").randint(1, self.kwargs.max_value))
