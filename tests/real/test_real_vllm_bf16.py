"""vLLM-on-CPU generating in bf16 on SmolLM2-135M-Instruct, every rollout replayed by the coordinator's fp32
verifier (verify/rollouts.py): the honest matrix of the engine a GPU node runs, on the answers that banned an
honest node once (short mental-math replies: one bf16 outlier token carried a short completion's mean deviation
over its limit). The full matrix (>= 200 rollouts, and every prefix length) is bench/verify_vllm_bf16.py;
docs/BENCHMARKS.md, "On the real model", has its numbers. Marked vllm: `make test-vllm` runs it."""
from __future__ import annotations

import pytest
import torch

from node.envs import encode_prompt, load_task
from node.worker.backends.base import GenRequest
from verify.rollouts import RolloutClaim, RolloutVerifier, Thresholds, VerifyItem, recompute
from verify.sampler import replay_scores

pytestmark = [pytest.mark.real, pytest.mark.vllm, pytest.mark.timeout(900)]

# configs/real.toml's task (make demo-real) and sampling
MENTAL_MATH = {"min_value": 0, "max_value": 9, "ops": "+*", "system": "Reply with only the final number."}


@pytest.fixture(scope="module")
def backend(real_model_dir):
    from node.worker.backends.vllm_backend import VLLMBackend

    return VLLMBackend(real_model_dir, dtype="bfloat16", device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def fp32_model(real_model_dir):
    from node.trainer.model import load_model

    return load_model(real_model_dir, dtype="float32").eval()


def mental_math(tok, n_prompts: int, samples: int, seed: int) -> list[list[int]]:
    task = load_task("mental-math", MENTAL_MATH)
    return [encode_prompt(tok, task.sample(seed, i)) for i in range(n_prompts) for _ in range(samples)]


def generate_items(backend, prompts, seeds, max_tokens, eos, batch=16) -> list[VerifyItem]:
    res = []
    for i in range(0, len(prompts), batch):
        res += backend.generate([GenRequest(p, s) for p, s in zip(prompts[i:i + batch], seeds[i:i + batch])],
                                temperature=1.0, top_p=1.0, max_tokens=max_tokens, eos_token_id=eos)
    return [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s, 1.0, 1.0,
                       max_tokens, eos) for p, s, r in zip(prompts, seeds, res)]


def token_deviations(model, it: VerifyItem) -> torch.Tensor:
    """|submitted - fp32| per completion token (T = 1, top-p 1: the verifier's own deviation)."""
    comp = it.rollout.completion_ids
    logits, _ = recompute(model, [it.prompt_ids], [comp])
    rep = replay_scores(logits[0, :len(comp)], it.seed, torch.arange(len(comp)), 1.0, 1.0, torch.tensor(comp))
    return (torch.tensor(it.rollout.logprobs) - rep.logprob_hi).abs()


def test_honest_vllm_bf16_short_answers_are_never_rejected_in_fp32(backend, fp32_model, real_tokenizer):
    eos = real_tokenizer.eos_token_id
    verifier = RolloutVerifier(fp32_model)
    ps = mental_math(real_tokenizer, 8, 8, seed=3)
    items = []
    # the demo's 16 tokens, and honest short completions (max_tokens reached: every token counts in a short mean)
    for k, max_tokens in enumerate((16, 6, 3)):
        items += generate_items(backend, ps, [900_000 + 1000 * k + i for i in range(len(ps))], max_tokens, eos)
    verdicts = verifier.verify_many(items)
    worst: dict[str, float] = {}
    for it, v in zip(items, verdicts):
        assert v.ok, f"honest vLLM bf16 rollout rejected ({len(it.rollout.completion_ids)} tokens): {v}"
        for name, x in v.scores.items():
            worst[name] = max(worst.get(name, 0), x)
    assert len(items) == 192 and any(it.rollout.finish_reason == "stop" for it in items)
    print(f"{len(items)} honest vLLM bf16 rollouts, worst scores: {worst}")


def test_a_lie_spread_over_a_short_completion_is_still_refused(backend, fp32_model, real_tokenizer):
    """The mean leaves each completion's worst token out (bounded by the max limit alone): honest vLLM bf16
    completions of 8 tokens pass, and the same completions claiming every token 0.2 nats less likely than the
    sampler made it are refused for their logprobs."""
    from dataclasses import replace

    eos = real_tokenizer.eos_token_id
    verifier = RolloutVerifier(fp32_model)
    ps = mental_math(real_tokenizer, 4, 4, seed=5)
    items = generate_items(backend, ps, [700_000 + i for i in range(len(ps))], 8, eos)
    for it in items:
        mean, worst, bad = Thresholds().logprob_verdict(token_deviations(fp32_model, it))
        assert not bad, (it.rollout.completion_ids, mean, worst)
    assert all(v.ok for v in verifier.verify_many(items))
    lied = [replace(it, rollout=replace(it.rollout, logprobs=[x - 0.2 for x in it.rollout.logprobs]))
            for it in items if len(it.rollout.completion_ids) >= 8]
    assert len(lied) >= len(items) // 2
    for v in verifier.verify_many(lied):
        assert not v.ok and v.reason == "logprobs", v
