"""The trainer really learns: RL with real sampling from the policy raises the task reward.

Sampling here is a plain loop (torch.multinomial on the model's logits at temperature 1, KV cache,
sampler logprobs recorded), standing in for the workers. The settings are the ones recommended for
the embedded demo (see the trainer's final report / docs).
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from node.envs import decode_completion, encode_prompt, load_task
from node.trainer import Group, Rollout, Trainer, build_tiny_model_dir, load_tokenizer, sft_warm_start
from node.trainer.config import TrainerConfig
from node.trainer.local_sampling import sample_group

# Recommended demo settings (a 2-core CPU, ~20 steps).
DEMO = dict(hidden_size=64, layers=2, heads=4, lr=1e-2, async_level=2, warm_start_steps=2, warm_start_lr=3e-3,
            group_size=8, batch_prompts=8, max_tokens=8, temperature=1.0,
            task_kwargs={"min_len": 2, "max_len": 4, "alphabet": "abcdef"})


def run_rl(trainer: Trainer, tokenizer, task, *, steps: int, group_size: int, max_tokens: int,
           seed: int = 0, async_level: int = 0) -> list[float]:
    """RL loop; returns the mean reward of every step's sampled batch (before that step's update).

    With async_level k, batch n is sampled by the policy of step max(0, n − 1 − k) -- the oldest
    policy the coordinator's window allows -- from a separate model copy fed the broadcast (bf16)
    weights, as a worker would be.
    """
    gen = torch.Generator().manual_seed(seed)
    sampler = copy.deepcopy(trainer.model)
    # What workers get: the broadcast (bf16) weights, so sampler and trainer logprobs differ slightly.
    history = [trainer.weights_for_broadcast()]
    curve = []
    index = 0
    for _ in range(steps):
        policy_step = max(0, trainer.step_count - async_level)
        missing, unexpected = sampler.load_state_dict(history[policy_step], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        while not trainer.batch_complete:
            problem = task.sample(seed, index)
            index += 1
            prompt = encode_prompt(tokenizer, problem)
            rollouts = [
                Rollout(completion_ids=c, inference_logprobs=lp, policy_step=policy_step,
                        reward=task.score(problem, decode_completion(tokenizer, c)),
                        finish_reason="stop" if c[-1] == tokenizer.eos_token_id else "length")
                for c, lp in sample_group(sampler, prompt, group_size, max_tokens, tokenizer.eos_token_id, gen)
            ]
            trainer.add_group(Group(problem.prompt_id, prompt, rollouts))
        curve.append(trainer.step()["reward_mean"])
        history.append(trainer.weights_for_broadcast())
    return curve


def fifth_means(curve: list[float]) -> tuple[float, float]:
    k = max(1, len(curve) // 5)
    return sum(curve[:k]) / k, sum(curve[-k:]) / k


def _trainer(tmp_path, **cfg) -> tuple[Trainer, object]:
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden_size=DEMO["hidden_size"], layers=DEMO["layers"],
                                     heads=DEMO["heads"], seed=0)
    trainer = Trainer(model_dir, TrainerConfig(lr=DEMO["lr"], **cfg), batch_prompts=DEMO["batch_prompts"])
    return trainer, load_tokenizer(model_dir)


@pytest.mark.timeout(180)
def test_rl_from_random_init_doubles_reward_with_stale_policy(tmp_path):
    """The demo's setting: random init, rollouts up to k = 2 steps stale, 20 steps."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trainer, tokenizer = _trainer(tmp_path)
    task = load_task("reverse-text", DEMO["task_kwargs"])
    curve = run_rl(trainer, tokenizer, task, steps=20, group_size=DEMO["group_size"], max_tokens=DEMO["max_tokens"],
                   async_level=DEMO["async_level"])
    first, last = fifth_means(curve)
    print(f"RL k=2 curve {[round(x, 3) for x in curve]} first {first:.3f} last {last:.3f} "
          f"{time.perf_counter() - t0:.1f}s")
    assert last >= 2 * first, curve


@pytest.mark.timeout(180)
def test_tiny_sft_warm_start_then_rl_raises_reward(tmp_path):
    torch.manual_seed(0)
    trainer, tokenizer = _trainer(tmp_path)
    task = load_task("reverse-text", DEMO["task_kwargs"])
    nll = sft_warm_start(trainer, task, tokenizer, steps=DEMO["warm_start_steps"], lr=DEMO["warm_start_lr"])
    assert nll[-1] < nll[0]  # the warm start itself moved the model towards the references
    assert trainer.step_count == 0  # and is not an RL step
    curve = run_rl(trainer, tokenizer, task, steps=20, group_size=DEMO["group_size"], max_tokens=DEMO["max_tokens"],
                   async_level=DEMO["async_level"])
    first, last = fifth_means(curve)
    print(f"warm start + RL curve {[round(x, 3) for x in curve]} first {first:.3f} last {last:.3f}")
    assert last >= 2 * first, curve
