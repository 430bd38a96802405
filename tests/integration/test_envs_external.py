"""A reasoning-gym dataset end to end: a real coordinator (rewards from the dataset's scorer) and one real
worker node (transformers backend, verification on) training on loopback."""
from __future__ import annotations

import pytest

from node.envs import encode_prompt
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

KWARGS = ('{ min_terms = 2, max_terms = 2, max_digits = 1, operators = ["+", "-"], '
          'allow_parentheses = false, allow_negation = false }')


async def test_reasoning_gym_basic_arithmetic_trains_two_steps_with_one_node(tmp_path):
    import reasoning_gym

    from node.envs.reasoning_gym_task import dataset_seed
    from node.trainer.model import build_tiny_model_dir
    from node.trainer.tokenizer import DEFAULT_ALPHABET

    # The tiny model as the demo builds it, with "C" added to the alphabet: every prompt is
    # "Calculate a + b." and every character of it then has its own token (no <unk>).
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden_size=64, layers=2, heads=2,
                                     alphabet=DEFAULT_ALPHABET + "C")
    async with running_coordinator(tmp_path, "task.name=reasoning-gym:basic_arithmetic", f"task.kwargs={KWARGS}",
                                   f"model.path={model_dir}", "run.max_steps=2", "run.batch_prompts=4",
                                   "run.group_size=4") as (coord, url):
        task, tok, seed = coord.task, coord.tokenizer, coord.cfg.run.seed
        assert task.name == "reasoning-gym:basic_arithmetic"
        first = task.sample(seed, 0)
        assert first.prompt.startswith("Calculate ") and tok.unk_token_id not in encode_prompt(tok, first)

        worker = start_worker(tmp_path, "a", coord, url)
        await wait_for(lambda: coord.published_step >= 2, 300, "2 training steps", coord)
        await stop_workers(worker)

        node = worker[0]
        status = coord.status()
        assert status["verification"]["rejected"] == 0, status["verification"]
        assert status["verification"]["accepted"] > 0
        assert node.stats.accepted > 0 and node.stats.rejected == 0
        assert [row.step for row in coord.ledger.steps()][-1] >= 2

        # Every stored reward is the dataset's own score_answer of the decoded completion, for the problem
        # that the coordinator handed out under that index (reasoning-gym's item of the chunk).
        groups = coord.ledger.groups(list(range(1, 1000)))
        assert groups
        rewards = []
        for g in groups:
            problem = task.sample(seed, g.problem_index)
            assert g.prompt_ids == encode_prompt(tok, problem)
            chunk, pos = divmod(g.problem_index, task.size)
            ds = reasoning_gym.create_dataset("basic_arithmetic", **task.kwargs, size=task.size,
                                              seed=dataset_seed("basic_arithmetic", seed, chunk))
            entry = ds[pos]
            assert problem.prompt == entry["question"]
            for r in g.rollouts:
                text = tok.decode(r.completion_ids, skip_special_tokens=True).strip()
                expected = max(0.0, min(1.0, ds.score_answer(text, entry)))
                assert r.reward == pytest.approx(expected), (problem.prompt, text)
                rewards.append(r.reward)
        assert all(0.0 <= w <= 1.0 for w in rewards)


async def test_verifiers_single_turn_taskset_trains_two_steps_with_one_node(tmp_path):
    """The local verifiers taskset (tests/vf_envs): its rubric scores on the coordinator's threads. Its reward
    is an exact match that the untrained tiny model almost never earns, so online difficulty filtering
    (which drops all-0 groups) is off: the steps are about the plumbing, not about learning."""
    async with running_coordinator(tmp_path, "task.name=verifiers:tests.vf_envs.prime_node_arith",
                                   "task.kwargs={ rows = 16 }", "run.max_steps=2", "run.batch_prompts=4",
                                   "run.group_size=4", "trainer.buffer.online_difficulty_filtering=false"
                                   ) as (coord, url):
        worker = start_worker(tmp_path, "a", coord, url)
        await wait_for(lambda: coord.published_step >= 2, 300, "2 training steps", coord)
        await stop_workers(worker)

        status = coord.status()
        assert status["verification"]["rejected"] == 0 and status["verification"]["accepted"] > 0
        assert worker[0].stats.accepted > 0 and worker[0].stats.rejected == 0
        groups = coord.ledger.groups(list(range(1, 1000)))
        assert groups
        for g in groups:
            problem = coord.task.sample(coord.cfg.run.seed, g.problem_index)
            a, b = (int(x) for x in problem.prompt.rstrip("=").split("+"))
            for r in g.rollouts:
                text = coord.tokenizer.decode(r.completion_ids, skip_special_tokens=True).strip()
                assert r.reward == (1.0 if text == str(a + b) else 0.0), (problem.prompt, text)
