"""Prime-field TOPLOC commitments: interpolation, modulus choice, wire format, scoring."""
from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
import torch

from verify.commitment import (CHUNK_TOKENS, FIELD_MAX, TOPK, CommitmentError, ChunkProof, bf16_bits,
                               build_proofs, choose_modulus, chunk_bounds, commitment_chunks, decode_proofs,
                               encode_proofs, evaluate, evaluate_rows, interpolate, interpolate_rows, is_prime,
                               make_commitment, make_commitments, parse_commitment, score_commitment)
from verify.commitment import _topk_by_magnitude


def lagrange_reference(xs, ys, x, p):
    """Independent evaluation with Python big ints (Lagrange form)."""
    total = 0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (x - xj) % p
                den = den * (xi - xj) % p
        total = (total + yi * num * pow(den, p - 2, p)) % p
    return total


def test_interpolation_matches_independent_lagrange():
    rng = np.random.default_rng(0)
    p = 65521
    xs = rng.choice(p, 20, replace=False)
    ys = rng.integers(0, 65535, 20)
    coeffs = interpolate(xs, ys, p)
    assert len(coeffs) == 20 and coeffs.max() < p
    assert (evaluate(coeffs, xs, p) == ys % p).all()
    for x in (0, 1, 777, 65520):
        assert int(evaluate(coeffs, np.array([x]), p)[0]) == lagrange_reference(xs.tolist(), ys.tolist(), x, p)


def test_rows_at_once_match_the_independent_reference():
    """interpolate_rows / evaluate_rows (the batched forms the worker and verifier use) row by row against the
    big-int Lagrange reference; evaluate_rows with a different field per row."""
    rng = np.random.default_rng(3)
    p = 65519
    xs = np.stack([rng.choice(p, 12, replace=False) for _ in range(5)])
    ys = rng.integers(0, 65535, (5, 12))
    coeffs = interpolate_rows(xs, ys, p)
    for r in range(5):
        for x in (0, 5, 65518):
            assert int(evaluate(coeffs[r], np.array([x]), p)[0]) == lagrange_reference(xs[r].tolist(), ys[r].tolist(),
                                                                                      x, p)
    moduli = np.array([65521, 65519, 65497])
    rows = [interpolate(xs[r] % m, ys[r], int(m)) for r, m in enumerate(moduli)]
    at = rng.integers(0, 65497, (3, 7))
    got = evaluate_rows(np.stack(rows), at, moduli)
    for r, m in enumerate(moduli):
        assert (got[r] == evaluate(rows[r], at[r], int(m))).all()


def test_a_batch_of_rollouts_commits_as_each_alone():
    """make_commitments interpolates the chunks of many rollouts together, grouped by field and point count: each
    rollout's commitment is the one it gets alone, whatever its length, with small chunks, non-finite values and
    fields other than 65521 (a width of 4096 makes 32 tokens' top-128 indices collide mod 65521 now and then)."""
    gen = torch.Generator().manual_seed(5)
    hiddens = [torch.randn(n, h, generator=gen) for n, h in ((1, 16), (7, 64), (33, 128), (1280, 4096), (3, 4096))]
    hiddens[1][0, :5] = float("nan")
    batched = make_commitments(hiddens)
    assert batched == [make_commitment(h) for h in hiddens]
    moduli = {pr.modulus for c in batched for pr in parse_commitment(c)}
    assert 65521 in moduli and len(moduli) > 1  # more than one field in the batch
    for c, h in zip(batched, hiddens):
        if torch.isfinite(h).all():  # (non-finite values are canonicalised before committing)
            scores = score_commitment(parse_commitment(c), h)
            assert all(s.exp_mismatch_frac == 0 and s.mant_err_mean == 0 for s in scores)


def test_full_size_interpolation_round_trip():
    rng = np.random.default_rng(1)
    for p in (65521, 65519, 65497):
        xs = rng.choice(p, TOPK, replace=False)
        ys = rng.integers(0, 57000, TOPK)
        assert (evaluate(interpolate(xs, ys, p), xs, p) == ys).all()


def test_modulus_is_always_prime_and_injective():
    rng = np.random.default_rng(2)
    for trial in range(100):
        hidden = torch.randn(CHUNK_TOKENS, int(rng.choice([64, 896, 4096, 8192])))
        for pr, (s, e) in zip(build_proofs(hidden), [(0, CHUNK_TOKENS)]):
            assert is_prime(pr.modulus)
            bits = bf16_bits(hidden[s:e])
            idx = _topk_by_magnitude(bits, len(pr.coeffs))
            assert len(np.unique(idx % pr.modulus)) == len(idx)


def test_colliding_indices_force_a_smaller_prime():
    idx = np.array([5, 5 + FIELD_MAX, 5 + 2 * 65519, 10])  # collide mod 65521 and mod 65519
    p = choose_modulus(idx, max_value=100)
    assert is_prime(p) and p < 65519 and len(np.unique(idx % p)) == len(idx)
    # The modulus must also exceed every committed value so values survive reduction.
    assert choose_modulus(np.array([1, 2]), max_value=65500) > 65500


def test_commitment_round_trip_and_scores():
    torch.manual_seed(0)
    hidden = torch.randn(70, 256) * 3
    text = make_commitment(hidden)
    proofs = parse_commitment(text)
    assert len(proofs) == 3 and all(len(p.coeffs) == TOPK for p in proofs)
    exact = score_commitment(proofs, hidden)
    assert len(exact) == 3 and all(c.points == TOPK for c in exact)
    assert all(c.exp_mismatch_frac == 0 and c.mant_err_mean == 0 and c.mant_err_median == 0 for c in exact)
    noisy = score_commitment(proofs, hidden * (1 + 0.003 * torch.randn_like(hidden)))
    assert all(c.mant_err_mean < 2 and c.exp_mismatch_frac < 0.1 for c in noisy)
    other = score_commitment(proofs, torch.randn(70, 256) * 3)
    assert all(c.exp_mismatch_frac > 0.5 for c in other)
    # Only the middle chunk differs: it alone scores badly.
    mixed = hidden.clone()
    mixed[32:64] = torch.randn(32, 256) * 3
    assert [c.exp_mismatch_frac > 0.5 for c in score_commitment(proofs, mixed)] == [False, True, False]
    # Wrong number of tokens -> wrong chunk count -> maximal error.
    assert score_commitment(proofs, hidden[:40])[0].exp_mismatch_frac == 1.0


def test_bytes_per_32_tokens_within_budget():
    for hidden_size in (64, 896, 4096):
        raw = base64.b64decode(make_commitment(torch.randn(320, hidden_size)))
        per_chunk = (len(raw) - 3) / 10
        assert per_chunk == 3 + 2 * TOPK == 259 and per_chunk <= 300


def test_small_chunks_commit_to_a_quarter_of_entries():
    proofs = build_proofs(torch.randn(2, 64))  # 128 entries -> 32 points
    assert len(proofs[0].coeffs) == 32


def test_nan_and_inf_are_canonicalised():
    h = torch.randn(4, 64)
    h[0, 0], h[1, 1] = float("nan"), float("inf")
    proofs = build_proofs(h)
    assert is_prime(proofs[0].modulus)


def _valid_bytes():
    return encode_proofs(build_proofs(torch.randn(40, 128)))


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\x00", "trailing"),
    (lambda b: b"\x02" + b[1:], "version"),
    (lambda b: b[:3] + struct.pack("<H", 65520) + b[5:], "bad chunk header"),  # 65520 is not prime
    (lambda b: b[:5] + b"\x00" + b[6:], "bad chunk header"),  # k = 0
    (lambda b: b[:6] + struct.pack("<H", 65530) + b[8:], "outside the field"),
    (lambda b: b"", "truncated"),
])
def test_malformed_commitments_rejected(mutate, message):
    bad = mutate(_valid_bytes())
    with pytest.raises(CommitmentError, match=message):
        decode_proofs(bad)
    with pytest.raises(CommitmentError, match=message):  # the intake's check, which builds no proofs
        commitment_chunks(base64.b64encode(bad).decode())


def test_commitment_chunks_counts_what_parse_commitment_builds():
    for n in (1, 31, 32, 33, 100, 512):
        text = make_commitment(torch.randn(n, 96))
        assert commitment_chunks(text) == len(parse_commitment(text)) == len(chunk_bounds(n))


def test_bad_base64_and_oversize_rejected():
    with pytest.raises(CommitmentError, match="base64"):
        parse_commitment("not base64!!")
    with pytest.raises(CommitmentError, match="bounded size"):
        parse_commitment("A" * 10_000_000)
    with pytest.raises(CommitmentError):
        parse_commitment(None)  # type: ignore[arg-type]


def test_encode_decode_identity():
    proofs = build_proofs(torch.randn(33, 100))
    again = decode_proofs(encode_proofs(proofs))
    assert [p.modulus for p in again] == [p.modulus for p in proofs]
    assert all(np.array_equal(a.coeffs, b.coeffs) for a, b in zip(again, proofs))
    assert isinstance(again[0], ChunkProof)


def test_the_final_hidden_states_are_recorded_for_the_capturing_thread_only():
    """A model one thread replays on may be run by another at the same time (a coordinator's policy: its verify thread
    replays on it while a tool checks a probe). Before, the other thread's forward landed in this thread's capture, and
    a CI run's [16, H] replay failed on a [1, H] it had picked up."""
    import threading

    from tests.integration.test_verify_matrix import tiny_model
    from verify.commitment import capture_final_hidden
    from verify.rollouts import recompute

    model = tiny_model(0)
    with capture_final_hidden(model) as mine:
        other = threading.Thread(target=recompute, args=(model, [[7, 8]], [[9, 10]]))
        other.start()
        other.join()
        assert mine == []
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert [h.shape[:2] for h in mine] == [(1, 3)]


def test_replays_on_one_model_from_two_threads_match_each_alone():
    """The realistic case: two replays of different batch sizes on one model at once, many times over."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_verify_matrix import tiny_model
    from verify.rollouts import recompute

    model = tiny_model(0)
    a = ([[1, 2, 3, 4]] * 16, [[5, 6, 7, 8, 9]] * 16)
    b = ([[11, 12]], [[13, 14, 15]])
    alone_a, alone_b = recompute(model, *a), recompute(model, *b)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(20):
            fa, fb = pool.submit(recompute, model, *a), pool.submit(recompute, model, *b)
            for got, alone in ((fa.result(), alone_a), (fb.result(), alone_b)):
                assert all(torch.equal(x, y) for x, y in zip(got, alone))
