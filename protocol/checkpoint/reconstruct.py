"""Reconstruction: verified shards -> bounded decompression -> un-delta -> payload hash -> atomic file.

Shards come from any `shard_reader(i) -> bytes` (a directory, an HTTP mirror, a libp2p peer): each one
is checked against the signed manifest before it is decompressed, so an untrusted source can cost a
retry but never a corrupted model. Readers are called from a small thread pool (they must be
thread-safe). Writing a file, workers decode straight into a shared mapping of it (no shard buffers);
only verifying, at most `threads + 2` decoded shards are in memory at once.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import threading
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .codec import decompress_chunks, decompress_shard, verify_shard, xor_into
from .sparse import ParsedBlock, apply_block
from .errors import CheckpointError
from .manifest import Manifest, verify_manifest
from .parallel import BufferPool, ordered_map
from .payload import MAX_HEADER_BYTES
from .shard_files import MANIFEST_NAME, DirShardReader, load_manifest, scan_shard_dir

if TYPE_CHECKING:
    from tqdm import tqdm

PAYLOAD_FILE_NAME = "model.safetensors"
ShardReader = Callable[[int], bytes]


XOR_CHUNK = 1 << 20  # un-XOR a file base through a small scratch buffer that stays in cache
WRITE_CHUNK = 1 << 20  # decode-and-write piece: small enough to stay in a core's cache (a multiple of 8)
READ_BACK_CHUNK = 1 << 20


@dataclass
class BasePayload:
    """Random access to the base step's raw payload (bytes in memory or a file read with os.preadv).

    A slice returned by `read` is only valid until the same thread's next `read`. Thread-safe.
    """

    size: int
    _data: memoryview | None = None
    _fd: int | None = None
    _local: threading.local = field(default_factory=threading.local)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise CheckpointError("base_mismatch", f"base payload has {self.size} bytes; "
                                                   f"byte {offset + length} was needed")

    def _pread_into(self, offset: int, view: memoryview) -> None:
        assert self._fd is not None  # a base is either in memory (_data) or an open file (_fd)
        done, length = 0, len(view)
        while done < length:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError("base_mismatch", "base payload file shrank while reading it")
            done += n

    def read(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        if self._data is not None:
            return self._data[offset:offset + length]
        # One scratch buffer per thread, reused: callers XOR the slice right away (fresh buffers cost
        # page faults), and shards are un-XORed by several worker threads at once.
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < length:
            scratch = self._local.scratch = bytearray(length)
        view = memoryview(scratch)[:length]
        self._pread_into(offset, view)
        return view

    def read_into(self, offset: int, dest: memoryview) -> None:
        """dest[:] = base[offset:offset + len(dest)], straight from the file (no intermediate copy)."""
        self._check(offset, len(dest))
        if self._data is not None:
            dest[:] = self._data[offset:offset + len(dest)]
        else:
            self._pread_into(offset, dest)

    def xor_into(self, offset: int, dest: memoryview) -> None:
        """dest ^= base[offset:offset + len(dest)], a file base read in cache-sized chunks."""
        self._check(offset, len(dest))
        if self._data is not None:
            xor_into(dest, self._data[offset:offset + len(dest)])
            return
        chunk = getattr(self._local, "chunk", None)
        if chunk is None:
            chunk = self._local.chunk = bytearray(XOR_CHUNK)
        for at in range(0, len(dest), XOR_CHUNK):
            part = dest[at:at + XOR_CHUNK]
            view = memoryview(chunk)[:len(part)]
            self._pread_into(offset + at, view)
            xor_into(part, view)

    def header(self) -> bytes:
        """The safetensors header bytes (length prefix + JSON), or b"" if it cannot be one."""
        if self.size < 8:
            return b""
        n = int.from_bytes(self.read(0, 8), "little")
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            return b""
        return bytes(self.read(0, 8 + n))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_base(base: Any) -> BasePayload:
    """A BasePayload from bytes-like or a path to a raw payload file."""
    if isinstance(base, BasePayload):
        return base
    if isinstance(base, (bytes, bytearray, memoryview)):
        view = memoryview(base).cast("B")
        return BasePayload(len(view), _data=view)
    if isinstance(base, (str, os.PathLike)):
        try:
            fd = os.open(base, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError("base_mismatch", f"cannot open base payload {base}: {e.strerror}") from None
        return BasePayload(os.fstat(fd).st_size, _fd=fd)
    raise CheckpointError("base_mismatch", f"a base payload must be bytes or a path, not {type(base).__name__}")


def pooled_reader(manifest: Manifest, shard_reader: ShardReader,
                  ) -> Callable[[int], AbstractContextManager[bytes | memoryview]]:
    """`read(i)` as a context manager giving the compressed bytes of shard i.

    Readers that offer `read_into(index, buffer) -> memoryview` (DirShardReader does) fill a reusable
    per-thread buffer, so streaming a checkpoint does not allocate (and page-fault) every shard anew.
    """
    import contextlib
    import threading

    read_into = getattr(shard_reader, "read_into", None)
    local = threading.local()
    largest = max(s.zsize for s in manifest.shards)

    @contextlib.contextmanager
    def read(index: int) -> Iterator[bytes | memoryview]:
        if read_into is None:
            yield shard_reader(index)
            return
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(largest + 1)
        yield read_into(index, buf)

    return read


class ShardDecoder:
    """Shard i, from an untrusted reader, to the raw payload bytes it covers, from any thread and in any
    order: read -> size and sha256 against the signed manifest -> bounded decompression -> un-delta
    against the base (xor-delta: XOR; sparse-delta: base bytes, then the block's changes)."""

    def __init__(self, manifest: Manifest, shard_reader: ShardReader, base: BasePayload | None):
        if manifest.is_delta:
            if base is None:
                raise CheckpointError("base_mismatch", f"step {manifest.step} is a {manifest.encoding} against "
                                                       f"step {manifest.base_step}; its full payload is needed "
                                                       "as base")
            if base.size != manifest.total_size:
                raise CheckpointError("base_mismatch", f"base payload is {base.size} bytes but step "
                                                       f"{manifest.step} has {manifest.total_size}: wrong base")
        self.manifest = manifest
        self.base = base
        self._read = pooled_reader(manifest, shard_reader)
        self._local = threading.local()

    def _delta_base(self) -> BasePayload:
        """The base of a delta step (__init__ refused a delta step without one)."""
        assert self.base is not None
        return self.base

    def _block_buffer(self, size: int) -> memoryview:
        buf = getattr(self._local, "block", None)
        if buf is None or len(buf) < size:
            buf = self._local.block = bytearray(size)
        return memoryview(buf)[:size]

    def decode_into(self, index: int, dest: memoryview) -> None:
        """Fill `dest` (exactly `manifest.raw_size(index)` bytes) with shard `index`'s raw payload bytes."""
        m = self.manifest
        if len(dest) != m.raw_size(index):
            raise ValueError("destination must have the shard's raw size")
        offset = m.shard_offset(index)
        with self._read(index) as compressed:
            verify_shard(m, index, compressed)
            if m.encoding == "sparse-delta":
                block = self._block_buffer(m.shards[index].size)
                decompress_shard(m, index, compressed, out=block)
            else:
                decompress_shard(m, index, compressed, out=dest)
        if m.encoding == "xor-delta":
            self._delta_base().xor_into(offset, dest)
        elif m.encoding == "sparse-delta":
            self._delta_base().read_into(offset, dest)
            try:
                apply_block(block, dest, index)
            finally:
                block.release()


    def _chunk_buffer(self) -> memoryview:
        buf = getattr(self._local, "chunk", None)
        if buf is None:
            buf = self._local.chunk = bytearray(WRITE_CHUNK)
        return memoryview(buf)

    def decode_to(self, index: int, write: Callable[[int, memoryview], None]) -> None:
        """Like `decode_into`, but piece by piece through a small per-thread buffer: `write(offset, piece)`
        gets this shard's raw bytes in order (offset in the payload; the piece is only valid during the
        call). No shard-sized raw buffer is ever touched, so nothing is page-faulted but the destination.
        A bomb is detected after the last piece was written (the caller only keeps the result once the
        whole-payload hash matched)."""
        m = self.manifest
        offset, raw = m.shard_offset(index), m.raw_size(index)
        scratch = self._chunk_buffer()
        with self._read(index) as compressed:
            verify_shard(m, index, compressed)
            if m.encoding != "sparse-delta":
                for pos, piece in decompress_chunks(m, index, compressed, scratch):
                    if m.encoding == "xor-delta":
                        self._delta_base().xor_into(offset + pos, piece)
                    write(offset + pos, piece)
                return
            block = self._block_buffer(m.shards[index].size)
            decompress_shard(m, index, compressed, out=block)
        parsed = ParsedBlock(block, raw, index)
        base = self._delta_base()
        for pos in range(0, raw, WRITE_CHUNK):
            piece = scratch[:min(WRITE_CHUNK, raw - pos)]
            base.read_into(offset + pos, piece)
            parsed.apply(piece, pos)
            write(offset + pos, piece)


def iter_payload(manifest: Manifest, shard_reader: ShardReader, *, base: BasePayload | None = None,
                 threads: int = 2, sink: Callable[[int, memoryview], None] | None = None,
                 ) -> Iterator[tuple[int, memoryview]]:
    """Yield (index, raw payload slice) in order, every shard verified and decompressed within bounds.

    Reading, verifying, decompressing, un-deltaing and `sink(offset, raw)` (e.g. a positioned write) run
    in the worker threads; the caller sees the shards in order (to hash them) while the next ones are
    being processed. The slice is only valid until the next iteration (buffers are recycled).
    Does not check the whole-payload hash; `reconstruct_payload` does.
    """
    decoder = ShardDecoder(manifest, shard_reader, base)
    window = threads + 1
    buffers = BufferPool(manifest.raw_size(0), window + 1)

    def fetch(index: int) -> tuple[bytearray, memoryview]:
        buf = buffers.acquire()
        try:
            view = memoryview(buf)[:manifest.raw_size(index)]
            decoder.decode_into(index, view)
            if sink is not None:
                sink(manifest.shard_offset(index), view)
        except BaseException:
            buffers.release(buf)
            raise
        return buf, view

    results = ordered_map(fetch, range(manifest.num_shards), threads=threads, window=window)
    try:
        for index, fut in results:
            buf, raw = fut.result()
            try:
                yield index, raw
            finally:
                try:
                    raw.release()  # the buffer is reused: a view kept by the consumer must not see later shards
                except BufferError:
                    pass
                buffers.release(buf)
    finally:
        results.close()


def _hash_mismatch(manifest: Manifest, got: str) -> CheckpointError:
    hint = f" (wrong base for this {manifest.encoding}?)" if manifest.is_delta else ""
    return CheckpointError("payload_hash", f"reconstructed payload sha256 {got[:16]}… differs from "
                                          f"the manifest's {manifest.sha256[:16]}…{hint}")


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError("io_error", "the payload file shrank while it was written")
        done += n


class _OrderedHash:
    """The payload's sha256, fed in payload order by the workers themselves.

    The *head* is the first shard not yet completely hashed. The worker decoding the head hashes each
    piece right after writing it, while the piece is still in its cache; nobody reads it back. A shard
    that becomes the head part-way through (or after its worker finished it) is first read back from the
    file up to where its worker has got. Only the head's owner touches the digest, so hashing never
    holds the lock; the lock only guards who the head is and which shards are finished.
    """

    def __init__(self, manifest: Manifest, fd: int, digest: hashlib._Hash):
        self.manifest = manifest
        self.fd = fd
        self.digest = digest
        self.lock = threading.Lock()
        self.head = 0  # first shard not completely hashed
        self.hashed = 0  # bytes of the head shard hashed so far (changed only by the head's owner)
        self.finished = [False] * manifest.num_shards  # completely written by its worker
        self.read_back_bytes = 0
        self._local = threading.local()

    def _read_back(self, index: int, start: int, end: int) -> None:
        """Hash bytes [start, end) of shard `index` from the file (they were written before)."""
        back = getattr(self._local, "back", None)
        if back is None:
            back = self._local.back = memoryview(bytearray(READ_BACK_CHUNK))
        offset = self.manifest.shard_offset(index)
        for at in range(start, end, READ_BACK_CHUNK):
            part = back[:min(READ_BACK_CHUNK, end - at)]
            _pread_exact(self.fd, part, offset + at)
            self.digest.update(part)
        self.read_back_bytes += end - start

    def piece(self, index: int, pos: int, data: memoryview) -> None:
        """Shard `index`'s bytes [pos, pos + len(data)) were just written (pieces of a shard come in order)."""
        with self.lock:
            mine = self.head == index
        if mine:
            if self.hashed < pos:  # became the head after some of its pieces were written
                self._read_back(index, self.hashed, pos)
            self.digest.update(data)
            self.hashed = pos + len(data)

    def shard_done(self, index: int) -> None:
        """Shard `index` is completely written; if it is the head, finish it and move the head on."""
        with self.lock:
            self.finished[index] = True
            if self.head != index:
                return  # the head's owner will hash it, from the file, when it gets here
        while True:  # this thread owns shard `index`, the head
            raw = self.manifest.raw_size(index)
            if self.hashed < raw:
                self._read_back(index, self.hashed, raw)
            with self.lock:
                self.head = index = index + 1
                self.hashed = 0
                if index >= self.manifest.num_shards or not self.finished[index]:
                    return  # its worker will see that it is the head at its next piece or at its end
            # finished and its worker already gone: this thread owns it too

    @property
    def complete(self) -> bool:
        return self.head == self.manifest.num_shards


def _write_streamed(manifest: Manifest, decoder: ShardDecoder, fd: int, digest: hashlib._Hash, bar: tqdm[Any],
                    threads: int) -> None:
    """Decode every shard into the file at its offset, and hash the payload in order, all in the workers.

    Workers decompress (and un-delta) through a small cache-hot buffer and `pwrite` each piece: no
    shard-sized buffers, whose first touch costs more than the decompression in a VM. The worker holding
    the first not-yet-hashed shard also feeds each piece to the payload hash while it is still in cache
    (`_OrderedHash`); only pieces written ahead of the hash are read back from the page cache.
    """
    hasher = _OrderedHash(manifest, fd, digest)

    def decode(index: int) -> None:
        start = manifest.shard_offset(index)

        def write(offset: int, piece: memoryview) -> None:
            done = 0
            try:
                while done < len(piece):
                    done += os.pwritev(fd, [piece[done:]], offset + done)
            except OSError as e:
                raise CheckpointError("io_error", f"writing the payload: {e.strerror}") from None
            hasher.piece(index, offset - start, piece)

        decoder.decode_to(index, write)
        hasher.shard_done(index)

    results = ordered_map(decode, range(manifest.num_shards), threads=threads, window=2 * threads + 2)
    try:
        for index, fut in results:
            fut.result()
            bar.update(manifest.raw_size(index))
    finally:
        results.close()  # waits for the workers: nothing writes to the file after this
    if not hasher.complete:  # every shard decoded means every shard hashed; guard the bookkeeping anyway
        raise CheckpointError("io_error", f"internal: payload hashed up to shard {hasher.head} of "
                                          f"{manifest.num_shards}")


def reconstruct_payload(manifest: Manifest, shard_reader: ShardReader, out_path: str | os.PathLike[str] | None,
                        *, base_payload: Any = None, threads: int = 2, progress: bool = False) -> str:
    """Rebuild the raw payload into `out_path` (atomically; None = only verify) and return its sha256.

    Raises CheckpointError on the first bad shard, or "payload_hash" if the result is not what was signed
    (for a delta that usually means the wrong base).
    """
    from tqdm import tqdm

    base = open_base(base_payload) if base_payload is not None else None
    out_path = Path(out_path) if out_path is not None else None
    tmp = None
    digest = hashlib.sha256()
    fd = None
    try:
        with tqdm(total=manifest.total_size, unit="B", unit_scale=True, desc=f"unpack step {manifest.step}",
                  file=sys.stderr, disable=not progress, leave=False) as bar:
            if out_path is None:
                for _, raw in iter_payload(manifest, shard_reader, base=base, threads=threads):
                    digest.update(raw)
                    bar.update(len(raw))
            else:
                decoder = ShardDecoder(manifest, shard_reader, base)
                out_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = out_path.with_name(f".{out_path.name}.tmp-{uuid.uuid4().hex[:12]}")
                # The file only gets its real name after the whole-payload hash matched.
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                os.ftruncate(fd, manifest.total_size)
                _write_streamed(manifest, decoder, fd, digest, bar, threads)
                os.close(fd)
                fd = None
        got = digest.hexdigest()
        if got != manifest.sha256:
            raise _hash_mismatch(manifest, got)
        if tmp is not None and out_path is not None:  # tmp is set only when writing out_path
            os.replace(tmp, out_path)
            tmp = None
        return got
    finally:
        if fd is not None:
            os.close(fd)
        if base is not None and base is not base_payload:
            base.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def resolve_base(base: Any, trusted_keys: set[str] | None, workdir: str | os.PathLike[str],
                 *, threads: int = 2, progress: bool = False) -> Any:
    """Turn what a user calls a base into a raw payload (bytes or file path).

    Accepts bytes, a raw payload file (e.g. `model.safetensors` written by unpack), a directory holding
    `model.safetensors`, or a *full* checkpoint directory (verified and reconstructed into `workdir`).
    """
    if base is None or isinstance(base, (bytes, bytearray, memoryview)):
        return base
    path = Path(base)
    if path.is_file():
        return path
    if (path / MANIFEST_NAME).is_file():
        manifest = load_manifest(path)
        verify_manifest(manifest, trusted_keys)
        if manifest.is_delta or manifest.is_adapter:
            raise CheckpointError("base_mismatch", f"base checkpoint {path} is itself a {manifest.encoding}; give "
                                                   f"its unpacked {PAYLOAD_FILE_NAME} or a full checkpoint instead")
        problems = scan_shard_dir(path, manifest)
        if problems:
            raise CheckpointError(problems[0].code, f"base checkpoint {path}: {problems[0].detail}")
        out = Path(workdir) / f"base-step-{manifest.step}.safetensors"
        reconstruct_payload(manifest, DirShardReader(path, manifest), out, threads=threads, progress=progress)
        return out
    if (path / PAYLOAD_FILE_NAME).is_file():
        return path / PAYLOAD_FILE_NAME
    raise CheckpointError("base_mismatch", f"base {path} is neither a checkpoint, a payload file, nor a "
                                           f"directory with {PAYLOAD_FILE_NAME}")


def unpack_checkpoint(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                      trusted_keys: set[str] | None, base: Any = None, previous: Manifest | None = None,
                      threads: int = 2, progress: bool = False) -> Manifest:
    """Verify a checkpoint directory and write its payload as `out_dir/model.safetensors`.

    Only the weights file is written; config.json / tokenizer files of a Hugging Face model are not part
    of a checkpoint and stay wherever the run spec says. `base`: see `resolve_base`.
    `trusted_keys=None` trusts the manifest's own signer (integrity only, not origin).
    """
    manifest = load_manifest(ckpt_dir)
    verify_manifest(manifest, trusted_keys, previous=previous)
    problems = scan_shard_dir(ckpt_dir, manifest)
    if problems:
        raise problems[0]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".base-", dir=out_dir) if manifest.is_delta else None
    try:
        base_payload = resolve_base(base, trusted_keys, work or out_dir, threads=threads, progress=progress)
        reconstruct_payload(manifest, DirShardReader(ckpt_dir, manifest), out_dir / PAYLOAD_FILE_NAME,
                            base_payload=base_payload, threads=threads, progress=progress)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return manifest
