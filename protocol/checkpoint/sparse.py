"""Encoding "sparse-delta": each shard carries the words that changed since the base step, nothing else.

A small optimizer step (RL: lr ~1e-6) moves only 1-3 % of bf16 values, and a moved value usually moves
by one unit in the last place. XOR-then-zstd ("xor-delta") still spends ~30 bits per changed value on
the zero runs between them; here the changed words are listed explicitly, as position gaps and
arithmetic differences (zigzag: +1 ulp -> 2, -1 ulp -> 1), each split into byte planes so that zstd
sees long runs of equal high bytes. Measured in BENCHMARKS.md ("Deltas over many steps").

Shard i still covers raw payload bytes [i * shard_size, ...) as in every encoding; what it decompresses
to is one *block* (little-endian throughout; the authoritative description is docs/PROTOCOL.md):

    offset  size  field
    0       4     magic b"PNSD"
    4       1     version = 1
    5       1     mode: 0 = sparse, 1 = dense
    6       1     word size W in bytes: 1, 2, 4 or 8 (the packer uses the payload dtype's element size)
    7       1     reserved = 0
    8       4     n: raw bytes covered (the shard's raw range length)
    12      4     k: changed words (0 in dense mode)
    sparse: 4 planes of k bytes   byte j of gap_i (gap_0 = index_0, gap_i = index_i - index_{i-1} - 1)
            W planes of k bytes   byte j of zigzag(delta_i), delta_i = (new - base) mod 2^(8W) as signed
            n mod W bytes         new XOR base for the tail after the last whole word
    dense:  n bytes               new XOR base (the packer's choice when sparse would not be smaller)

Words are taken from the start of the raw range: word j is bytes [j*W, (j+1)*W) of the range. The block
is exactly 16 + k*(4+W) + (n mod W) bytes (sparse) or 16 + n (dense); anything else is refused.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .codec import xor_into
from .errors import CheckpointError
from .manifest import SPARSE_BLOCK_HEADER

MAGIC = b"PNSD"
VERSION = 1
MODE_SPARSE, MODE_DENSE = 0, 1
WORD_SIZES = (1, 2, 4, 8)
GAP_BYTES = 4
_HEADER = struct.Struct("<4sBBBBII")
assert _HEADER.size == SPARSE_BLOCK_HEADER
_UNSIGNED: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_SIGNED: dict[int, np.dtype[np.signedinteger[Any]]] = {
    1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


def word_size_for(dtype_name: str) -> int:
    """Element size of a torch dtype name ("bfloat16" -> 2), or 1 when it is not a 1/2/4/8-byte type."""
    from .payload import DTYPES

    for size, name in DTYPES.values():
        if name == dtype_name and size in WORD_SIZES:
            return size
    return 1


def _planes(values: np.ndarray, nbytes: int, out: np.ndarray) -> None:
    """Write byte plane j of `values` (little-endian, `nbytes` wide) to out[j*k:(j+1)*k]."""
    k = len(values)
    le = values.astype(_UNSIGNED[nbytes], copy=False).view(np.uint8).reshape(k, nbytes)
    out[:nbytes * k].reshape(nbytes, k)[:] = le.T


def _unplanes(data: np.ndarray, nbytes: int, k: int) -> np.ndarray:
    """Inverse of `_planes`: k little-endian `nbytes`-wide unsigned ints from nbytes planes of k bytes."""
    out = np.empty((k, nbytes), np.uint8)
    out[:] = data[:nbytes * k].reshape(nbytes, k).T
    return out.reshape(-1).view(_UNSIGNED[nbytes])


def encode_block(new: memoryview, base: memoryview, word: int) -> bytearray:
    """The block that turns `base` into `new` (two equal-length raw ranges)."""
    n = len(new)
    if len(base) != n:
        raise ValueError("delta operands differ in length")
    if word not in WORD_SIZES:
        raise ValueError(f"word size must be one of {WORD_SIZES}")
    m, t = divmod(n, word)
    a = np.frombuffer(new, _UNSIGNED[word], m)
    b = np.frombuffer(base, _UNSIGNED[word], m)
    delta = a - b  # wraps modulo 2^(8W)
    index = np.flatnonzero(delta)
    k = len(index)
    sparse_size = SPARSE_BLOCK_HEADER + k * (GAP_BYTES + word) + t
    if sparse_size >= SPARSE_BLOCK_HEADER + n:  # dense: plain XOR of the range
        out = bytearray(SPARSE_BLOCK_HEADER + n)
        _HEADER.pack_into(out, 0, MAGIC, VERSION, MODE_DENSE, word, 0, n, 0)
        dense = memoryview(out)[SPARSE_BLOCK_HEADER:]
        dense[:] = new
        xor_into(dense, base)
        return out
    out = bytearray(sparse_size)
    _HEADER.pack_into(out, 0, MAGIC, VERSION, MODE_SPARSE, word, 0, n, k)
    body = np.frombuffer(out, np.uint8)[SPARSE_BLOCK_HEADER:]
    if k:
        gaps = np.empty(k, np.int64)
        gaps[0] = index[0]
        np.subtract(index[1:], index[:-1], out=gaps[1:])
        gaps[1:] -= 1
        _planes(gaps, GAP_BYTES, body)
        signed = delta[index].view(_SIGNED[word])
        zigzag = (signed << 1) ^ (signed >> (8 * word - 1))
        _planes(zigzag.view(_UNSIGNED[word]), word, body[GAP_BYTES * k:])
    if t:
        tail = body[(GAP_BYTES + word) * k:]
        tail[:] = np.frombuffer(new, np.uint8)[m * word:]
        tail ^= np.frombuffer(base, np.uint8)[m * word:]
    return out


def _bad(index: int | None, what: str) -> CheckpointError:
    where = f"shard {index}: " if index is not None else ""
    return CheckpointError("bad_delta", f"{where}sparse-delta block {what}", shard=index)


class ParsedBlock:
    """A checked block, ready to be applied to any word-aligned piece of its raw range."""

    def __init__(self, block: memoryview | bytes | bytearray, n: int, index: int | None = None):
        block = memoryview(block).cast("B")
        self.index = index
        if len(block) < SPARSE_BLOCK_HEADER:
            raise _bad(index, f"is {len(block)} bytes, shorter than its header")
        magic, version, mode, word, reserved, raw_len, k = _HEADER.unpack_from(block)
        if magic != MAGIC or version != VERSION or reserved != 0:
            raise _bad(index, f"has a bad header (magic {bytes(magic)!r}, version {version}, reserved {reserved})")
        if word not in WORD_SIZES:
            raise _bad(index, f"has word size {word}, not one of {WORD_SIZES}")
        if raw_len != n:
            raise _bad(index, f"covers {raw_len} bytes, but the shard's raw range is {n}")
        body = block[SPARSE_BLOCK_HEADER:]
        self.mode, self.word, self.n = mode, word, n
        self.m, t = divmod(n, word)
        self.positions: np.ndarray | None = None  # both set in sparse mode, None in dense mode
        self.delta: np.ndarray | None = None
        if mode == MODE_DENSE:
            if k != 0 or len(body) != n:
                raise _bad(index, f"(dense) is {len(block)} bytes with k={k}; expected {SPARSE_BLOCK_HEADER + n}, k=0")
            self.xor = body
            return
        if mode != MODE_SPARSE:
            raise _bad(index, f"has unknown mode {mode}")
        if k > self.m or len(body) != k * (GAP_BYTES + word) + t:
            raise _bad(index, f"is {len(block)} bytes for k={k} changed words of {word} bytes out of {self.m} "
                              f"(expected {SPARSE_BLOCK_HEADER + min(k, self.m) * (GAP_BYTES + word) + t})")
        data = np.frombuffer(body, np.uint8)
        unsigned = _UNSIGNED[word]
        self.positions = np.cumsum(_unplanes(data, GAP_BYTES, k).astype(np.int64) + 1) - 1
        if k and self.positions[-1] >= self.m:  # positions strictly increase: the last is the largest
            raise _bad(index, f"changes word {int(self.positions[-1])}, beyond the range's {self.m} words")
        zigzag = _unplanes(data[GAP_BYTES * k:], word, k)
        one = unsigned.type(1)
        self.delta = (zigzag >> one) ^ ((zigzag & one) * unsigned.type(np.iinfo(unsigned).max))
        self.xor = body[(GAP_BYTES + word) * k:]  # the tail after the last whole word

    def apply(self, dest: memoryview, start: int = 0) -> None:
        """`dest` holds base bytes [start, start + len(dest)) of the range (start a multiple of the word
        size, the piece ending on a word boundary or at the range's end); make them this step's."""
        end = start + len(dest)
        if start % self.word or end > self.n or (end % self.word and end != self.n):
            raise ValueError("a piece must start on a word boundary and end on one or at the range's end")
        if self.mode == MODE_DENSE:
            xor_into(dest, self.xor[start:end])
            return
        assert self.positions is not None and self.delta is not None  # sparse mode sets both
        first, words = start // self.word, min(end, self.m * self.word) // self.word - start // self.word
        if len(self.positions) and words > 0:
            lo, hi = np.searchsorted(self.positions, [first, first + words])
            if hi > lo:
                target = np.frombuffer(dest, _UNSIGNED[self.word], words)
                target[self.positions[lo:hi] - first] += self.delta[lo:hi]  # modulo 2^(8W); distinct positions
        tail_start = self.m * self.word
        if end > tail_start:  # the range's last n mod W bytes lie in this piece
            xor_into(dest[tail_start - start:], self.xor)


def apply_block(block: memoryview | bytes | bytearray, dest: memoryview, index: int | None = None) -> None:
    """`dest` holds the base's raw range; turn it into this step's, in place. Every field of the block is
    checked against `dest` and the block's own length before anything is written."""
    ParsedBlock(block, len(dest), index).apply(dest, 0)
