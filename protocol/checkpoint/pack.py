"""Packing: payload -> (optional delta against a base) -> shards -> zstd -> signed manifest, streamed.

Memory: the payload is produced one shard at a time straight from the tensors (or source files), so
packing holds the model once (if given as tensors) plus about `threads + 2` shards in flight.
Work split: the calling thread fills each shard and feeds the payload hash (sequential by nature); a
pool of `threads` encodes against the base (XOR or sparse blocks), compresses, hashes and writes shards
(zstd/hashlib/numpy drop the GIL).
Atomicity: everything is written into a hidden temporary directory next to `out_dir`, renamed into
place only after the manifest is on disk; a crash leaves at worst a `.NAME.tmp-*` directory.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..identity import Identity
from .codec import compress_shard_to, xor_into
from .errors import CheckpointError
from .manifest import (ADAPTER_ENCODING, DEFAULT_SHARD_SIZE, DELTA_ENCODINGS, ENCODINGS, FORMAT, MAX_SHARD_SIZE,
                       MAX_SHARDS, MIN_SHARD_SIZE, Manifest, sign_manifest)
from .parallel import BufferPool, ordered_map
from .payload import PayloadLayout, open_layout
from .reconstruct import BasePayload, open_base
from .shard_files import MANIFEST_NAME, SHARDS_DIR, shard_file_name
from .sparse import encode_block, word_size_for

if TYPE_CHECKING:
    from tqdm import tqdm


def _progress_bar(enabled: bool, total: int, desc: str) -> tqdm[Any]:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=not enabled,
                leave=False)


def check_delta_compatible(layout: PayloadLayout, base: BasePayload) -> None:
    """A delta needs the same layout: equal size and a byte-identical safetensors header."""
    if base.size != layout.total_size or base.header() != layout.header:
        raise CheckpointError("delta_layout", "the base payload's tensor layout differs from this step's "
                                              f"({base.size} vs {layout.total_size} bytes or a different "
                                              "header); pack this step with encoding 'full'")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack_checkpoint(source: Any, out_dir: str | os.PathLike[str], *, identity: Identity, step: int, run_id: str,
                    parent: Manifest | None = None, base_payload: Any = None, base_step: int | None = None,
                    shard_size: int = DEFAULT_SHARD_SIZE, level: int = 1, threads: int = 2,
                    progress: bool = False, payload_out: str | os.PathLike[str] | None = None,
                    created_at: int | None = None, encoding: str | None = None,
                    lora: dict[str, Any] | None = None) -> Manifest:
    """Pack `source` (state dict, .safetensors file or HF model dir) as a signed checkpoint in `out_dir`.

    `parent`: the previous published manifest (its hash goes into `parent`; it must be an earlier step of
    the same run). `base_payload` (raw payload bytes or path of step `base_step`; default parent.step)
    is what a delta encoding is taken against. `encoding`: "full", "xor-delta" or "sparse-delta";
    None means "xor-delta" when a base is given, else "full". A layout mismatch with the base raises
    CheckpointError("delta_layout") so the caller can fall back to full. `payload_out`: also write this
    step's raw payload there (the next base). `encoding="lora-adapter"`: `source` is the adapter tensors
    (protocol/checkpoint/adapter.py's names), `base_step` the full step it applies to and `lora` the signed
    {base: that step's manifest hash, rank, alpha}; the payload is packed like a full one's.
    """
    if encoding is None:
        encoding = "xor-delta" if base_payload is not None else "full"
    if encoding not in ENCODINGS:
        raise CheckpointError("unknown_encoding", f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    if (encoding in DELTA_ENCODINGS) != (base_payload is not None):
        raise CheckpointError("base_mismatch", f"encoding {encoding!r} " + (
            "needs base_payload (the base step's raw payload)" if base_payload is None else "takes no base payload"))
    if (encoding == ADAPTER_ENCODING) != (lora is not None):
        raise CheckpointError("base_mismatch", f"encoding {encoding!r} " + (
            "needs lora (the base's manifest hash, rank and alpha)" if lora is None else "takes no lora"))
    if encoding == ADAPTER_ENCODING and (base_step is None or not (0 <= base_step < step)):
        raise CheckpointError("base_mismatch", "a lora-adapter needs base_step, an earlier (full) step")
    out_dir = Path(out_dir)
    if not (MIN_SHARD_SIZE <= shard_size <= MAX_SHARD_SIZE):
        raise CheckpointError("bad_payload", f"shard size must be within {MIN_SHARD_SIZE}..{MAX_SHARD_SIZE}")
    if parent is not None:
        if parent.run_id != run_id:
            raise CheckpointError("run_mismatch", f"parent is from run {parent.run_id!r}, not {run_id!r}")
        if parent.step >= step:
            raise CheckpointError("rollback", f"step {step} does not move forward from parent step {parent.step}")
    if base_payload is not None:
        base_step = parent.step if base_step is None and parent is not None else base_step
        if base_step is None or not (0 <= base_step < step):
            raise CheckpointError("base_mismatch", f"{encoding} needs base_step, an earlier step than this one")
    if out_dir.exists():
        raise CheckpointError("out_exists", f"{out_dir} already exists; refusing to overwrite a checkpoint")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    payload_tmp = None
    payload_file = None
    layout = base = None
    try:
        (tmp / SHARDS_DIR).mkdir(parents=True)
        layout = open_layout(source)
        base = open_base(base_payload) if base_payload is not None else None
        if base is not None:
            check_delta_compatible(layout, base)
        total = layout.total_size
        num_shards = -(-total // shard_size)
        if num_shards > MAX_SHARDS:
            raise CheckpointError("bad_payload", f"{num_shards} shards exceed the limit of {MAX_SHARDS}; "
                                                 "use a larger shard size")
        payload_hash = hashlib.sha256()
        if payload_out is not None:
            payload_tmp = Path(payload_out).with_name(f".{Path(payload_out).name}.tmp-{uuid.uuid4().hex[:12]}")
            payload_file = open(payload_tmp, "wb")

        window = threads + 1
        buffers = BufferPool(min(shard_size, total), window + 1)
        word = word_size_for(layout.dtype)

        def compress_and_write(item: tuple[int, bytearray, int]) -> dict[str, Any]:
            index, buf, size = item
            try:
                data = memoryview(buf)[:size]
                # after the payload hash saw the plain bytes, before compression (a delta step has its base:
                # checked above)
                if base is not None and encoding == "xor-delta":
                    xor_into(data, base.read(index * shard_size, size))
                elif base is not None and encoding == "sparse-delta":
                    data = memoryview(encode_block(data, base.read(index * shard_size, size), word))
                with open(tmp / SHARDS_DIR / shard_file_name(index), "xb") as f:
                    zsize, digest = compress_shard_to(data, level, f)
            finally:
                buffers.release(buf)
            return {"index": index, "size": len(data), "zsize": zsize, "sha256": digest}

        def produce() -> Iterator[tuple[int, bytearray, int]]:
            # Runs in this thread, lazily, as the pool asks for more: fill, hash the plain bytes, hand over.
            for index in range(num_shards):
                offset = index * shard_size
                size = min(shard_size, total - offset)
                buf = buffers.acquire()
                view = memoryview(buf)[:size]
                layout.read_into(offset, view)
                payload_hash.update(view)
                if payload_file is not None:
                    payload_file.write(view)
                yield index, buf, size

        entries = []
        with _progress_bar(progress, total, f"pack step {step}") as bar:
            for _, fut in ordered_map(compress_and_write, produce(), threads=threads, window=window):
                entries.append(fut.result())
                bar.update(entries[-1]["size"])
        if payload_file is not None:
            payload_file.close()
        manifest = sign_manifest(identity, {
            "format": FORMAT, "run_id": run_id, "step": step,
            "parent": parent.canonical_hash() if parent is not None else None,
            "encoding": encoding,
            "base_step": base_step if base is not None or encoding == ADAPTER_ENCODING else None,
            **({"lora": lora} if lora is not None else {}),
            "dtype": layout.dtype, "compression": {"codec": "zstd", "level": level},
            "shard_size": shard_size, "total_size": total, "sha256": payload_hash.hexdigest(),
            "shards": entries, **({"created_at": created_at} if created_at is not None else {}),
        })
        manifest_path = tmp / MANIFEST_NAME
        with open(manifest_path, "xb") as f:
            f.write(manifest.to_json_bytes())
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, out_dir)  # atomic: the checkpoint appears whole or not at all
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise CheckpointError("out_exists", f"{out_dir} appeared while packing; not overwritten") from None
            raise
        _fsync_dir(out_dir.parent)
        if payload_tmp is not None and payload_out is not None:  # payload_tmp is set only for payload_out
            os.replace(payload_tmp, payload_out)
            payload_tmp = None
        return manifest
    finally:
        if payload_file is not None and not payload_file.closed:
            payload_file.close()
        if layout is not None:
            layout.close()
        if base is not None and base is not base_payload:
            base.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if payload_tmp is not None:
            try:
                payload_tmp.unlink()
            except FileNotFoundError:
                pass
