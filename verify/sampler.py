"""Seeded, replayable sampling: Gumbel-max with a counter-based hash (DESIGN §7).

The coordinator hands out one integer seed per sample. The noise added to token `v` at completion
position `t` (0-based index within the completion) is a pure function of (seed, t, v):

    u = (hash32(seed, t, v) + 0.5) / 2**32          uniform in (0, 1), never 0 or 1
    g = -log(-log(u))                               standard Gumbel
    token = argmax over the top-p nucleus of (logits / T + g)

so a verifier that recomputes the logits can replay every choice, whatever batch size, position in
the batch, thread count or device the worker used. The hash is murmur3's 32-bit finaliser on int64
tensors where every product stays below 2**63 (16-bit limbs times 32-bit constants): no signed
overflow and no arithmetic-shift surprises, hence bit-identical on CPU and CUDA.

Top-p: the nucleus is the smallest set of most likely tokens whose probability reaches `top_p`, i.e.
the tokens whose probability mass strictly before them (in descending order) is `< top_p`.
The reported logprob is that of the chosen token under the distribution actually sampled from
(temperature-scaled, renormalised over the nucleus), computed in fp32 from the raw logits.
Temperature 0 means greedy (no noise); the reported logprob is then 0 (a point mass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_C1 = 0x85EBCA6B  # murmur3 fmix32 constants
_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9  # separates the fields fed into the hash
MAX_SEED = 2**63 - 1


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32 without overflowing int64: split a into 16-bit limbs."""
    hi = ((a >> 16) * c) & _MASK16  # only the low 16 bits of hi*c survive the << 16 below
    return ((hi << 16) + (a & _MASK16) * c) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # Values are kept in [0, 2**32) so >> is a logical shift.
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _mix(h: torch.Tensor, x: torch.Tensor | int) -> torch.Tensor:
    """Fold one more 32-bit field into the running hash."""
    return _fmix32(_mul32(h ^ (x & _MASK32), _GOLDEN) ^ 0x27D4EB2F)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position) row; seeds are 63-bit non-negative ints."""
    seeds = seeds.to(torch.int64)
    h = _fmix32(seeds & _MASK32)
    h = _mix(h, (seeds >> 32) & 0x7FFFFFFF)
    return _mix(h, positions.to(torch.int64))


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] seeds x [B] positions -> [B, V] float64 uniforms in (0, 1)."""
    keys = _row_keys(seeds, positions)[:, None]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]
    h = _mix(_mix(keys, tokens), 0x5BD1E995)  # two rounds so neighbouring token ids decorrelate
    return (h.to(torch.float64) + 0.5) / 2.0**32


def gumbel_noise_batch(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] fp32 Gumbel noise. Computed in float64 so CPU/CUDA agree to within fp32 rounding."""
    u = hash_uniform(seeds, positions, vocab_size)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] Gumbel noise for one (seed, position)."""
    check_seed(seed)
    s = torch.tensor([seed], dtype=torch.int64, device=device)
    p = torch.tensor([position], dtype=torch.int64, device=device)
    return gumbel_noise_batch(s, p, vocab_size)[0]


def check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"sampling seed must be an int in [0, 2**63), got {seed!r}")


def check_sampling(temperature: float, top_p: float) -> None:
    if not (temperature >= 0.0 and temperature <= 100.0):
        raise ValueError(f"temperature must be in [0, 100], got {temperature!r}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def nucleus_mass_before(scaled: torch.Tensor) -> torch.Tensor:
    """[.., V] temperature-scaled logits -> [.., V] probability mass of all strictly more likely tokens.

    Ties are broken by token id (stable sort), identically on both sides.
    """
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p
    return torch.empty_like(before_sorted).scatter_(-1, order, before_sorted)


def sample_step(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
                top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step for a batch. logits [B, V] (any float dtype), seeds/positions [B] int.

    Returns (tokens [B] int64, logprobs [B] fp32) where logprob is that of the chosen token under the
    temperature-scaled, nucleus-renormalised fp32 distribution.
    """
    check_sampling(temperature, top_p)
    logits = logits.float()
    if temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    scaled = logits / temperature
    in_nucleus = nucleus_mass_before(scaled) < top_p if top_p < 1.0 else torch.ones_like(scaled, dtype=torch.bool)
    noise = gumbel_noise_batch(seeds.to(logits.device), positions.to(logits.device), logits.shape[-1])
    perturbed = torch.where(in_nucleus, scaled + noise, torch.tensor(float("-inf"), device=logits.device))
    tokens = torch.argmax(perturbed, dim=-1)
    masked = torch.where(in_nucleus, scaled, torch.tensor(float("-inf"), device=logits.device))
    logprobs = torch.log_softmax(masked, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


@dataclass
class ReplayScores:
    """Per-position replay of one completion (all [T] fp32 tensors).

    margin: best perturbed score among tokens surely in the nucleus minus the chosen token's
        (<= 0 when the chosen token is the argmax; small positive values are numerical near-ties).
    outside: how far the chosen token lies outside the nucleus, in probability mass
        (mass_before - top_p; <= 0 when inside).
    logprob_hi / logprob_lo: the chosen token's logprob with the smallest / largest nucleus that
        numerical noise of `nucleus_slack` allows (equal when top_p == 1).
    """

    margin: torch.Tensor
    outside: torch.Tensor
    logprob_hi: torch.Tensor
    logprob_lo: torch.Tensor


def replay_scores(logits: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor, temperature: float,
                  top_p: float, chosen_ids: torch.Tensor, *, nucleus_slack: float = 0.0) -> ReplayScores:
    """Replay the sampler on recomputed logits [T, V] for the chosen tokens [T].

    `seed` is one int, or a [T] int64 tensor (one per row, to replay many rollouts in one call).
    `nucleus_slack` widens the nucleus boundary both ways so that a token whose membership depends on
    numerical noise is neither required nor forbidden.
    """
    if isinstance(seed, torch.Tensor):
        if seed.shape != positions.shape or (seed < 0).any():
            raise ValueError("per-row seeds must be non-negative and match positions")
    else:
        check_seed(seed)
    check_sampling(temperature, top_p)
    logits = logits.float()
    dev = logits.device
    chosen = chosen_ids.to(dev, torch.int64)[:, None]
    if temperature == 0.0:
        margin = logits.max(dim=-1).values - logits.gather(-1, chosen)[:, 0]
        zero = torch.zeros_like(margin)
        return ReplayScores(margin, zero - 1.0, zero, zero)
    scaled = logits / temperature
    neg_inf = torch.tensor(float("-inf"), device=dev)
    if top_p < 1.0:
        before = nucleus_mass_before(scaled)
        surely_in = before < max(top_p - nucleus_slack, 0.0)
        surely_in |= before == 0.0  # the most likely token is always in
        maybe_in = before < min(top_p + nucleus_slack, 1.0 + 1e-6)
        outside = before.gather(-1, chosen)[:, 0] - top_p
    else:
        surely_in = maybe_in = torch.ones_like(scaled, dtype=torch.bool)
        outside = torch.full((scaled.shape[0],), -1.0, device=dev)
    seeds = (seed.to(dev, torch.int64) if isinstance(seed, torch.Tensor)
             else torch.full((scaled.shape[0],), seed, dtype=torch.int64, device=dev))
    perturbed = scaled + gumbel_noise_batch(seeds, positions.to(dev, torch.int64), scaled.shape[-1])
    best = torch.where(surely_in, perturbed, neg_inf).max(dim=-1).values
    margin = best - perturbed.gather(-1, chosen)[:, 0]
    # Smallest nucleus -> largest logprob; largest nucleus -> smallest.
    lp_hi = torch.log_softmax(torch.where(surely_in | (torch.arange(scaled.shape[-1], device=dev)[None] == chosen),
                                          scaled, neg_inf), dim=-1).gather(-1, chosen)[:, 0]
    lp_lo = torch.log_softmax(torch.where(maybe_in, scaled, neg_inf), dim=-1).gather(-1, chosen)[:, 0]
    return ReplayScores(margin, outside, lp_hi, torch.minimum(lp_lo, lp_hi))
