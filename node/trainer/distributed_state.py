"""Sharded trainer snapshots for DistributedTrainer (torch.distributed.checkpoint), beside node.trainer.state.

Layout (the snapshot directory is written under a temporary name by every rank, then renamed by rank 0;
LATEST swapped atomically -- the same STATE_DIR/LATEST + step-NNNNNNNN/ scheme as node.trainer.state, so
the coordinator's rewind-to-a-published-step logic works unchanged):

    STATE_DIR/step-00000012/dcp/            model + optimizer, one .distcp file per rank + .metadata
    STATE_DIR/step-00000012/model/          config.json + tokenizer files (no weights)
    STATE_DIR/step-00000012/rng.safetensors rank 0's torch CPU generator
    STATE_DIR/step-00000012/trainer.json    format FSDP_FORMAT, step, world size, base model dir, pools,
                                            keep-rate history, queued groups

DCP reshards on load: a snapshot written by N ranks resumes on any number of ranks (including 1, with a
one-rank process group). Every rank must see the same STATE_DIR (all ranks are local). DCP's .metadata
is a pickle: these files are written by the coordinator's own ranks into its own storage, never
downloaded; the single-rank Trainer keeps its pickle-free safetensors format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from node.trainer.state import (TrainerStateError, _read_json,
                                latest_snapshot, restore_snapshot_state, write_snapshot)

FSDP_FORMAT = "prime-node/trainer-state/fsdp-v1"


def save(trainer, state_dir: Path) -> Path:
    """Rank 0 (collective: the followers write their shards under the same path)."""
    import torch.distributed as dist

    def write(tmp: Path) -> None:
        trainer.save_shards(tmp / "dcp")  # DistributedTrainer's collective (this module imports none of it)
        (tmp / "model").mkdir()
        trainer.model.config.save_pretrained(str(tmp / "model"))

    return write_snapshot(trainer, state_dir, write, format=FSDP_FORMAT, world_size=dist.get_world_size(),
                          base_model_dir=str(Path(trainer.model_dir).resolve()))


def load(cls, state_dir: Path, cfg, *, lift_pools: bool = True, model_dir: str | Path | None = None,
         **kwargs: Any):
    """Rank 0: the trainer of the latest snapshot. The model is built from `model_dir` (default: the base
    model the run started from, recorded in trainer.json) and then overwritten from dcp/."""

    snap = latest_snapshot(state_dir)
    meta = _read_json(snap / "trainer.json")
    if meta.get("format") != FSDP_FORMAT:
        raise TrainerStateError(f"{snap}: not a sharded (FSDP) trainer state ({meta.get('format')!r}); "
                                "single-rank states resume with Trainer.resume")
    base = Path(model_dir or meta.get("base_model_dir", ""))
    if not (base / "config.json").is_file():
        raise TrainerStateError(f"{snap}: base model directory {base} is gone (pass model_dir=...)")
    kwargs.pop("state_dir", None)
    trainer = cls(base, cfg, state_dir=state_dir, _snapshot=snap, **kwargs)
    return restore_snapshot_state(trainer, snap, meta, cfg, lift_pools=lift_pools)
