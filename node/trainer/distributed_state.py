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

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from node.trainer.buffer import DifficultyPools
from node.trainer.state import (_TOKENIZER_FILES, TrainerStateError, _group_json, _prune, _read_json,
                                _write_json, _write_latest, latest_snapshot)
from node.trainer.types import Group, Rollout

FSDP_FORMAT = "prime-node/trainer-state/fsdp-v1"


def save(trainer, state_dir: Path) -> Path:
    """Rank 0 (collective: the followers write their shards under the same path)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from node.trainer.distributed import OP_SAVE

    state_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step_count:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=state_dir))
    try:
        trainer._send(OP_SAVE, text=str(tmp / "dcp"))
        trainer._save_sharded(tmp / "dcp")
        (tmp / "model").mkdir()
        trainer.model.config.save_pretrained(str(tmp / "model"))
        for f in _TOKENIZER_FILES:
            if (trainer.model_dir / f).is_file():
                shutil.copy2(trainer.model_dir / f, tmp / "model" / f)
        save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        _write_json(tmp / "trainer.json", {
            "format": FSDP_FORMAT,
            "step": trainer.step_count,
            "world_size": dist.get_world_size(),
            "base_model_dir": str(Path(trainer.model_dir).resolve()),
            "pools": trainer.pools.to_json(),
            "keep_history": trainer.keep.to_json(),
            "queued_groups": [_group_json(g) for g in trainer.accumulated + trainer.pending],
        })
        final = state_dir / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(state_dir, name)
    _prune(state_dir, keep=trainer.cfg.keep_states, current=name)
    return final


def load(cls, state_dir: Path, cfg, *, lift_pools: bool = True, model_dir: str | Path | None = None,
         **kwargs: Any):
    """Rank 0: the trainer of the latest snapshot. The model is built from `model_dir` (default: the base
    model the run started from, recorded in trainer.json) and then overwritten from dcp/."""
    import torch
    from safetensors.torch import load_file

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
    torch.set_rng_state(load_file(str(snap / "rng.safetensors"))["torch_cpu"])
    trainer.step_count = int(meta["step"])
    trainer.pools = DifficultyPools.from_json(meta["pools"])
    trainer.pools.easy_threshold = cfg.buffer.easy_threshold
    trainer.pools.hard_threshold = cfg.buffer.hard_threshold
    if lift_pools:
        trainer.pools.lift(cfg.buffer.easy_fraction, cfg.buffer.hard_fraction, seed=cfg.seed + trainer.step_count)
    trainer.keep.load_json(meta["keep_history"])
    try:
        groups = [Group(g["prompt_id"], g["prompt_ids"], [Rollout(**r) for r in g["rollouts"]], g["advantages"])
                  for g in meta["queued_groups"]]
    except (KeyError, TypeError) as e:
        raise TrainerStateError(f"{snap}: queued groups are malformed: {e}") from None
    for g in groups:  # stream mode replays their forward/backward on every rank
        trainer._enqueue(g)
    return trainer
