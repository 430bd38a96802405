"""guess-number (multi-turn) on SmolLM2-135M-Instruct with its ChatML template: a real coordinator and one
transformers worker (bf16) play it, the environment answering between the model's turns; every model turn is
replayed in fp32 (fraction 1) and nothing is rejected. Each turn's prompt (the episode so far, packed) is
exactly what the chat template renders for that conversation."""
from __future__ import annotations

import pytest

from node.envs.episode import check_episode, episode_of, model_texts, score_episode
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for
from tests.real.test_real_node import assert_honest_verdicts, check_real_groups, real_run_settings

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]  # minutes on a quiet 2-core box; bounds for a loaded one

# No warm start: an instruct model's reply that stops and is not a bare number gets "a number from 1 to 8,
# please." from the environment, so episodes have several turns anyway. 24 tokens a turn, up to 3 turns.
# A second turn needs a first reply that stopped within 24 tokens: 5 of 24 episodes in one run, none among
# the first two steps' in one CI run, so the run may go on (up to 6 steps) until one is stored.
SETTINGS = ("task.name=guess-number", "task.kwargs={ max_value = 8, max_turns = 3 }", "run.max_steps=6")


def stored_episodes(coord) -> list:
    return [(g, r) for g in coord.ledger.groups(list(range(1, 1000))) for r in g.rollouts]


def rendered_turn_prompts(tok, task, problem, prompt_ids, first, rest) -> list[tuple[str, str]]:
    """(the episode's tokens before model turn i, decoded; the chat template's rendering of the conversation
    up to there with the generation prompt) for every model turn i >= 1."""
    seq = list(prompt_ids) + first.completion_ids
    messages = [{"role": "user", "content": problem.prompt},
                {"role": "assistant", "content": tok.decode(first.completion_ids[:-1])}]
    texts = model_texts(tok, first, [])
    pairs = []
    for t in rest:
        seq += t.env_ids
        messages.append({"role": "user", "content": task.env_response(problem, texts)})
        pairs.append((tok.decode(seq), tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)))
        seq += t.model.completion_ids
        messages.append({"role": "assistant", "content": tok.decode(t.model.completion_ids[:-1])})
        texts.append(model_texts(tok, t.model, [])[0])
    return pairs


async def test_guess_number_on_the_real_model_with_its_chat_template(tmp_path, real_model_dir, real_tokenizer):
    tok = real_tokenizer
    async with running_coordinator(tmp_path, *real_run_settings(real_model_dir, *SETTINGS)) as (coord, url):
        worker = start_worker(tmp_path, "a", coord, url, "worker.dtype=bfloat16")
        await wait_for(lambda: coord.published_step >= 2 and any(r.turns for _, r in stored_episodes(coord)), 780,
                       "2 training steps and an episode with a second turn", coord)
        await wait_for(lambda: coord.status()["verification"]["groups_by_verdict"].get("verified", 0) > 0, 60,
                       "a verified submission", coord)
        await stop_workers(worker)
        node = worker[0]
        assert_honest_verdicts(coord)
        assert node.stats.accepted > 0 and node.stats.rejected == 0
        check_real_groups(coord, tok)
        task, seed = coord.task, coord.cfg.run.seed
        episodes = stored_episodes(coord)
        multi = [(g, r) for g, r in episodes if r.turns]
        assert multi, "no episode had a second turn"
        for g, r in episodes:
            problem = task.sample(seed, g.problem_index)
            first, rest = episode_of(r)
            assert check_episode(task, tok, problem, first, rest) is None
            assert r.reward == pytest.approx(score_episode(task, problem, model_texts(tok, first, rest)))
            for turn in [first] + [t.model for t in rest]:
                if turn.finish_reason == "stop":
                    assert turn.completion_ids[-1] == tok.eos_token_id
            for packed, rendered in rendered_turn_prompts(tok, task, problem, g.prompt_ids, first, rest):
                assert packed == rendered
        turns = sum(1 + len(r.turns) for _, r in multi)
        print(f"{len(episodes)} episodes, {len(multi)} with several turns ({turns} model turns); e.g. "
              f"{tok.decode(g.prompt_ids[-8:] + multi[0][1].completion_ids)!r}")
