"""Multi-turn episodes (node/envs/episode.py): the environment's tokens, the extension property, the checks
the coordinator runs on a submitted episode, and the per-turn seeds."""
import pytest

from node.envs import load_task
from node.envs.episode import (EnvThenModel, ModelTurn, check_episode, env_turn_ids, next_env_ids,
                               pack, score_episode)
from node.trainer.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from verify.rollouts import turn_items
from verify.sampler import MAX_SEED, turn_seed

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def said(text: str, finish: str = "stop") -> ModelTurn:
    ids = TOK(text, add_special_tokens=False)["input_ids"] + ([EOS] if finish == "stop" else [])
    return ModelTurn(ids, [-0.1] * len(ids), finish, "")


def play(task, problem, guesses: list[str]) -> tuple[ModelTurn, list[EnvThenModel]]:
    """An honest episode: the environment's real answers between the given model turns."""
    first, rest, turns = said(guesses[0]), [], [said(guesses[0]).completion_ids]
    for g in guesses[1:]:
        env = next_env_ids(task, TOK, problem, turns, "stop")
        assert env is not None
        rest.append(EnvThenModel(env, said(g)))
        turns.append(said(g).completion_ids)
    return first, rest


def test_guess_number_plays_by_its_rules():
    task = load_task("guess-number", {"max_value": 8, "max_turns": 4})
    problem = task.sample(7, 3)
    assert problem.prompt == "guess my number, 1 to 8." and 1 <= problem.answer <= 8
    assert task.sample(7, 3) == problem  # deterministic from (seed, index)
    low = problem.answer - 1 if problem.answer > 1 else None
    if low:
        assert task.env_response(problem, [str(low)]) == "higher."
    assert task.env_response(problem, ["x"]) == "a number from 1 to 8, please."
    assert task.env_response(problem, [str(problem.answer)]) is None  # found: the episode is over
    assert task.env_response(problem, ["x"] * 4) is None  # out of turns
    assert task.env_response(problem, ["²"]) == "a number from 1 to 8, please."  # isdigit(), yet not int()-able
    assert score_episode(task, problem, [str(problem.answer)]) == 1.0
    assert score_episode(task, problem, ["x", "x", str(problem.answer)]) == 0.5
    assert score_episode(task, problem, ["x"] * 4) == 0.0


@pytest.mark.parametrize("tok", [TOK, build_bpe_tokenizer(["guess my number higher lower please"] * 50, 300)],
                         ids=["char", "bpe"])
def test_environment_tokens_are_a_user_turn_after_the_model_turn(tok):
    ids = env_turn_ids(tok, "higher.")
    assert tok.decode(ids) == "<|user|>higher.<|assistant|>"
    # Extension: the packed episode is the prompt plus every turn's tokens, never re-tokenized.
    first = ModelTurn([7, 8, tok.eos_token_id], [-1.0] * 3, "stop", "")
    rest = [EnvThenModel(ids, ModelTurn([9, tok.eos_token_id], [-0.5, -0.1], "stop", ""))]
    seq, lps, mask = pack(first, rest)
    assert seq == [7, 8, tok.eos_token_id] + ids + [9, tok.eos_token_id]
    assert mask == [True] * 3 + [False] * len(ids) + [True, True] and lps[3:3 + len(ids)] == [0.0] * len(ids)
    stored = {**vars(first), "turns": [{"env_ids": ids, **vars(rest[0].model)}]}  # as the ledger keeps it
    i0, i1 = turn_items([1, 2], stored, 41, 1.0, 1.0, 8, tok.eos_token_id)
    assert i0.prompt_ids == [1, 2] and i0.seed == 41 and i0.rollout.completion_ids == first.completion_ids
    assert i1.prompt_ids == [1, 2] + first.completion_ids + ids and i1.seed == turn_seed(41, 1)
    assert i1.rollout.completion_ids == rest[0].model.completion_ids


def test_an_honest_episode_passes_and_forged_ones_are_named():
    task = load_task("guess-number", {"max_value": 8, "max_turns": 3})
    problem = next(p for p in (task.sample(1, i) for i in range(50)) if p.answer not in (1, 2))
    first, rest = play(task, problem, ["1", "2", "3"])  # 3 turns, never found: ends at max_turns
    assert check_episode(task, TOK, problem, first, rest) is None
    found = play(task, problem, ["1", str(problem.answer)])
    assert check_episode(task, TOK, problem, *found) is None
    # the environment's tokens changed ("lower." where it said "higher."): steering the episode
    forged = [EnvThenModel(env_turn_ids(TOK, "lower."), rest[0].model)] + rest[1:]
    assert check_episode(task, TOK, problem, first, forged) == "env_mismatch"
    # stopped while the environment still had something to say (a bad episode dropped early)
    assert check_episode(task, TOK, problem, first, rest[:1]) == "env_cut_short"
    # a turn after the number was found, or after a turn that ran out of tokens
    assert check_episode(task, TOK, problem, found[0], found[1] + [rest[1]]) == "env_extra_turn"
    cut = said("12", finish="length")
    assert check_episode(task, TOK, problem, cut, [EnvThenModel(rest[0].env_ids, rest[0].model)]) == "env_extra_turn"
    assert check_episode(task, TOK, problem, cut, []) is None


def test_turn_seeds_are_distinct_in_range_and_keep_turn_zero():
    assert turn_seed(12345, 0) == 12345
    seeds = {turn_seed(s, t) for s in (0, 1, MAX_SEED) for t in range(1, 16)}
    assert len(seeds) == 45 and all(0 <= x <= MAX_SEED for x in seeds)
    with pytest.raises(ValueError):
        turn_seed(-1, 1)


def test_a_rollout_passes_only_when_every_turn_passes():
    from node.coordinator.verification import merge_turns
    from verify.rollouts import Judgement

    ok, bad, outlier = Judgement(None, 5, 1), Judgement("verify_logprobs", 3, 0), Judgement("verify_sampling", 4, 0, True)
    merged = merge_turns([ok, ok, ok, bad, ok, outlier, outlier, outlier], [0, 0, 1, 1, 2, 2, 3, 3], 4)
    assert merged[0] == Judgement(None, 10, 2)
    assert merged[1].reason == "verify_logprobs" and not merged[1].outlier and merged[1].tokens == 8
    assert merged[2].reason == "verify_sampling" and merged[2].outlier  # its one failure is a single token
    assert merged[3].reason == "verify_sampling" and not merged[3].outlier  # two turns off: not numerical
