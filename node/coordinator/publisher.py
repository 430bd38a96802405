"""Publishes each new policy as a signed checkpoint and prunes old ones.

Layout under storage.dir:
    checkpoints/{step}/manifest.json + shards/NNNNN.zst     what nodes download
    payloads/{step}.safetensors                             raw payloads of the window (delta bases,
                                                            and the weights verification replays)
Step 0 and every `full_every` steps are `full`; the rest are xor-delta against the previous step.
Pruning keeps the last k + 1 steps plus the delta chain back to the newest full checkpoint at or
before the window's start, so a node that holds nothing can always rebuild the newest step.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from protocol.identity import Identity


def checkpoint_listing(manifests) -> list[dict]:
    """The `checkpoints` array of GET /v1/checkpoints, from (step, Manifest) pairs."""
    return [{"step": s, "encoding": m.encoding, "base_step": m.base_step, "num_shards": m.num_shards,
             "total_size": m.total_size, "compressed_size": m.compressed_size,
             "manifest_hash": m.canonical_hash()} for s, m in manifests]


@dataclass
class Published:
    step: int
    manifest_hash: str
    encoding: str
    base_step: int | None
    compressed_bytes: int


class Publisher:
    def __init__(self, root: Path, identity: Identity, run_id: str, *, async_level: int, shard_size: int,
                 level: int, full_every: int):
        self.root = Path(root)
        self.ckpt_dir = self.root / "checkpoints"
        self.payload_dir = self.root / "payloads"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.payload_dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.run_id = run_id
        self.k = async_level
        self.shard_size = shard_size
        self.level = level
        self.full_every = full_every
        self._manifests: dict[int, dict] = {}

    # -- reading -----------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(int(p.name) for p in self.ckpt_dir.iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file())

    def manifest(self, step: int):
        from protocol.checkpoint import Manifest

        if step not in self._manifests:
            path = self.ckpt_dir / str(step) / "manifest.json"
            self._manifests[step] = Manifest.from_json_bytes(path.read_bytes())
        return self._manifests[step]

    def manifest_bytes(self, step: int) -> bytes | None:
        path = self.ckpt_dir / str(int(step)) / "manifest.json"
        return path.read_bytes() if path.is_file() else None

    def payload_path(self, step: int) -> Path:
        return self.payload_dir / f"{int(step)}.safetensors"

    def listing(self) -> list[dict]:
        return checkpoint_listing((s, self.manifest(s)) for s in self.steps())

    # -- writing -----------------------------------------------------------------------------------
    def publish(self, step: int, state) -> Published:
        """Pack `state` as `step`: full at step 0 / every `full_every`, else xor-delta vs step - 1."""
        from protocol.checkpoint import CheckpointError, pack_checkpoint

        prev = step - 1
        parent = self.manifest(prev) if prev in self.steps() else None
        delta = step % self.full_every != 0 and parent is not None and self.payload_path(prev).is_file()
        out = self.ckpt_dir / str(step)
        if out.exists():  # a half-published step from before a crash: the ledger never recorded it
            shutil.rmtree(out)
        common = dict(identity=self.identity, step=step, run_id=self.run_id, parent=parent,
                      shard_size=self.shard_size, level=self.level, payload_out=self.payload_path(step))
        try:
            manifest = pack_checkpoint(state, out, base_payload=self.payload_path(prev) if delta else None,
                                       base_step=prev if delta else None, **common)
        except CheckpointError as e:
            if e.code != "delta_layout":
                raise
            manifest = pack_checkpoint(state, out, **common)  # the tensor layout changed: send it whole
        self._manifests[step] = manifest
        return Published(step, manifest.canonical_hash(), manifest.encoding, manifest.base_step,
                         manifest.compressed_size)

    def discard_after(self, step: int) -> None:
        """Remove anything newer than the ledger's last published step (a crash mid-publish)."""
        for s in self.steps():
            if s > step:
                shutil.rmtree(self.ckpt_dir / str(s), ignore_errors=True)
                self._manifests.pop(s, None)
        for p in self.payload_dir.glob("*"):
            stem = p.name.split(".")[0]
            if not stem.isdigit() or int(stem) > step or p.suffix == ".tmp":
                p.unlink(missing_ok=True)

    def prune(self, current: int) -> list[int]:
        """Keep the last k+1 steps and the delta chain back to a full checkpoint. Returns removed."""
        steps = self.steps()
        window_start = max(0, current - self.k)
        keep_from = window_start
        for s in sorted((s for s in steps if s <= window_start), reverse=True):
            keep_from = s
            if self.manifest(s).encoding == "full":
                break
        removed = []
        for s in steps:
            if s < keep_from:
                shutil.rmtree(self.ckpt_dir / str(s), ignore_errors=True)
                self._manifests.pop(s, None)
                removed.append(s)
        for p in self.payload_dir.glob("*.safetensors"):
            if int(p.stem) < window_start:
                p.unlink(missing_ok=True)
        return removed
