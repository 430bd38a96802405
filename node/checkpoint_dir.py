"""The on-disk layout of checkpoints, the one place it is written down. Every role that holds
checkpoints uses it: the coordinator's publisher, a worker's fetcher, a relay, and the peer shard store.

    ROOT/checkpoints/{step}/manifest.json        a complete, verified (or self-published) checkpoint
    ROOT/checkpoints/{step}/shards/NNNNN.zst     (docs/PROTOCOL.md, "Layout")
    ROOT/checkpoints/.partial-{step}/            a download in progress: verified shards + *.part
    ROOT/payloads/{step}.safetensors             the reconstructed weights (the next delta's base)
    ROOT/payloads/{step}.adapter.safetensors     a LoRA adapter step rebuilt but not merged (a store opened with
                                                 `unmerged_adapters`: a worker serving adapters unmerged)

A step becomes visible only by an atomic rename (`commit`), so a reader sees a whole checkpoint or
none. Paths are built here from integers only; nothing a client sends becomes a path.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from protocol.checkpoint import MANIFEST_NAME, SHARDS_DIR, Manifest, shard_file_name

PARTIAL_PREFIX = ".partial-"


def checkpoint_listing(manifests) -> list[dict]:
    """The `checkpoints` array of GET /v1/checkpoints, from (step, Manifest) pairs."""
    return [{"step": s, "encoding": m.encoding, "base_step": m.base_step, "num_shards": m.num_shards,
             "total_size": m.total_size, "compressed_size": m.compressed_size,
             "manifest_hash": m.canonical_hash()} for s, m in manifests]


class CheckpointDir:
    def __init__(self, root: str | Path, *, unmerged_adapters: bool = False):
        self.root = Path(root)
        # A worker with `worker.lora_serving = "adapter"` hands an adapter step's own tensors to its engine: the
        # store then holds that step as the rebuilt adapter (a few MB), never merged into a full model (~1 s and a
        # full model's disk per step for SmolLM2, docs/BENCHMARKS.md), and counts it as held.
        self.unmerged_adapters = unmerged_adapters
        self.ckpt_dir = self.root / "checkpoints"
        self.payload_dir = self.root / "payloads"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.payload_dir.mkdir(parents=True, exist_ok=True)
        self._manifests: dict[int, Manifest] = {}

    # -- paths -------------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.ckpt_dir / str(int(step))

    def manifest_path(self, step: int) -> Path:
        return self.step_dir(step) / MANIFEST_NAME

    def shard_path(self, step: int, index: int) -> Path:
        return self.step_dir(step) / SHARDS_DIR / shard_file_name(int(index))

    def payload_path(self, step: int) -> Path:
        return self.payload_dir / f"{int(step)}.safetensors"

    def adapter_payload_path(self, step: int) -> Path:
        return self.payload_dir / f"{int(step)}.adapter.safetensors"

    def weights_path(self, step: int) -> Path:
        """The file a held step's weights are in: its full payload, or (a store with `unmerged_adapters`) the
        rebuilt adapter of an adapter step that has none."""
        full = self.payload_path(step)
        if self.unmerged_adapters and not full.is_file() and self.adapter_payload_path(step).is_file():
            return self.adapter_payload_path(step)
        return full

    def partial_dir(self, step: int) -> Path:
        return self.ckpt_dir / f"{PARTIAL_PREFIX}{int(step)}"

    def partial_shard_path(self, step: int, index: int) -> Path:
        return self.partial_dir(step) / SHARDS_DIR / shard_file_name(int(index))

    # -- reading -----------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps whose checkpoint is complete (its manifest is in place)."""
        return sorted(int(p.name) for p in self.ckpt_dir.iterdir()
                      if p.name.isdigit() and (p / MANIFEST_NAME).is_file())

    def held_steps(self) -> list[int]:
        """Complete steps whose weights were rebuilt too (what a node can generate with or build on). An adapter
        held unmerged counts only in a store opened with `unmerged_adapters`: a worker restarted in the merged mode
        fetches such a step again rather than load an adapter as a full model."""
        return [s for s in self.steps() if self.weights_path(s).is_file()]

    def manifest(self, step: int) -> Manifest | None:
        if step not in self._manifests:
            path = self.manifest_path(step)
            if not path.is_file():
                return None
            self._manifests[step] = Manifest.from_json_bytes(path.read_bytes())
        return self._manifests[step]

    def manifest_bytes(self, step: int) -> bytes | None:
        path = self.manifest_path(step)
        return path.read_bytes() if path.is_file() else None

    def listing(self, steps: list[int] | None = None) -> list[dict]:
        return checkpoint_listing((s, self.manifest(s)) for s in (self.steps() if steps is None else steps))

    def chain_to_full(self, step: int, available: set[int]) -> list[int]:
        """`step` and the xor-delta bases it needs, back to a full checkpoint (or to the first base that
        is not in `available`), newest first."""
        chain = [step]
        m = self.manifest(step)
        while m is not None and m.encoding != "full" and m.base_step in available:
            chain.append(m.base_step)
            m = self.manifest(m.base_step)
        return chain

    def adapter_bases(self, steps) -> set[int]:
        """The full steps whose payloads the LoRA adapters among `steps` merge into: a pruner keeps those payloads
        beside the steps' own (the publisher's and the fetcher's prune)."""
        return {m.base_step for s in steps
                if (m := self.manifest(s)) is not None and m.is_adapter and m.base_step is not None}

    # -- writing -----------------------------------------------------------------------------------
    def begin(self, step: int, manifest: Manifest) -> Path:
        """A partial directory for downloading `step`, holding its manifest (kept across restarts)."""
        partial = self.partial_dir(step)
        (partial / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        (partial / MANIFEST_NAME).write_bytes(manifest.to_json_bytes())
        return partial

    def commit(self, step: int, manifest: Manifest, payload_tmp: Path, *, unmerged_adapter: bool = False) -> None:
        """Make a finished download visible: the payload first, then the checkpoint (atomic renames).
        `unmerged_adapter`: `payload_tmp` is an adapter step's rebuilt adapter, kept as such."""
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(payload_tmp, self.adapter_payload_path(step) if unmerged_adapter else self.payload_path(step))
        os.replace(self.partial_dir(step), final)
        self._manifests[step] = manifest

    def published(self, step: int, manifest: Manifest) -> None:
        """A checkpoint packed in place (the publisher) is complete."""
        self._manifests[step] = manifest

    def remove(self, step: int) -> None:
        shutil.rmtree(self.step_dir(step), ignore_errors=True)
        self.payload_path(step).unlink(missing_ok=True)
        self.adapter_payload_path(step).unlink(missing_ok=True)
        self._manifests.pop(step, None)

    def discard_after(self, step: int) -> None:
        """Remove every checkpoint, payload and temporary file newer than `step` (after a crash that the
        ledger never recorded)."""
        for s in self.steps():
            if s > step:
                self.remove(s)
        for p in self.payload_dir.iterdir():
            stem = p.name.split(".")[0]
            if not stem.isdigit() or int(stem) > step or p.suffix == ".tmp":
                p.unlink(missing_ok=True)

    def prune(self, keep: set[int], keep_payloads: set[int] | None = None) -> list[int]:
        """Remove every complete step not in `keep` and every payload not in `keep_payloads` (default:
        `keep`), and partial downloads no newer than the newest step kept. Returns the steps removed."""
        keep_payloads = keep if keep_payloads is None else keep_payloads
        removed = [s for s in self.steps() if s not in keep]
        for s in removed:
            self.remove(s)
        for p in self.payload_dir.glob("*.safetensors"):  # {step}.safetensors and {step}.adapter.safetensors
            stem = p.name.split(".")[0]
            if stem.isdigit() and int(stem) not in keep_payloads:
                p.unlink(missing_ok=True)
        newest = max(keep, default=-1)
        for p in self.ckpt_dir.glob(f"{PARTIAL_PREFIX}*"):
            suffix = p.name[len(PARTIAL_PREFIX):]
            if not suffix.isdigit() or int(suffix) <= newest:
                shutil.rmtree(p, ignore_errors=True)
        return removed
