"""Multi-turn episodes: the rules that the worker (which plays them) and the coordinator (which checks them)
share. Pure functions of the task, the tokenizer and the tokens: no IO, no model.

A trajectory is the prompt, then model turn 0, then (environment turn, model turn) pairs, packed as one
token sequence: every turn's prompt is the whole sequence before it, so the extension property holds by
construction (nothing is ever re-tokenized; the environment's text is tokenized once, by `env_turn_ids`).

- Model turn i is sampled with seed `turn_seed(seed, i)` (turn 0 keeps the coordinator's seed), positions
  counted from 0 within the turn, at most `sampling.max_tokens` tokens. So each model turn is checked
  exactly like a single-turn rollout whose prompt is everything before it (`verify.rollouts.turn_items`).
- After a model turn that ended with EOS, the environment answers `task.env_response(problem, turns)`
  (the model turns decoded, special tokens removed). None ends the episode; so do a turn that ran out of
  tokens ("length") and the task's `max_turns`.
- The environment's tokens are not trained on (the loss mask is False there) and carry logprob 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from node.envs.base import Problem, Task
from node.envs.prompt import decode_completions
from protocol.messages import MAX_ENV_TOKENS  # one environment turn

MAX_ENV_CHARS = 2048  # an environment message, before tokenization


@dataclass(frozen=True)
class ModelTurn:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    commitment: str


@dataclass(frozen=True)
class EnvThenModel:
    env_ids: list[int]
    model: ModelTurn


def max_turns_of(task) -> int:
    """A task's model turns per episode (1 for tasks that are not `Task` subclasses)."""
    return int(getattr(task, "max_turns", 1))


def score_episode(task, problem: Problem, texts: list[str]) -> float:
    score_turns = getattr(task, "score_turns", None)
    return float(score_turns(problem, texts) if score_turns else task.score(problem, texts[-1]))


def env_turn_ids(tokenizer, text: str) -> list[int]:
    """An environment message as tokens that follow a finished model turn: what the chat template puts
    between an assistant turn and the next assistant turn's generation prompt, with the message as a user
    turn ("<|end|>" already ended the model's turn; here "<|user|>text<|assistant|>")."""
    text = text[:MAX_ENV_CHARS]
    if getattr(tokenizer, "chat_template", None):
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        after = tokenizer.apply_chat_template(base + [{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)
        if after.startswith(before):
            # What the template writes after the assistant's EOS (ChatML: "<|im_end|>\n") belongs here too:
            # the model's turn ends at its EOS, so without it the packed episode would differ from the template.
            eos = tokenizer.eos_token or ""
            cut = before.rfind("y" + eos) if eos else -1
            tail = before[cut + 1 + len(eos):] if cut >= 0 else ""
            text = tail + after[len(before):]
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return ids[:MAX_ENV_TOKENS]


def next_env_ids(task: Task, tokenizer, problem: Problem, model_turns: list[list[int]], last_finish: str) -> list[int] | None:
    """The environment's next turn as tokens after these model turns, or None when the episode is over."""
    if last_finish != "stop" or len(model_turns) >= max_turns_of(task):
        return None
    reply = task.env_response(problem, decode_completions(tokenizer, model_turns))
    return None if reply is None else env_turn_ids(tokenizer, str(reply))


def check_episode(task: Task, tokenizer, problem: Problem, first: ModelTurn, rest: list[EnvThenModel]) -> str | None:
    """None when every environment turn is the one the environment gives and the episode ends where it
    must; else the rejection reason."""
    turns, finish = [first.completion_ids], first.finish_reason
    for t in rest:
        expected = next_env_ids(task, tokenizer, problem, turns, finish)
        if expected is None:
            return "env_extra_turn"
        if expected != t.env_ids:
            return "env_mismatch"
        turns.append(t.model.completion_ids)
        finish = t.model.finish_reason
    if next_env_ids(task, tokenizer, problem, turns, finish) is not None:
        return "env_cut_short"
    return None


def pack(first: ModelTurn, rest: list[EnvThenModel]) -> tuple[list[int], list[float], list[bool]]:
    """The trajectory after the prompt as one sequence: ids, logprobs (0 on environment tokens) and the
    loss mask (True on model tokens)."""
    ids, lps, mask = list(first.completion_ids), list(first.logprobs), [True] * len(first.completion_ids)
    for t in rest:
        ids += t.env_ids + t.model.completion_ids
        lps += [0.0] * len(t.env_ids) + list(t.model.logprobs)
        mask += [False] * len(t.env_ids) + [True] * len(t.model.completion_ids)
    return ids, lps, mask


def model_texts(tokenizer, first: ModelTurn, rest: list[EnvThenModel]) -> list[str]:
    """The text of each model turn of one episode, as its reward sees them."""
    return episodes_texts(tokenizer, [(first, rest)])[0]


def episodes_texts(tokenizer, episodes: list[tuple[ModelTurn, list[EnvThenModel]]]) -> list[list[str]]:
    """`model_texts` of each episode, all decoded in one `decode_completions` call."""
    turns = [[first.completion_ids] + [t.model.completion_ids for t in rest] for first, rest in episodes]
    texts = iter(decode_completions(tokenizer, [ids for ts in turns for ids in ts]))
    return [[next(texts) for _ in ts] for ts in turns]


def episode_of(rollout) -> tuple[ModelTurn, list[EnvThenModel]]:
    """A submitted rollout (wire model) or a stored one (dict) as its model turn and the turns after it."""
    def fields(obj) -> dict:  # a wire model's own fields, not a model_dump: that copies every list (~9 µs a rollout)
        return obj if isinstance(obj, dict) else vars(obj)

    def turn(d: dict) -> ModelTurn:
        return ModelTurn(list(d["completion_ids"]), list(d["logprobs"]), d["finish_reason"], d.get("commitment") or "")

    d = fields(rollout)
    return turn(d), [EnvThenModel(list(t["env_ids"]), turn(t)) for t in map(fields, d.get("turns") or [])]
