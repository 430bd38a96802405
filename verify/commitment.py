"""Activation commitments (TOPLOC scheme, docs/PROTOCOL.md, "Work and submissions"), with a prime modulus always.

What is committed: the final hidden states (the input of the LM head) at the positions that produced
each completion token, i.e. sequence positions P-1 .. P+N-2 for a prompt of P tokens and a
completion of N. They depend on the whole prefix, so they also bind the prompt and the weights.

Per chunk of `CHUNK_TOKENS` (32) completion tokens: flatten the chunk's hidden states to
[tokens * hidden], take the `TOPK` (128) entries of largest magnitude (fewer when the chunk is
smaller), and commit to them as a polynomial f over GF(p) with f(index mod p) = bf16 bit pattern.
p is the largest prime <= 65521 for which `index mod p` is injective on the chunk's top-k indices and
which exceeds every committed 16-bit value, so interpolation never divides by zero and every
coefficient fits in 16 bits. (The reference `toploc` searched non-prime moduli downward from 65536
and then failed on honest proofs whenever it landed on one.)

Wire format (little-endian), base64-encoded in the rollout's `commitment` field:
    u8 version (=1), u16 n_chunks, then per chunk: u16 p, u8 k, k x u16 coefficients (lowest first)
A full chunk costs 2 + 1 + 256 = 259 bytes, i.e. about 8.1 bytes per completion token.

Verification recomputes the hidden states (one prefill with the claimed weights), takes the top-k
indices of each recomputed chunk, evaluates f there and compares with the recomputed bf16 values:
sign+exponent mismatches are counted; on the matches the mantissa difference (in bf16 ulps) is
averaged (mean and median). An honest prover on other hardware differs by a few ulps; a different
model, prefix or weights gives random-looking values.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import struct
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator

import numpy as np

from protocol.errors import PrimeNodeError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

VERSION = 1
CHUNK_TOKENS = 32
TOPK = 128
FIELD_MAX = 65521  # largest prime below 2**16: coefficients always fit in a u16
MAX_CHUNKS = 4096  # 131072 completion tokens: far above any max_tokens we hand out
MAX_COMMITMENT_BYTES = 3 + MAX_CHUNKS * (3 + 2 * TOPK)


class CommitmentError(PrimeNodeError):
    """A commitment that cannot be decoded or built (malformed input, not a failed match)."""


def _sieve(limit: int) -> np.ndarray:
    is_p = np.ones(limit + 1, dtype=bool)
    is_p[:2] = False
    for i in range(2, int(limit**0.5) + 1):
        if is_p[i]:
            is_p[i * i::i] = False
    return np.flatnonzero(is_p)


_PRIMES_DESC = _sieve(FIELD_MAX)[::-1].astype(np.int64)
_PRIME_SET = frozenset(int(p) for p in _PRIMES_DESC)


def is_prime(n: int) -> bool:
    return n in _PRIME_SET


def choose_modulus(indices: np.ndarray, max_value: int) -> int:
    """Largest prime p <= 65521 with p > max_value and `indices mod p` pairwise distinct."""
    k = len(indices)
    for p in _PRIMES_DESC:
        p = int(p)
        if p <= max_value or p < k:
            break
        if len(np.unique(indices % p)) == k:
            return p
    raise CommitmentError("no prime modulus makes these indices injective")  # needs ~k**2/2 collisions: never seen


@lru_cache(maxsize=8)
def _inverse_table(p: int) -> np.ndarray:
    """inv[a] = a^(p-2) mod p for every a in [0, p) (inv[0] unused). Products stay < 2**32."""
    base = np.arange(p, dtype=np.int64)
    result = np.ones(p, dtype=np.int64)
    e = p - 2
    while e:
        if e & 1:
            result = result * base % p
        base = base * base % p
        e >>= 1
    result.setflags(write=False)
    return result


def interpolate(xs: np.ndarray, ys: np.ndarray, p: int) -> np.ndarray:
    """Coefficients (lowest degree first) of the unique poly of degree < k through (xs, ys) over GF(p)."""
    row: np.ndarray = interpolate_rows(np.asarray(xs)[None], np.asarray(ys)[None], p)[0]
    return row


def interpolate_rows(xs: np.ndarray, ys: np.ndarray, p: int) -> np.ndarray:
    """`interpolate` of each row of xs, ys [n, k] (one field, one k): coefficients [n, k].

    Newton divided differences, then expansion to monomial form: O(k^2) in vectorised int64, the n rows at once.
    One row at a time, the 2k numpy calls of a k = 128 chunk cost 1.1-1.5 ms, nearly all call overhead; the rows
    of a whole batch of rollouts share those calls (bench/commitment_cost.py)."""
    xs = np.asarray(xs, dtype=np.int64) % p
    c = np.asarray(ys, dtype=np.int64) % p
    n, k = xs.shape
    inv = _inverse_table(p)
    for j in range(1, k):
        num = (c[:, j:] - c[:, j - 1:-1]) % p
        den = (xs[:, j:] - xs[:, :-j]) % p
        c[:, j:] = num * inv[den] % p
    poly = np.zeros((n, k), dtype=np.int64)
    poly[:, 0] = c[:, k - 1]
    for deg, i in enumerate(range(k - 2, -1, -1), start=1):  # poly = poly * (x - xs[i]) + c[i]
        low = poly[:, :deg]
        shifted = np.zeros((n, deg + 1), dtype=np.int64)
        shifted[:, 1:] = low
        shifted[:, :deg] -= xs[:, i:i + 1] * low % p
        shifted[:, 0] += c[:, i]
        poly[:, :deg + 1] = shifted % p
    return poly


def evaluate(coeffs: np.ndarray, xs: np.ndarray, p: int) -> np.ndarray:
    """Horner's rule at every x at once."""
    row: np.ndarray = evaluate_rows(np.asarray(coeffs)[None], np.asarray(xs)[None], np.array([p]))[0]
    return row


def evaluate_rows(coeffs: np.ndarray, xs: np.ndarray, moduli: np.ndarray) -> np.ndarray:
    """`evaluate` of each row: coeffs [n, k] at xs [n, m] over GF(moduli[row]), Horner's rule for all rows at once."""
    p = np.asarray(moduli, dtype=np.int64)[:, None]
    xs = np.asarray(xs, dtype=np.int64) % p
    acc = np.zeros(xs.shape, dtype=np.int64)
    for i in range(coeffs.shape[1] - 1, -1, -1):
        acc = (acc * xs + coeffs[:, i:i + 1]) % p
    return acc


def bf16_bits(hidden: torch.Tensor) -> np.ndarray:
    """Any float tensor -> int64 array of its bf16 bit patterns (0..65535), same shape, flattened."""
    import torch

    h = hidden.detach().to("cpu", torch.bfloat16).contiguous()
    return h.view(torch.int16).numpy().astype(np.int64).reshape(-1) & 0xFFFF


def _topk_by_magnitude(bits: np.ndarray, k: int) -> np.ndarray:
    # Magnitude = bits without the sign; bf16 bit patterns order like their absolute values.
    mag = bits & 0x7FFF
    if k >= len(mag):
        return np.arange(len(mag), dtype=np.int64)
    return np.argpartition(-mag, k - 1, kind="introselect")[:k].astype(np.int64)


@dataclass(frozen=True)
class ChunkProof:
    modulus: int
    coeffs: np.ndarray  # int64, k entries in [0, modulus)


def points_per_chunk(n_elements: int) -> int:
    """TOPK, but never more than a quarter of a small chunk: near-zero entries are all rounding noise."""
    return max(1, min(TOPK, n_elements // 4))


def chunk_bounds(n_tokens: int) -> list[tuple[int, int]]:
    return [(s, min(s + CHUNK_TOKENS, n_tokens)) for s in range(0, n_tokens, CHUNK_TOKENS)]


def build_proofs(hidden: torch.Tensor) -> list[ChunkProof]:
    """hidden [N, H] final hidden states of the committed positions -> one proof per 32-token chunk."""
    return build_proofs_many([hidden])[0]


def build_proofs_many(hiddens: list[torch.Tensor]) -> list[list[ChunkProof]]:
    """`build_proofs` of each tensor, the chunks of all of them interpolated together (grouped by field and k)."""
    chunks: list[tuple[int, np.ndarray, np.ndarray]] = []  # (p, x, y) of every chunk, in order
    counts = []
    for hidden in hiddens:
        if hidden.dim() != 2 or hidden.shape[0] == 0:
            raise CommitmentError("hidden states must be a non-empty [tokens, hidden] tensor")
        all_bits = bf16_bits(hidden).reshape(hidden.shape[0], -1)
        bounds = chunk_bounds(hidden.shape[0])
        counts.append(len(bounds))
        for s, e in bounds:
            bits = all_bits[s:e].reshape(-1)
            bits = np.where((bits & 0x7F80) == 0x7F80, 0x7FC0, bits)  # all NaN/inf -> one canonical NaN
            idx = _topk_by_magnitude(bits, points_per_chunk(len(bits)))
            vals = bits[idx]
            p = choose_modulus(idx, int(vals.max()))
            chunks.append((p, idx % p, vals))
    coeffs: list[np.ndarray | None] = [None] * len(chunks)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (p, x, _) in enumerate(chunks):
        groups.setdefault((p, len(x)), []).append(i)
    for (p, _), rows in groups.items():
        solved = interpolate_rows(np.stack([chunks[i][1] for i in rows]), np.stack([chunks[i][2] for i in rows]), p)
        for i, row in zip(rows, solved):
            coeffs[i] = row
    out, at = [], 0
    for n in counts:
        out.append([ChunkProof(chunks[i][0], coeffs[i]) for i in range(at, at + n)])  # type: ignore[arg-type]
        at += n
    return out


def encode_proofs(proofs: list[ChunkProof]) -> bytes:
    out = [struct.pack("<BH", VERSION, len(proofs))]
    for pr in proofs:
        out.append(struct.pack("<HB", pr.modulus, len(pr.coeffs)))
        out.append(pr.coeffs.astype("<u2").tobytes())
    return b"".join(out)


def _chunk_headers(data: bytes) -> list[tuple[int, int, int]]:
    """(modulus, k, offset of its k coefficients) of each chunk of an encoded commitment: every check of
    the encoding but the coefficients' range (_check_coefficients)."""
    if len(data) > MAX_COMMITMENT_BYTES:
        raise CommitmentError(f"commitment is {len(data)} bytes (limit {MAX_COMMITMENT_BYTES})")
    if len(data) < 3:
        raise CommitmentError("commitment is truncated")
    version, n = struct.unpack_from("<BH", data, 0)
    if version != VERSION:
        raise CommitmentError(f"unknown commitment version {version}")
    off, headers = 3, []
    for _ in range(n):
        if off + 3 > len(data):
            raise CommitmentError("commitment is truncated")
        p, k = struct.unpack_from("<HB", data, off)
        off += 3
        if not is_prime(p) or k == 0 or k > TOPK or p < k:
            raise CommitmentError(f"bad chunk header (modulus {p}, k {k})")
        if off + 2 * k > len(data):
            raise CommitmentError("commitment is truncated")
        headers.append((p, k, off))
        off += 2 * k
    if off != len(data):
        raise CommitmentError("trailing bytes after the commitment")
    return headers


def _check_coefficients(data: bytes, headers: list[tuple[int, int, int]]) -> None:
    """Every coefficient below its chunk's modulus, in one numpy comparison for all chunks (one per chunk
    cost ~4 us each: 16 chunks x 128 rollouts of a submission, in the coordinator's intake)."""
    if not headers:
        return
    coeffs = np.frombuffer(b"".join(data[o:o + 2 * k] for _, k, o in headers), dtype="<u2")
    moduli = np.repeat(np.array([p for p, _, _ in headers]), [k for _, k, _ in headers])
    if (coeffs >= moduli).any():
        raise CommitmentError("coefficient outside the field")


def decode_proofs(data: bytes) -> list[ChunkProof]:
    headers = _chunk_headers(data)
    _check_coefficients(data, headers)
    return [ChunkProof(p, np.frombuffer(data, dtype="<u2", count=k, offset=o).astype(np.int64)) for p, k, o in headers]


def make_commitment(hidden: torch.Tensor) -> str:
    """hidden [N, H] -> the base64 string carried in a rollout's `commitment` field."""
    return make_commitments([hidden])[0]


def make_commitments(hiddens: list[torch.Tensor]) -> list[str]:
    """`make_commitment` of each tensor (a batch's rollouts), their chunks interpolated together."""
    return [base64.b64encode(encode_proofs(proofs)).decode("ascii") for proofs in build_proofs_many(hiddens)]


def _commitment_bytes(text: str) -> bytes:
    if not isinstance(text, str) or len(text) > (MAX_COMMITMENT_BYTES + 2) // 3 * 4:
        raise CommitmentError("commitment must be a base64 string of bounded size")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise CommitmentError("commitment is not valid base64") from None


def parse_commitment(text: str) -> list[ChunkProof]:
    return decode_proofs(_commitment_bytes(text))


def commitment_chunks(text: str) -> int:
    """How many chunk proofs a well-formed commitment holds (CommitmentError as parse_commitment raises it),
    without building them: what the coordinator's intake checks of every rollout, replayed or not."""
    raw = _commitment_bytes(text)
    headers = _chunk_headers(raw)
    _check_coefficients(raw, headers)
    return len(headers)


@dataclass(frozen=True)
class ChunkScore:
    exp_mismatch_frac: float  # fraction of top-k entries whose sign/exponent differ
    mant_err_mean: float  # mean |mantissa difference| in bf16 ulps over exponent matches
    mant_err_median: float
    points: int  # how many entries were compared (statistics over fewer points are noisier)


MISMATCH = ChunkScore(1.0, 128.0, 128.0, TOPK)  # what a structurally wrong proof scores


def score_commitment(proofs: list[ChunkProof], hidden: torch.Tensor) -> list[ChunkScore]:
    """Compare proofs against recomputed hidden states [N, H], one score per 32-token chunk.

    Each chunk is judged on its own (one bad chunk fails the rollout). A chunk-count or point-count
    mismatch scores as a complete mismatch.
    """
    bounds = chunk_bounds(hidden.shape[0])
    if len(proofs) != len(bounds):
        return [MISMATCH]
    all_bits = bf16_bits(hidden).reshape(hidden.shape[0], -1)
    picked = []  # (top-k indices, recomputed values) per chunk
    for (s, e), pr in zip(bounds, proofs):
        bits = all_bits[s:e].reshape(-1)
        k = points_per_chunk(len(bits))
        if len(pr.coeffs) != k:
            return [MISMATCH]
        idx = _topk_by_magnitude(bits, k)
        picked.append((idx, bits[idx]))
    claimed: list[np.ndarray | None] = [None] * len(proofs)
    by_k: dict[int, list[int]] = {}
    for i, pr in enumerate(proofs):
        by_k.setdefault(len(pr.coeffs), []).append(i)
    for rows in by_k.values():  # every chunk's polynomial at its points, the chunks of one k at once
        moduli = np.array([proofs[i].modulus for i in rows], dtype=np.int64)
        xs = np.stack([picked[i][0] for i in rows]) % moduli[:, None]
        for i, row in zip(rows, evaluate_rows(np.stack([proofs[i].coeffs for i in rows]), xs, moduli)):
            claimed[i] = row
    scores = []
    for (idx, actual), got in zip(picked, claimed):
        assert got is not None
        exp_ok = (got >> 7) == (actual >> 7)  # sign + 8 exponent bits
        mant = np.abs((got & 0x7F) - (actual & 0x7F))[exp_ok]
        scores.append(ChunkScore(
            exp_mismatch_frac=float(1.0 - exp_ok.mean()),
            mant_err_mean=float(mant.mean()) if len(mant) else 128.0,
            mant_err_median=float(np.median(mant)) if len(mant) else 128.0,
            points=len(idx),
        ))
    return scores


@contextlib.contextmanager
def capture_final_hidden(model: PreTrainedModel) -> Iterator[list[torch.Tensor]]:
    """Record the LM head's input (the final, normalised hidden states) on every forward call.

    A forward pre-hook on the output embedding works for any Hugging Face causal LM without knowing
    its module names; with `logits_to_keep` the head only sees the kept positions, which is exactly
    what decoding needs.

    Only this thread's forward calls are recorded: a model one thread replays on may be run by another at the same
    time (a coordinator's policy, replayed by its verify thread while a test or a tool checks a probe on it), and the
    hook sees every thread's calls. A CI run's replay picked up another thread's [1, H] hidden states for its
    [16, H] batch and failed ("Sizes of tensors must match").
    """
    captured: list[torch.Tensor] = []
    owner = threading.get_ident()

    def record(_mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if threading.get_ident() == owner:
            captured.append(inputs[0].detach())

    handle = model.get_output_embeddings().register_forward_pre_hook(record)
    try:
        yield captured
    finally:
        handle.remove()
