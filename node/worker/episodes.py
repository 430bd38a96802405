"""Multi-turn tasks on the worker: play each episode to its end, one model turn at a time for every episode of
an assignment at once (one batched `generate` per turn). The rules are node/envs/episode.py's; the coordinator
re-runs the environment to check every environment token and replays every model turn."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from node.envs import Problem, load_task
from node.envs.episode import next_env_ids
from node.worker.backends import GenRequest
from node.worker.backends.base import GenResult
from protocol import messages as M
from protocol.errors import PrimeNodeError
from verify.sampler import turn_seed

log = logging.getLogger("prime_node.worker")


class EpisodeError(PrimeNodeError):
    pass


@dataclass
class Episode:
    first: GenResult
    rest: list[tuple[list[int], GenResult]]  # (environment tokens, the model turn after them)


class EpisodePlayer:
    """The run's task (built from the run spec, as the coordinator built it) and tokenizer."""

    def __init__(self, spec: M.RunSpec, model_dir: Path):
        from node.trainer.tokenizer import load_tokenizer

        self.task = load_task(spec.task, spec.task_kwargs)
        self.tokenizer = load_tokenizer(model_dir)

    def problem(self, work: M.PromptWork) -> Problem:
        if work.env_state is None:
            raise EpisodeError(f"prompt {work.prompt_id} of a multi-turn task came without env_state")
        return Problem(prompt_id=work.prompt_id, prompt="", answer=json.loads(work.env_state))

    def play(self, backend, prompts: list[M.PromptWork], **sampling) -> list[Episode]:
        """One episode per (prompt, seed), in order; `sampling` as for `backend.generate`."""
        starts = [(p.prompt_ids, seed, self.problem(p)) for p in prompts for seed in p.seeds]
        episodes = [Episode(r, []) for r in backend.generate([GenRequest(ids, seed) for ids, seed, _ in starts],
                                                             **sampling)]
        live, turn = list(range(len(starts))), 1
        while live:
            requests, who = [], []
            for i in live:
                ids, seed, problem = starts[i]
                e = episodes[i]
                model_turns = [e.first.completion_ids] + [r.completion_ids for _, r in e.rest]
                last = (e.rest[-1][1] if e.rest else e.first).finish_reason
                try:
                    env = next_env_ids(self.task, self.tokenizer, problem, model_turns, last)
                except Exception:  # the task's bug: end this episode (the coordinator refuses it as env_error)
                    log.warning("env_response of %s failed; episode ended", problem.prompt_id, exc_info=True)
                    env = None
                if env is None:
                    continue
                sequence = list(ids) + e.first.completion_ids
                for env_ids, r in e.rest:
                    sequence += env_ids + r.completion_ids
                requests.append(GenRequest(sequence + env, turn_seed(seed, turn)))
                who.append((i, env))
            for (i, env), r in zip(who, backend.generate(requests, **sampling) if requests else []):
                episodes[i].rest.append((env, r))
            live, turn = [i for i, _ in who], turn + 1
        return episodes
