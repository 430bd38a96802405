"""Sharded trainer snapshots for FSDPRunner (torch.distributed.checkpoint), beside node.trainer.state.

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
downloaded; the LocalRunner keeps its pickle-free safetensors format (node/trainer/state.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from node.trainer.state import TrainerStateError

FSDP_FORMAT = "prime-node/trainer-state/fsdp-v1"


def base_model_dir(snap: Path, meta: dict[str, Any], model_dir: str | Path | None) -> Path:
    """The model directory a resume from the sharded snapshot `snap` builds its model from (then overwritten
    from dcp/): `model_dir`, default the base model the run started from (recorded in trainer.json)."""
    if meta.get("format") != FSDP_FORMAT:
        raise TrainerStateError(f"{snap}: not a sharded (FSDP) trainer state ({meta.get('format')!r}); "
                                "single-rank states resume on the LocalRunner (trainer.ranks = 1)")
    base = Path(model_dir or meta.get("base_model_dir", ""))
    if not (base / "config.json").is_file():
        raise TrainerStateError(f"{snap}: base model directory {base} is gone (pass model_dir=...)")
    return base
