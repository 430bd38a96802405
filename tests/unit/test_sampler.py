"""Seeded Gumbel-max sampler: hash correctness, distribution, batch independence, replay."""
from __future__ import annotations

import math

import pytest
import torch

from verify.sampler import (BLOCK, MAX_SEED, block_uniform, gumbel_noise, gumbel_noise_batch, hash_uniform, nucleus_mass_before,
                            replay_scores, sample_step)

M64 = (1 << 64) - 1


def _fmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


GAMMA = 0x9E3779B97F4A7C15


def _key(seed: int, position: int) -> int:
    return _fmix64(_fmix64((seed + GAMMA) & M64) ^ ((position * 0xD6E8FEB86659FD93) & M64))


def _stream(key: int, index: int) -> float:
    return ((_fmix64((key + (index + 1) * GAMMA) & M64) >> 11) + 0.5) / 2.0**53


def reference_uniform(seed: int, position: int, token: int) -> float:
    """Independent pure-Python (unsigned big-int) SplitMix64 implementation of the documented hash."""
    return _stream(_key(seed, position), token)


def reference_block_uniform(seed: int, position: int, block: int) -> float:
    return _stream(_fmix64(_key(seed, position) ^ 0xA0761D6478BD642F), block)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, 2**40 + 3, MAX_SEED])
def test_hash_matches_pure_python_reference(seed):
    positions = torch.tensor([0, 1, 77, 4095])
    u = hash_uniform(torch.full((4,), seed, dtype=torch.int64), positions, 300)
    seeds = torch.full((4,), seed, dtype=torch.int64)
    ub = block_uniform(seeds, positions, torch.arange(7))
    for row, pos in enumerate(positions.tolist()):
        for tok in (0, 1, 2, 150, 299):
            assert u[row, tok].item() == reference_uniform(seed, pos, tok)
        for blk in (0, 3, 6):
            assert ub[row, blk].item() == reference_block_uniform(seed, pos, blk)


def test_uniforms_in_open_interval_and_gumbel_moments():
    g = gumbel_noise(99, 3, 200_000)
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01
    u = hash_uniform(torch.tensor([5]), torch.tensor([0]), 100_000)
    assert (u > 0).all() and (u < 1).all()


def test_seeds_and_positions_decorrelate():
    a = gumbel_noise(1, 0, 5000)
    for other in (gumbel_noise(2, 0, 5000), gumbel_noise(1, 1, 5000), gumbel_noise(1 + 2**32, 0, 5000)):
        corr = torch.corrcoef(torch.stack([a, other]))[0, 1].item()
        assert abs(corr) < 0.05


def test_two_level_samples_follow_softmax_over_many_blocks():
    torch.manual_seed(3)
    v = 3 * BLOCK + 40  # four blocks, the last one partial
    logits = torch.randn(v) * 2.5
    n = 40_000
    tokens, lps = sample_step(logits.repeat(n, 1), torch.arange(n), torch.zeros(n, dtype=torch.int64), 1.0, 1.0)
    probs = torch.softmax(logits.double(), 0)
    freq = torch.bincount(tokens, minlength=v).double() / n
    block_freq = torch.tensor([freq[i:i + BLOCK].sum() for i in range(0, v, BLOCK)])
    block_mass = torch.tensor([probs[i:i + BLOCK].sum() for i in range(0, v, BLOCK)])
    assert torch.allclose(block_freq, block_mass, atol=0.01)
    top = probs.argsort(descending=True)[:10]
    assert torch.allclose(freq[top], probs[top], atol=0.006)
    assert torch.allclose(lps, probs.log().float()[tokens], atol=1e-5)


def test_samples_follow_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0])
    n = 40_000
    tokens, _ = sample_step(logits.repeat(n, 1), torch.arange(n), torch.zeros(n, dtype=torch.int64), 1.0, 1.0)
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double(), 0), atol=0.01)


def test_top_p_nucleus_and_renormalised_logprob():
    logits = torch.tensor([3.0, 2.5, 1.0, 0.0, -2.0])
    n = 20_000
    tokens, lps = sample_step(logits.repeat(n, 1), torch.arange(n), torch.zeros(n, dtype=torch.int64), 0.7, 0.8)
    probs = torch.softmax(logits / 0.7, 0)
    # Smallest set reaching 0.8: tokens 0 and 1 (0.63 + 0.31).
    assert set(tokens.unique().tolist()) == {0, 1}
    renorm = probs[:2] / probs[:2].sum()
    for t in (0, 1):
        assert torch.allclose(lps[tokens == t], renorm[t].log().float(), atol=1e-5)
    before = nucleus_mass_before(logits[None] / 0.7)[0]
    assert before[0] == 0 and torch.isclose(before[1], probs[0])


def test_batch_size_and_position_in_batch_do_not_matter():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 3
    seeds = torch.tensor([5, 9, 5, 123456789, 2**50, 0])
    positions = torch.tensor([0, 3, 1, 17, 2, 0])
    tokens, lps = sample_step(logits, seeds, positions, 0.9, 0.95)
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    t2, l2 = sample_step(logits[perm], seeds[perm], positions[perm], 0.9, 0.95)
    assert torch.equal(t2, tokens[perm]) and torch.equal(l2, lps[perm])
    for i in range(6):
        t1, l1 = sample_step(logits[i:i + 1], seeds[i:i + 1], positions[i:i + 1], 0.9, 0.95)
        assert t1.item() == tokens[i].item() and l1.item() == lps[i].item()


def test_greedy_is_argmax_with_zero_logprob():
    logits = torch.randn(4, 50)
    tokens, lps = sample_step(logits, torch.arange(4), torch.zeros(4, dtype=torch.int64), 0.0, 1.0)
    assert torch.equal(tokens, logits.argmax(-1)) and (lps == 0).all()


def test_replay_accepts_sampled_and_measures_other_tokens():
    torch.manual_seed(1)
    logits = torch.randn(20, 300) * 2
    seed, positions = 4242, torch.arange(20)
    tokens, lps = sample_step(logits, torch.full((20,), seed), positions, 1.0, 0.9)
    rep = replay_scores(logits, seed, positions, 1.0, 0.9, tokens)
    assert (rep.margin == 0).all() and (rep.outside < 0).all()
    assert torch.allclose(rep.logprob_hi, lps) and torch.allclose(rep.logprob_lo, lps)
    wrong = (tokens + 1) % 300
    assert (replay_scores(logits, seed, positions, 1.0, 0.9, wrong).margin > 0).all()
    # Per-row seed tensors give the same answer as one int.
    rep2 = replay_scores(logits, torch.full((20,), seed), positions, 1.0, 0.9, tokens)
    assert torch.equal(rep2.margin, rep.margin)
    # Another seed does not replay to the same tokens.
    assert (replay_scores(logits, seed + 1, positions, 1.0, 0.9, tokens).margin > 0).sum() >= 10


def test_nucleus_slack_brackets_boundary_logprob():
    logits = torch.log(torch.tensor([[0.5, 0.295, 0.2, 0.005]]))
    # top_p = 0.8: the third token (mass before it 0.795) is in by 0.005, ambiguous under slack 0.02.
    rep = replay_scores(logits, 1, torch.tensor([0]), 1.0, 0.8, torch.tensor([0]), nucleus_slack=0.02)
    assert rep.logprob_hi.item() == pytest.approx(math.log(0.5 / 0.795), abs=1e-5)  # nucleus {0, 1}
    assert rep.logprob_lo.item() == pytest.approx(math.log(0.5 / 0.995), abs=1e-5)  # nucleus {0, 1, 2}
    exact = replay_scores(logits, 1, torch.tensor([0]), 1.0, 0.8, torch.tensor([0]))
    assert exact.logprob_hi.item() == pytest.approx(math.log(0.5 / 0.995), abs=1e-5)


@pytest.mark.parametrize("bad", [(-1.0, 1.0), (1.0, 0.0), (1.0, 1.5), (float("nan"), 1.0)])
def test_bad_sampling_params_rejected(bad):
    with pytest.raises(ValueError):
        sample_step(torch.zeros(1, 4), torch.tensor([1]), torch.tensor([0]), *bad)


def test_bad_seed_rejected():
    for s in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError):
            gumbel_noise(s, 0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_noise_identical():
    seeds, pos = torch.tensor([1, 2**40 + 5, 77]), torch.tensor([0, 9, 300])
    cpu = gumbel_noise_batch(seeds, pos, 151_936)
    gpu = gumbel_noise_batch(seeds.cuda(), pos.cuda(), 151_936).cpu()
    assert torch.equal(hash_uniform(seeds, pos, 151_936), hash_uniform(seeds.cuda(), pos.cuda(), 151_936).cpu())
    assert torch.allclose(cpu, gpu, atol=1e-6)
