"""Where served shards come from: a callable, or a checkpoint directory tree.

Nothing from the network becomes a path: the server only hands us two validated ints (step,
index) and we format the file name ourselves (`<root>/<step>/shards/NNNNN.zst`, docs/PROTOCOL.md, "Layout"), then
check that the resolved file still lies under the root (a symlink cannot lead outside).
"""
from __future__ import annotations

import io
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol, Union

from node.checkpoint_dir import PARTIAL_PREFIX
from protocol.checkpoint import MANIFEST_NAME, MAX_MANIFEST_BYTES, SHARDS_DIR, manifest_hash, shard_file_name
from protocol.signing import strict_json_loads

__all__ = ["ShardBody", "BytesBody", "FileBody", "ShardStore", "CallableShardStore", "DirectoryShardStore",
           "CheckpointShards", "as_store", "manifest_hash"]


class ShardBody(Protocol):
    @property
    def size(self) -> int: ...

    def chunks(self, chunk_size: int) -> Iterator[bytes]: ...

    def close(self) -> None: ...


@dataclass
class BytesBody:
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def chunks(self, chunk_size: int) -> Iterator[bytes]:
        view = memoryview(self.data)
        for start in range(0, len(view), chunk_size):
            yield bytes(view[start:start + chunk_size])

    def close(self) -> None:
        pass


class FileBody:
    """An open shard file; read chunk by chunk so N concurrent transfers do not hold N shards in RAM."""
    def __init__(self, f: io.BufferedReader, size: int):
        self._f = f
        self.size = size

    def chunks(self, chunk_size: int) -> Iterator[bytes]:
        remaining = self.size
        while remaining > 0:
            data = self._f.read(min(chunk_size, remaining))
            if not data:
                raise OSError("shard file shrank while being served")
            remaining -= len(data)
            yield data

    def close(self) -> None:
        self._f.close()


class ShardStore(Protocol):
    def open(self, step: int, index: int, manifest_hash: str | None) -> ShardBody | None:
        """The shard, or None if not held (or held for a different manifest than `manifest_hash`)."""
        ...


# Optional on a ShardStore: `held(step, manifest_hash) -> set[int]`, the shards `open` would serve now (the
# HTTP shard server tells them to each requester). Stores without it tell nothing.


ShardGetter = Callable[[int, int], Union[bytes, None]]


class CallableShardStore:
    """Wrap `(step, index) -> bytes | None` (tests and embedders serving bytes they have in memory). It
    cannot check a manifest hash, so it ignores one: a node serves its shards with `CheckpointShards`."""
    def __init__(self, getter: ShardGetter):
        self._getter = getter

    def open(self, step: int, index: int, manifest_hash: str | None) -> ShardBody | None:
        data = self._getter(step, index)
        return None if data is None else BytesBody(bytes(data))


class DirectoryShardStore:
    """Serve `<root>/<step>/shards/NNNNN.zst`; `<root>/<step>/manifest.json` answers manifest-hash checks."""
    def __init__(self, root: str | os.PathLike, *, step_dir: Callable[[int], str] = str):
        self.root = Path(root).resolve()
        self._step_dir = step_dir
        self._hash_cache: dict[Path, tuple[tuple[int, int], str]] = {}

    def _inside(self, path: Path) -> Path | None:
        resolved = path.resolve()
        return resolved if resolved.is_relative_to(self.root) else None

    def shard_path(self, step: int, index: int) -> Path:
        if not (isinstance(step, int) and isinstance(index, int) and step >= 0 and 0 <= index <= 99_999):
            raise ValueError("step and index must be non-negative ints (index ≤ 99999)")
        return self.root / self._step_dir(step) / SHARDS_DIR / shard_file_name(index)

    def _manifest_hash(self, step: int) -> str | None:
        path = self._inside(self.root / self._step_dir(step) / MANIFEST_NAME)
        if path is None:
            return None
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size)
            cached = self._hash_cache.get(path)
            if cached and cached[0] == key:
                return cached[1]
            if st.st_size > MAX_MANIFEST_BYTES:
                return None
            digest = manifest_hash(strict_json_loads(path.read_bytes()))
        except (OSError, ValueError, AttributeError):
            return None
        if len(self._hash_cache) > 64:  # a handful of live steps; never grows with the network
            self._hash_cache.clear()
        self._hash_cache[path] = (key, digest)
        return digest

    def held(self, step: int, manifest_hash: str) -> set[int]:
        """The shard files present for `step` of `manifest_hash` (only verified shards get their final name)."""
        if self._manifest_hash(step) != manifest_hash:
            return set()
        held = set()
        try:
            with os.scandir(self.root / self._step_dir(step) / SHARDS_DIR) as entries:
                for e in entries:
                    index = _shard_index(e.name)
                    if index is not None:
                        held.add(index)
        except OSError:
            pass
        return held

    def open(self, step: int, index: int, manifest_hash: str | None) -> ShardBody | None:
        path = self._inside(self.shard_path(step, index))
        if path is None:
            return None
        if manifest_hash is not None and self._manifest_hash(step) != manifest_hash:
            return None
        try:
            f = open(path, "rb")
        except OSError:
            return None
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            f.close()
            return None
        return FileBody(f, st.st_size)


_SHARD_NAME = re.compile(r"([0-9]{5})\.zst")  # shard_file_name's form; not .part, .tmp or strays


def _shard_index(name: str) -> int | None:
    m = _SHARD_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


class CheckpointShards:
    """A node's checkpoint directory (node/checkpoint_dir.py) as a peer shard store: the shards of its
    complete steps, then the verified shards of a step still downloading. Streaming reads, the manifest
    hash checked, no path from the network (both parts are `DirectoryShardStore`s)."""
    def __init__(self, ckpt_dir: str | os.PathLike):
        self._stores = (DirectoryShardStore(ckpt_dir),
                        DirectoryShardStore(ckpt_dir, step_dir=lambda step: f"{PARTIAL_PREFIX}{step}"))

    def open(self, step: int, index: int, manifest_hash: str | None) -> ShardBody | None:
        for store in self._stores:
            body = store.open(step, index, manifest_hash)
            if body is not None:
                return body
        return None

    def held(self, step: int, manifest_hash: str) -> set[int]:
        return set().union(*(store.held(step, manifest_hash) for store in self._stores))

    def arriving(self, step: int, manifest_hash: str) -> bool:
        """Whether this node is downloading `step` of `manifest_hash` now (its partial step has that manifest):
        a shard of it not here yet may be a moment away."""
        return self._stores[1]._manifest_hash(step) == manifest_hash


def as_store(source: ShardStore | ShardGetter | str | os.PathLike | None) -> ShardStore | None:
    """Accept a ShardStore, a `(step, index) -> bytes | None` callable, or a directory."""
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        return DirectoryShardStore(source)
    if hasattr(source, "open"):
        return source
    if callable(source):
        return CallableShardStore(source)
    raise TypeError(f"not a shard store: {type(source).__name__}")
