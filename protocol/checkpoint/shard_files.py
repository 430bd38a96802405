"""Where shards live on disk and on the wire, without letting a name escape the checkpoint.

On disk a shard is exactly `CKPT/shards/NNNNN.zst`. Files are opened with O_NOFOLLOW and must be regular
files, so a symlink planted in `shards/` cannot point the reader (or a server using these helpers) at
anything outside. HTTP servers turn the `{index}` path segment into an int with `parse_shard_index`,
which accepts digits only ("../x", "/etc/passwd", "1e3", "-1" are refused).
"""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from .errors import CheckpointError
from .manifest import MAX_MANIFEST_BYTES, MAX_SHARDS, Manifest

MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
SHARD_NAME_RE = re.compile(r"^[0-9]{5}\.zst$")
_INDEX_RE = re.compile(r"^[0-9]{1,5}$")


def shard_file_name(index: int) -> str:
    if not (0 <= index < MAX_SHARDS):
        raise CheckpointError("shard_index", f"shard index {index} out of range")
    return f"{index:05d}.zst"


def shard_relpath(index: int) -> str:
    return f"{SHARDS_DIR}/{shard_file_name(index)}"


def parse_shard_index(text: str, num_shards: int | None = None) -> int:
    """Shard index from an untrusted string (URL segment or file name stem): decimal digits only."""
    if not isinstance(text, str) or not _INDEX_RE.match(text):
        raise CheckpointError("bad_shard_name", f"shard name {str(text)[:40]!r} is not a shard index")
    index = int(text)
    if num_shards is not None and index >= num_shards:
        raise CheckpointError("shard_index", f"shard {index} does not exist (there are {num_shards})")
    return index


def _open_regular(path: Path, *, what: str, missing_code: str, shard: int | None) -> int:
    """fd of a regular file that is not a symlink (O_NOFOLLOW), or a CheckpointError saying why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(missing_code, f"{what} is missing", shard=shard) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError("bad_shard_name", f"{what} is a symlink (refused)", shard=shard) from None
        raise CheckpointError("io_error", f"{what}: {e.strerror}", shard=shard) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError("bad_shard_name", f"{what} is not a regular file", shard=shard)
    return fd


def _too_large(what: str, limit: int, shard: int | None) -> CheckpointError:
    return CheckpointError("shard_size" if shard is not None else "manifest_too_large",
                           f"{what} is larger than the {limit} bytes allowed", shard=shard)


def read_regular_file(path: Path, limit: int, *, what: str, missing_code: str = "missing_shard",
                      shard: int | None = None) -> bytes:
    """Read at most `limit` bytes of a regular, non-symlink file; more than `limit` is an error."""
    fd = _open_regular(path, what=what, missing_code=missing_code, shard=shard)
    try:
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 64 * 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > limit:
        raise _too_large(what, limit, shard)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_regular_file_into(path: Path, buf: bytearray, limit: int, *, what: str,
                           shard: int | None = None) -> memoryview:
    """Like `read_regular_file`, into `buf` (len >= limit + 1); returns the filled slice."""
    fd = _open_regular(path, what=what, missing_code="missing_shard", shard=shard)
    view, total = memoryview(buf), 0
    try:
        while total <= limit:
            n = os.readv(fd, [view[total:limit + 1]])
            if n == 0:
                break
            total += n
    finally:
        os.close(fd)
    if total > limit:
        raise _too_large(what, limit, shard)
    return view[:total]


def _check_shards_dir(ckpt_dir: Path) -> Path:
    shards = ckpt_dir / SHARDS_DIR
    try:
        st = os.lstat(shards)
    except FileNotFoundError:
        raise CheckpointError("missing_shard", f"{shards} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError("bad_shard_name", f"{shards} is not a plain directory (symlink refused)")
    return shards


def read_manifest_bytes(ckpt_dir: str | os.PathLike[str]) -> bytes:
    return read_regular_file(Path(ckpt_dir) / MANIFEST_NAME, MAX_MANIFEST_BYTES,
                             what=f"{Path(ckpt_dir) / MANIFEST_NAME}", missing_code="missing_manifest")


def load_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """Parse (not verify) the manifest of a checkpoint directory; a path to a manifest file also works."""
    path = Path(ckpt_dir)
    if path.is_file():
        return Manifest.from_json_bytes(read_regular_file(path, MAX_MANIFEST_BYTES, what=str(path),
                                                          missing_code="manifest_schema"))
    return Manifest.from_json_bytes(read_manifest_bytes(path))


def scan_shard_dir(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> list[CheckpointError]:
    """Every naming problem in `shards/`: stray names, symlinks, extra and missing shard files."""
    try:
        shards = _check_shards_dir(Path(ckpt_dir))
    except CheckpointError as e:
        return [e]
    problems: list[CheckpointError] = []
    present: set[int] = set()
    for entry in sorted(os.scandir(shards), key=lambda e: e.name):
        shown = f"{SHARDS_DIR}/{entry.name!r}"
        if not SHARD_NAME_RE.match(entry.name):
            problems.append(CheckpointError("bad_shard_name", f"{shown} is not a shard name (NNNNN.zst)"))
            continue
        index = int(entry.name[:5])
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            problems.append(CheckpointError("bad_shard_name", f"shard {index}: {shown} is a symlink or not a "
                                                              "regular file (refused)", shard=index))
        elif index >= manifest.num_shards:
            problems.append(CheckpointError("extra_shard", f"shard {index}: {shown} is not in the manifest "
                                                           f"({manifest.num_shards} shards)", shard=index))
        present.add(index)
    for index in range(manifest.num_shards):
        if index not in present:
            problems.append(CheckpointError("missing_shard", f"shard {index}: {shard_relpath(index)} is missing",
                                            shard=index))
    return problems


class DirShardReader:
    """`reader(i) -> compressed bytes` for a checkpoint directory. Thread-safe (no shared state)."""

    def __init__(self, ckpt_dir: str | os.PathLike[str], manifest: Manifest):
        self.ckpt_dir = Path(ckpt_dir)
        self.manifest = manifest
        self.shards_dir = _check_shards_dir(self.ckpt_dir)

    def __call__(self, index: int) -> bytes:
        entry = self.manifest.shards[index]
        return read_regular_file(self.shards_dir / shard_file_name(index), entry.zsize,
                                 what=f"shard {index} ({shard_relpath(index)})", shard=index)

    def read_into(self, index: int, buf: bytearray) -> memoryview:
        """The shard's bytes read into `buf` (at least zsize + 1 long): no allocation per shard."""
        entry = self.manifest.shards[index]
        return read_regular_file_into(self.shards_dir / shard_file_name(index), buf, entry.zsize,
                                      what=f"shard {index} ({shard_relpath(index)})", shard=index)
