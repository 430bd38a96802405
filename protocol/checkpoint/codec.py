"""Per-shard work: compress, check a compressed shard against the manifest, bounded decompression, XOR.

zstd and sha256 release the GIL on large buffers, so callers run these in a thread pool over shards.
"""
from __future__ import annotations

import hashlib
import threading
from typing import IO, Iterator

import numpy as np
import zstandard

from .errors import CheckpointError
from .manifest import Manifest, ShardEntry

_local = threading.local()


def compress_shard(raw: bytes | bytearray | memoryview, level: int) -> bytes:
    """One zstd frame (content size recorded). Compressor objects are per thread: they are not thread-safe."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(raw)


class _HashingWriter:
    """File-like sink for zstd's stream writer: hashes and writes each compressed chunk as it comes."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def compress_shard_to(raw: bytes | bytearray | memoryview, level: int, f: IO[bytes]) -> tuple[int, str]:
    """Compress `raw` as one zstd frame straight into the open binary file `f`; return (zsize, sha256).

    Streams through zstd's small output buffer instead of materializing the compressed shard, which
    saves a shard-sized allocation (and its page faults) per shard.
    """
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    sink = _HashingWriter(f)
    # zstandard's stub asks for IO[bytes]; the stream writer only calls write() and flush() on its sink.
    with cctx.stream_writer(sink, size=len(raw), write_size=1 << 20, closefd=False) as writer:  # type: ignore[arg-type]
        writer.write(raw)
    return sink.size, sink.sha.hexdigest()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One decompressor per thread, reused: its context and window buffers are allocated once."""
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def _entry(manifest: Manifest, index: int) -> ShardEntry:
    if not (type(index) is int and 0 <= index < manifest.num_shards):
        raise CheckpointError("shard_index", f"shard {index!r} does not exist (the manifest lists "
                                             f"{manifest.num_shards})", shard=None)
    return manifest.shards[index]


def verify_shard(manifest: Manifest, index: int, compressed: bytes | bytearray | memoryview) -> None:
    """Size and sha256 of the compressed bytes against the signed manifest (cheap; do it before anything)."""
    entry = _entry(manifest, index)
    if len(compressed) != entry.zsize:
        raise CheckpointError("shard_size", f"shard {index}: {len(compressed)} bytes, the manifest says "
                                            f"{entry.zsize}", shard=index)
    digest = hashlib.sha256(compressed).hexdigest()
    if digest != entry.sha256:
        raise CheckpointError("shard_hash", f"shard {index}: sha256 {digest[:16]}… does not match the "
                                            f"manifest's {entry.sha256[:16]}…", shard=index)


def decompress_shard(manifest: Manifest, index: int, compressed: bytes | bytearray | memoryview,
                     out: memoryview | None = None) -> bytearray | memoryview:
    """Decompress into exactly the declared `size` bytes, never more.

    The output buffer is allocated from the manifest's `size`, not from the frame header (which the data
    controls), and the streaming reader can only write into what is left of it. One extra byte is then
    requested: if the stream has more, it is a bomb and we stop right there.
    """
    entry = _entry(manifest, index)
    size = entry.size
    buf: bytearray | memoryview
    if out is None:
        buf = bytearray(size)
        out = memoryview(buf)
    else:
        buf = out
        if len(out) != size:
            raise ValueError("output buffer must have the shard's declared size")
    for _ in decompress_chunks(manifest, index, compressed, out):  # one chunk: `out` holds the whole shard
        pass
    return buf


def decompress_chunks(manifest: Manifest, index: int, compressed: bytes | bytearray | memoryview,
                      scratch: memoryview) -> Iterator[tuple[int, memoryview]]:
    """Yield (position, chunk) over exactly the declared `size` bytes, decompressed into `scratch` piece
    by piece (each chunk is only valid until the next one), with the same bounds as `decompress_shard`:
    a stream that ends early is `shard_size`, one that goes on past `size` is `decompress_bomb` (checked
    after the last chunk, before the generator finishes). Lets a caller write a shard out of a small,
    cache-hot buffer instead of a shard-sized one."""
    entry = _entry(manifest, index)
    size = entry.size
    try:
        reader = _decompressor().stream_reader(compressed, read_across_frames=True)
        pos = 0
        while pos < size:
            want = min(len(scratch), size - pos)
            got = 0
            while got < want:
                n = reader.readinto(scratch[got:want])
                if n == 0:
                    raise CheckpointError("shard_size", f"shard {index}: decompresses to {pos + got} bytes, the "
                                                        f"manifest says {size}", shard=index)
                got += n
            yield pos, scratch[:want]
            pos += want
        if reader.readinto(memoryview(bytearray(1))) != 0:
            raise CheckpointError("decompress_bomb", f"shard {index}: decompresses beyond its declared "
                                                     f"size of {size} bytes (stopped there)", shard=index)
    except zstandard.ZstdError as e:
        raise CheckpointError("decompress_error", f"shard {index}: not a valid zstd stream ({e})",
                              shard=index) from None


def xor_into(dest: memoryview | bytearray, other: memoryview | bytes | bytearray) -> None:
    """dest ^= other, bytewise, in place (numpy on uint64 words, the tail as bytes)."""
    n = len(dest)
    if len(other) != n:
        raise ValueError("xor operands differ in length")
    words = n // 8 * 8
    a = np.frombuffer(dest, dtype=np.uint8)
    b = np.frombuffer(other, dtype=np.uint8)
    if words:
        np.bitwise_xor(a[:words].view(np.uint64), b[:words].view(np.uint64), out=a[:words].view(np.uint64))
    if words < n:
        np.bitwise_xor(a[words:], b[words:], out=a[words:])
