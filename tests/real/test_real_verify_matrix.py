"""The verification matrices of tests/integration/test_verify_matrix.py on SmolLM2-135M-Instruct: real prompts
through its chat template, generated in bf16 by the transformers backend, replayed by the fp32 verifier on the
CPU. Honest: >= 200 rollouts over batch sizes, thread counts and samplings, none rejected. Attacks: the same
forgeries (imported from that module), each rejected every time."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from node.envs import encode_prompt, load_task
from tests.integration.test_verify_matrix import (
    SAMPLING, TransformersEngine, assert_all_rejected, copy_commitments, copy_logprobs, edit_tokens, items_for,
    perturb_logprobs, recomputed_logprobs, training_step, truncate_claiming_stop)
from verify.rollouts import RolloutVerifier

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

# Sized for the lane's budget: on 2 cores this model runs ~70 tokens per CPU-second (fp32 prefill; bf16 generation
# is slower on CPUs without bf16 units), so prompts are short and completions 12 tokens.
MAX_TOKENS = 12
N_ATTACK = 12
# One AdamW step moves every weight by about lr; this model's weight matrices have mean |w| 0.14, so lr 3e-3 is
# a ~2 % relative change: the size test_verify_matrix.py uses on the tiny model (2.5x the smallest step
# bench/verify_cost.py saw caught). A realistic RL step (lr ~1e-6..1e-5, issue #27) is far smaller than that.
OTHER_STEP_LR = 3e-3


def real_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Chat-template prompts of three built-in tasks (different lengths, so batches are left-padded), with a
    short system message: the template's default one would double each prompt's length (and the lane's time)."""
    tasks = [load_task("arithmetic", {}), load_task("reverse-text", {"min_len": 3, "max_len": 12}),
             load_task("guess-number", {"max_value": 100})]
    rng = random.Random(seed)
    problems = [tasks[i % 3].sample(seed, rng.randrange(10**6)) for i in range(n)]
    return [encode_prompt(tok, replace(p, system="Answer briefly.")) for p in problems]


@pytest.fixture(scope="module")
def base_model(real_model_dir):
    from node.trainer.model import load_model

    return load_model(real_model_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def verifier(base_model):
    return RolloutVerifier(base_model)


class RealEngine:
    """TransformersEngine with SmolLM2's EOS; `dtype` bf16 unless told."""

    def __init__(self, eos: int):
        self.impl, self.eos = TransformersEngine(), eos

    def generate(self, model, prompt_list, seeds, *, dtype="bfloat16", batch=16, threads=None, temperature=1.0,
                 top_p=1.0, max_tokens=MAX_TOKENS):
        return self.impl.generate(model, prompt_list, seeds, dtype=dtype, batch=batch, threads=threads,
                                  temperature=temperature, top_p=top_p, max_tokens=max_tokens, eos_token_id=self.eos)


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    return RealEngine(real_tokenizer.eos_token_id)


def items(ps, seeds, res, eos, **kw):
    return items_for(ps, seeds, res, max_tokens=kw.pop("max_tokens", MAX_TOKENS), eos=eos, **kw)


# --- honest ---------------------------------------------------------------------------------------

HONEST_CONFIGS = [  # (batch size, threads, sampling index): 4 configs x 56 rollouts = 224, all bf16
    (56, 2, 0), (8, 2, 1), (28, 1, 2), (14, 2, 0),
]


@pytest.mark.timeout(1200)  # the lane's longest test: 224 bf16 generations and fp32 replays
def test_honest_bf16_rollouts_are_never_rejected_in_fp32(engine, base_model, verifier, real_tokenizer):
    eos = real_tokenizer.eos_token_id
    total, stopped, worst = 0, 0, {}
    for k, (batch, threads, si) in enumerate(HONEST_CONFIGS):
        temperature, top_p = SAMPLING[si]
        ps = real_prompts(real_tokenizer, 56, seed=100 + k)
        seeds = [10_000 * k + i for i in range(56)]
        res = engine.generate(base_model, ps, seeds, batch=batch, threads=threads, temperature=temperature,
                              top_p=top_p)
        for v in verifier.verify_many(items(ps, seeds, res, eos, temperature=temperature, top_p=top_p)):
            assert v.ok, f"honest rollout rejected (batch {batch}, {threads} threads, sampling {si}): {v}"
            for name, x in v.scores.items():
                worst[name] = max(worst.get(name, 0), x)
        total += len(res)
        stopped += sum(r.finish_reason == "stop" for r in res)
    assert total >= 200 and stopped > 0
    print(f"{total} honest rollouts ({stopped} stopped), worst scores: {worst}")


# --- attacks --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def honest(engine, base_model, real_tokenizer):
    ps, seeds = real_prompts(real_tokenizer, N_ATTACK, seed=42), [77_000 + i for i in range(N_ATTACK)]
    return ps, seeds, engine.generate(base_model, ps, seeds)


@pytest.fixture(scope="module")
def eos(real_tokenizer):
    return real_tokenizer.eos_token_id


def test_attack_other_step(engine, base_model, verifier, honest, eos):
    ps, seeds, _ = honest
    res = engine.generate(training_step(base_model, lr=OTHER_STEP_LR, vocab=base_model.config.vocab_size), ps, seeds)
    assert_all_rejected(verifier, items(ps, seeds, res, eos), {"commitment", "logprobs", "sampling"})


def test_attack_tokens_edited(verifier, honest, eos, base_model):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items(ps, seeds, edit_tokens(res, vocab=base_model.config.vocab_size), eos),
                        {"commitment", "logprobs", "sampling", "termination"})


def test_attack_logprobs_copied_from_another_rollout(verifier, honest, eos):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items(ps, seeds, copy_logprobs(res), eos), {"logprobs"})


def test_attack_logprobs_recomputed_and_perturbed(verifier, honest, eos):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items(ps, seeds, perturb_logprobs(res), eos), {"logprobs"})


def test_attack_other_seed(engine, verifier, honest, base_model, eos):
    ps, seeds, res0 = honest
    res = engine.generate(base_model, ps, [s + 1 for s in seeds])
    assert_all_rejected(verifier, items(ps, seeds, res, eos), {"sampling", "termination", "shape"},
                        honest_results=res0)


def test_attack_greedy_with_forged_logprobs(engine, verifier, honest, base_model, eos):
    ps, seeds, res0 = honest
    res = engine.generate(base_model, ps, seeds, temperature=0.0)
    res = [replace(r, logprobs=recomputed_logprobs(base_model, p, r.completion_ids, s)) for p, s, r in zip(ps, seeds, res)]
    assert_all_rejected(verifier, items(ps, seeds, res, eos), {"sampling", "termination", "shape"},
                        honest_results=res0)


def test_attack_other_temperature(engine, verifier, honest, base_model, eos):
    ps, seeds, res0 = honest
    res = engine.generate(base_model, ps, seeds, temperature=0.6)
    assert_all_rejected(verifier, items(ps, seeds, res, eos), {"logprobs", "sampling", "termination", "shape"},
                        honest_results=res0)


def test_attack_prompt_swapped(engine, verifier, honest, base_model, eos):
    ps, seeds, _ = honest
    # Each rollout generated for its neighbour's prompt (another task's: never the same text; guess-number's
    # prompts are all alike, so fresh prompts of the same task would be no swap at all).
    res = engine.generate(base_model, ps[1:] + ps[:1], seeds)
    assert_all_rejected(verifier, items(ps, seeds, res, eos), {"commitment", "logprobs", "sampling", "termination"})


def test_attack_truncated_but_claims_stop(engine, verifier, base_model, real_tokenizer, eos):
    ps, seeds = real_prompts(real_tokenizer, N_ATTACK, seed=44), [88_000 + i for i in range(N_ATTACK)]
    res = engine.generate(base_model, ps, seeds, max_tokens=12)
    assert_all_rejected(verifier, items(ps, seeds, truncate_claiming_stop(res, eos), eos, max_tokens=12),
                        {"termination", "commitment", "sampling", "logprobs"})
    # The honest version of the same generations passes: the rejection is about the edit.
    assert all(v.ok for v in verifier.verify_many(items(ps, seeds, res, eos, max_tokens=12)))


def test_attack_commitment_copied(verifier, honest, eos):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items(ps, seeds, copy_commitments(res), eos), {"commitment", "shape"})
