"""The real model generated on a GPU in bf16 and verified on the CPU in fp32 (markers gpu, real).

A home node's GPU decodes SmolLM2-135M-Instruct in bf16 with CUDA kernels; the coordinator replays on its
CPU in fp32. The two never compute the same numbers, so this is the cross-device honest matrix that the CPU
lanes cannot run: >= 256 honest rollouts (chat-templated prompts, three sampling settings, batch sizes 1 to
64) with no false rejection, and the attacks whose detection depends on the numbers (another training step,
another seed, forged logprobs) caught every time. Runs only where CUDA is present (the device lane).
"""
from __future__ import annotations

import copy
import os
import random
from dataclasses import replace

import pytest
import torch

from node.worker.backends.base import GenRequest
from node.worker.backends.transformers_backend import TransformersBackend
from verify.rollouts import RolloutClaim, RolloutVerifier, VerifyItem

pytestmark = [pytest.mark.gpu, pytest.mark.real, pytest.mark.timeout(900)]
MAX_TOKENS = 32
# "cuda" in the device lane; PRIME_NODE_REAL_DEVICE=cpu dry-runs the same checks on a CPU (bf16 vs fp32 only).
DEVICE = os.environ.get("PRIME_NODE_REAL_DEVICE", "cuda")
SAMPLING = [(1.0, 1.0), (0.8, 0.9), (0.6, 0.95)]  # (temperature, top_p)
QUESTIONS = ["What is {a} + {b}?", "What is {a} times {b}?", "Write the number {a} in words.",
             "Is {a} larger than {b}? Answer yes or no.", "Name a colour that rhymes with {a}.",
             "Count from {b} to {a}."]


@pytest.fixture(scope="module")
def real():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("gguf", reason="the real model needs the `real` extra")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.real_model import model_dir

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, model


def chat_prompts(tok, n: int, seed: int, questions: list[str] = QUESTIONS) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = rng.choice(questions).format(a=rng.randrange(2, 99), b=rng.randrange(2, 99))
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def generate_cuda(model, prompts, seeds, *, batch=64, temperature=1.0, top_p=1.0, eos: int):
    be = TransformersBackend(copy.deepcopy(model), dtype="bfloat16", device=DEVICE, max_batch_size=batch)
    return be.generate([GenRequest(p, s) for p, s in zip(prompts, seeds)], temperature=temperature, top_p=top_p,
                       max_tokens=MAX_TOKENS, eos_token_id=eos)


def items(prompts, seeds, results, temperature, top_p, eos):
    return [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s,
                       temperature, top_p, MAX_TOKENS, eos) for p, s, r in zip(prompts, seeds, results)]


def test_chat_template_is_chatml(real):
    _, tok, _ = real
    ids = chat_prompts(tok, 1, 0)[0]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token == "<|im_end|>"


def test_cuda_bf16_rollouts_verified_on_cpu_fp32_never_rejected(real):
    _, tok, model = real
    verifier = RolloutVerifier(copy.deepcopy(model))
    eos, total, worst, stopped = tok.eos_token_id, 0, {}, 0
    for k, (batch, si) in enumerate([(64, 0), (64, 1), (16, 2), (1, 0), (5, 1)]):
        n = 16 if batch == 1 else 64
        temperature, top_p = SAMPLING[si]
        ps, seeds = chat_prompts(tok, n, 100 + k), [10_000 * k + i for i in range(n)]
        res = generate_cuda(model, ps, seeds, batch=batch, temperature=temperature, top_p=top_p, eos=eos)
        for r in res:
            stopped += r.finish_reason == "stop"
        for v in verifier.verify_many(items(ps, seeds, res, temperature, top_p, eos)):
            assert v.ok, f"honest CUDA bf16 rollout rejected (batch {batch}, T={temperature}): {v}"
            for name, x in v.scores.items():
                worst[name] = max(worst.get(name, 0.0), x)
        total += n
    assert total >= 256
    assert stopped > 0, "no rollout ended on <|im_end|>: the EOS path went untested"
    print(f"{total} CUDA bf16 rollouts verified on CPU fp32, {stopped} stopped on EOS; worst scores {worst}")


def test_attacks_on_cuda_rollouts_are_caught(real):
    _, tok, model = real
    verifier = RolloutVerifier(copy.deepcopy(model))
    eos, n = tok.eos_token_id, 32
    ps, seeds = chat_prompts(tok, n, 7), [77_000 + i for i in range(n)]
    honest = generate_cuda(model, ps, seeds, eos=eos)
    assert all(v.ok for v in verifier.verify_many(items(ps, seeds, honest, 1.0, 1.0, eos)))

    def one_step(lr: float):
        stepped = copy.deepcopy(model).train()
        batch = torch.tensor([ps[0] + honest[0].completion_ids])
        opt = torch.optim.AdamW(stepped.parameters(), lr=lr)
        stepped(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        return stepped.eval()

    # An RL-sized step (lr 1e-5) is within what staleness allows anyway (a node may use a policy up to k
    # steps old), so its detection is reported, not required; a different model (lr 1e-3) must be caught.
    small = generate_cuda(one_step(1e-5), ps, seeds, eos=eos)
    v_small = verifier.verify_many(items(ps, seeds, small, 1.0, 1.0, eos))
    print(f"rollouts of the next RL step (lr 1e-5) claimed as this one: {sum(not v.ok for v in v_small)}/{n} rejected")
    attacks = {
        "other model": generate_cuda(one_step(1e-3), ps, seeds, eos=eos),
        "other seed": generate_cuda(model, ps, [s + 1 for s in seeds], eos=eos),
        "logprobs scaled": [replace(r, logprobs=[x * 0.75 for x in r.logprobs]) for r in honest],
    }
    for name, res in attacks.items():
        forged = [(p, s, r) for p, s, r, h in zip(ps, seeds, res, honest) if r.completion_ids != h.completion_ids
                  or r.logprobs != h.logprobs]
        assert len(forged) >= 0.75 * n, f"{name}: the attack reproduced the honest output too often"
        verdicts = verifier.verify_many(items([f[0] for f in forged], [f[1] for f in forged], [f[2] for f in forged],
                                              1.0, 1.0, eos))
        caught = sum(not v.ok for v in verdicts)
        print(f"attack {name!r}: {caught}/{len(forged)} caught")
        # Every forgery of at least `mean_tokens` tokens is caught. A shorter one can lie inside the honest noise:
        # the mean leaves out the worst token (bounded by logprob_max alone), so that one bf16 outlier does not
        # ban an honest node (docs/BENCHMARKS.md, "On the real model"). On the H200 (2026-11-27) logprobs x 0.75
        # on a 3-token answer came out at mean 0.068 / max 0.45 against limits 0.2 / 0.6 and this lane's honest
        # worst 0.084 / 0.27: accepted, 31 of 32 caught. Its weight in training is bounded by those limits.
        short = verifier.thresholds.mean_tokens
        missed = [(len(f[2].completion_ids), v.scores) for f, v in zip(forged, verdicts) if v.ok]
        assert all(n_tokens < short for n_tokens, _ in missed), f"attack {name!r} accepted: {missed[:2]}"
        assert caught >= 0.9 * len(forged), f"attack {name!r}: only {caught}/{len(forged)} caught"
