"""Seeded, replayable sampling: two-level Gumbel-max with a counter-based hash (docs/PROTOCOL.md, "Work
and submissions").

The coordinator hands out one integer seed per sample. Every random number is a pure function of
(seed, t, what) where t is the 0-based position within the completion:

    u = (hash53(seed, t, what) + 0.5) / 2**53       uniform in (0, 1), never 0 or 1
    g = -log(-log(u))                               standard Gumbel

so a verifier that recomputes the logits can replay every choice, whatever batch size, position in
the batch, thread count or device the worker used.

Two levels, because hashing the whole vocabulary at every position (150k hashes per token) costs as
much as a small model's forward pass. The vocabulary is cut into blocks of BLOCK = 256 token ids:

    s_v      = logits_v / T on the top-p nucleus, -inf elsewhere
    block    = argmax_j ( logsumexp_{v in block j} s_v + g(seed, t, block j) )
    token    = argmax_{v in block} ( s_v + g(seed, t, token v) )

By the Gumbel-max property the block is drawn with probability equal to its mass and the token with
its probability within the block, so the token is an exact sample of softmax(s): only
V/256 + 256 hashes per position instead of V.

hash53 is SplitMix64: the row key mixes seed and position; token v takes the (v+1)-th output of the
SplitMix64 stream at that key, block j the (j+1)-th output of the stream at a second key (top 53
bits). It runs on int64 tensors: multiplication wraps modulo 2**64 as SplitMix64 wants, and right
shifts are masked to be logical, so CPU and CUDA produce identical bits (tests compare with a
pure-Python reference).

Top-p: the nucleus is the smallest set of most likely tokens whose probability reaches `top_p`, i.e.
the tokens whose probability mass strictly before them (in descending order) is `< top_p`.
The reported logprob is that of the chosen token under the distribution actually sampled from
(temperature-scaled, renormalised over the nucleus), computed in fp32 from the raw logits.
Temperature 0 means greedy (no noise); the reported logprob is then 0 (a point mass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import MAX_SEED as MAX_SEED, check_seed as check_seed, turn_seed as turn_seed  # torch-free, re-exported

BLOCK = 256  # token ids per first-level block (part of the sampling contract: changing it changes samples)


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic to speak of)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's stream increment
_M1 = _signed(0xBF58476D1CE4E5B9)  # SplitMix64 finaliser multipliers
_M2 = _signed(0x94D049BB133111EB)
_POS = _signed(0xD6E8FEB86659FD93)  # separates the position from the seed
_BLOCK_TAG = _signed(0xA0761D6478BD642F)  # separates the block stream from the token stream


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift on int64: >> is arithmetic for negative values, so mask the copied sign bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _fmix64(z: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on CPU and CUDA, which is exactly SplitMix64's arithmetic.
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per (seed, position) row; seeds are 63-bit non-negative ints."""
    h = _fmix64(seeds.to(torch.int64) + _GAMMA)
    return _fmix64(h ^ (positions.to(torch.int64) * _POS))


def _stream_uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys [B], ids [B, K] (or [K]) -> float64 [B, K]: output ids+1 of each row's SplitMix64 stream."""
    ids = ids.to(torch.int64)
    if ids.dim() == 1:
        ids = ids[None, :]
    bits = _srl(_fmix64(keys[:, None] + (ids + 1) * _GAMMA), 11)
    return (bits.to(torch.float64) + 0.5) / 2.0**53


def token_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B] seeds x [B] positions x [B, K] (or [K]) token ids -> [B, K] float64 uniforms in (0, 1)."""
    return _stream_uniform(_row_keys(seeds, positions), token_ids)


def block_uniform(seeds: torch.Tensor, positions: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Same for first-level blocks (an independent stream)."""
    return _stream_uniform(_fmix64(_row_keys(seeds, positions) ^ _BLOCK_TAG), block_ids)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] token-level uniforms for the whole vocabulary (tests and diagnostics)."""
    return token_uniform(seeds, positions, torch.arange(vocab_size, device=seeds.device))


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    # float64 logs, then fp32: CPU and CUDA agree to within fp32 rounding.
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_noise_batch(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] token-level Gumbel noise."""
    return _gumbel(hash_uniform(seeds, positions, vocab_size))


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] token-level Gumbel noise for one (seed, position)."""
    check_seed(seed)
    s = torch.tensor([seed], dtype=torch.int64, device=device)
    p = torch.tensor([position], dtype=torch.int64, device=device)
    return gumbel_noise_batch(s, p, vocab_size)[0]


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


def _blocks(masked: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, nb, BLOCK], padded with -inf."""
    b, v = masked.shape
    nb = -(-v // BLOCK)
    padded = torch.nn.functional.pad(masked, (0, nb * BLOCK - v), value=float("-inf"))
    return padded.view(b, nb, BLOCK)


def _block_gumbel(seeds: torch.Tensor, positions: torch.Tensor, n_blocks: int) -> torch.Tensor:
    return _gumbel(block_uniform(seeds, positions, torch.arange(n_blocks, device=seeds.device)))


def _inner_gumbel(seeds: torch.Tensor, positions: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    ids = block[:, None] * BLOCK + torch.arange(BLOCK, device=block.device)[None, :]
    return _gumbel(token_uniform(seeds, positions, ids))


def sample_step(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
                top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step for a batch. logits [B, V] (any float dtype), seeds/positions [B] int.

    Returns (tokens [B] int64, logprobs [B] fp32) where logprob is that of the chosen token under the
    temperature-scaled, nucleus-renormalised fp32 distribution.
    """
    check_sampling(temperature, top_p)
    logits = logits.float()
    dev = logits.device
    if temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=dev)
    seeds, positions = seeds.to(dev, torch.int64), positions.to(dev, torch.int64)
    scaled = logits / temperature
    masked = scaled if top_p >= 1.0 else torch.where(nucleus_mass_before(scaled) < top_p, scaled,
                                                     torch.tensor(float("-inf"), device=dev))
    blocks = _blocks(masked)
    block_scores = torch.logsumexp(blocks, dim=-1)  # log-mass of each block (-inf when empty)
    block = torch.argmax(block_scores + _block_gumbel(seeds, positions, blocks.shape[1]), dim=-1)
    rows = torch.arange(blocks.shape[0], device=dev)
    inner = blocks[rows, block] + _inner_gumbel(seeds, positions, block)
    tokens = block * BLOCK + torch.argmax(inner, dim=-1)
    # log p = s_token - logsumexp(s), the latter from the block log-masses already at hand.
    logprobs = masked.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(block_scores, dim=-1)
    return tokens, logprobs


@dataclass
class ReplayScores:
    """Per-position replay of one completion (all [T] fp32 tensors).

    margin: how far the chosen token's perturbed score falls short of the best, at whichever level
        (block or token) is worse; <= 0 when the sampler picks it, small positive values are numerical
        near-ties.
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
    numerical noise is neither required nor forbidden: competitors come from the surely-in set, the
    chosen token's block is scored with the maybe-in set (the lenient side of each comparison).
    """
    if isinstance(seed, torch.Tensor):
        if seed.shape != positions.shape or (seed < 0).any():
            raise ValueError("per-row seeds must be non-negative and match positions")
    else:
        check_seed(seed)
    check_sampling(temperature, top_p)
    logits = logits.float()
    dev = logits.device
    n, v = logits.shape
    chosen = chosen_ids.to(dev, torch.int64)[:, None]
    if temperature == 0.0:
        margin = logits.max(dim=-1).values - logits.gather(-1, chosen)[:, 0]
        zero = torch.zeros_like(margin)
        return ReplayScores(margin, zero - 1.0, zero, zero)
    scaled = logits / temperature
    if top_p < 1.0:
        neg_inf = torch.tensor(float("-inf"), device=dev)
        is_chosen = torch.arange(v, device=dev)[None, :] == chosen
        before = nucleus_mass_before(scaled)
        surely_in = (before < max(top_p - nucleus_slack, 0.0)) | (before == 0.0)  # the top token is always in
        maybe_in = before < min(top_p + nucleus_slack, 1.0 + 1e-6)
        outside = before.gather(-1, chosen)[:, 0] - top_p
        sure = torch.where(surely_in | is_chosen, scaled, neg_inf)
        maybe = torch.where(maybe_in | is_chosen, scaled, neg_inf)
    else:  # one nucleus (everything): compute each quantity once
        sure = maybe = scaled
        outside = torch.full((n,), -1.0, device=dev)
    seeds = (seed.to(dev, torch.int64) if isinstance(seed, torch.Tensor)
             else torch.full((n,), seed, dtype=torch.int64, device=dev))
    positions = positions.to(dev, torch.int64)
    block_c = chosen[:, 0] // BLOCK
    rows = torch.arange(n, device=dev)
    # Level 1: the chosen token's block against every block.
    sure_blocks = _blocks(sure)
    sure_scores = torch.logsumexp(sure_blocks, dim=-1)
    gb = _block_gumbel(seeds, positions, sure_blocks.shape[1])
    best_block = (sure_scores + gb).max(dim=-1).values
    maybe_scores = sure_scores if maybe is sure else torch.logsumexp(_blocks(maybe), dim=-1)
    chosen_block = maybe_scores[rows, block_c] + gb[rows, block_c]
    # Level 2: the chosen token against the others in its block.
    inner = sure_blocks[rows, block_c] + _inner_gumbel(seeds, positions, block_c)
    chosen_inner = inner[rows, chosen[:, 0] - block_c * BLOCK]
    margin = torch.maximum(best_block - chosen_block, inner.max(dim=-1).values - chosen_inner)
    # Smallest nucleus -> largest logprob; largest nucleus -> smallest. log p = s - logsumexp(s).
    lp_hi = sure.gather(-1, chosen)[:, 0] - torch.logsumexp(sure_scores, dim=-1)
    lp_lo = lp_hi if maybe is sure else maybe.gather(-1, chosen)[:, 0] - torch.logsumexp(maybe_scores, dim=-1)
    return ReplayScores(margin, outside, lp_hi, torch.minimum(lp_lo, lp_hi))


def token_margins(logits: torch.Tensor, seed: int, positions: torch.Tensor, temperature: float) -> torch.Tensor:
    """[T, V] replay margin of every token at top_p = 1 (logit units, x T): how far its perturbed score
    falls short of the winner's, at the worse of the two levels. The sampled token has 0; a token within
    the verifier's `sample_margin` would also pass. (Calibration and attack tests: what a node that
    chooses among passing tokens can choose from.)"""
    check_seed(seed)
    scaled = logits.float() / temperature
    n, v = scaled.shape
    seeds = torch.full((n,), seed, dtype=torch.int64, device=scaled.device)
    positions = positions.to(scaled.device, torch.int64)
    blocks = _blocks(scaled)
    block_scores = torch.logsumexp(blocks, -1) + _block_gumbel(seeds, positions, blocks.shape[1])
    best_block = block_scores.max(-1).values
    out = torch.empty(n, v, device=scaled.device)
    for j in range(blocks.shape[1]):
        inner = blocks[:, j] + _inner_gumbel(seeds, positions, torch.full((n,), j, device=scaled.device))
        m = torch.maximum((best_block - block_scores[:, j])[:, None], inner.max(-1, keepdim=True).values - inner)
        lo, hi = j * BLOCK, min(v, (j + 1) * BLOCK)
        out[:, lo:hi] = m[:, :hi - lo]
    return out * temperature
