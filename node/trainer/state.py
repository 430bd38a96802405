"""Trainer snapshots: model, optimizer, step, pools, pending groups, RNG -- without pickle.

Layout (each snapshot written to a temp dir, then renamed into place; LATEST swapped atomically):

    STATE_DIR/LATEST                  "step-00000012"
    STATE_DIR/step-00000012/model/    save_pretrained (safetensors) + tokenizer files
    STATE_DIR/step-00000012/optimizer.safetensors   every tensor of the optimizer state
    STATE_DIR/step-00000012/optimizer.json          param groups and which keys are tensors
    STATE_DIR/step-00000012/rng.safetensors         torch CPU generator state
    STATE_DIR/step-00000012/trainer.json            step, pools, keep-rate history, queued groups

The model and optimizer files are the model runner's (node/trainer/runner.py: the layout above is
LocalRunner's, format FORMAT; FSDPRunner writes dcp/ instead, node/trainer/distributed_state.py); the rest is
the Trainer's and is written and read here, for every runner alike.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from node.trainer.buffer import DifficultyPools
from node.trainer.types import Group, Rollout
from protocol.errors import PrimeNodeError

if TYPE_CHECKING:
    from node.trainer.trainer import Trainer

FORMAT = "prime-node/trainer-state/v1"
_SNAPSHOT = re.compile(r"^step-\d{8}$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "tokenizer.model")
MAX_JSON_BYTES = 256 * 1024 * 1024


class TrainerStateError(PrimeNodeError):
    pass


def write_snapshot(trainer: Trainer, state_dir: Path, write_weights: Callable[[Path], None], **meta: Any) -> Path:
    """STATE_DIR/step-NNNNNNNN, written whole or not at all: `write_weights(tmp)` writes the model (into
    tmp/model) and optimizer; then the tokenizer files, the RNG, trainer.json (`meta` first, then step,
    pools, keep-rate history, queued groups), an atomic rename, LATEST, and pruning to `keep_states`."""
    import torch
    from safetensors.torch import save_file

    state_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step_count:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=state_dir))
    try:
        write_weights(tmp)
        (tmp / "model").mkdir(exist_ok=True)
        for f in _TOKENIZER_FILES:
            if (trainer.model_dir / f).is_file():
                shutil.copy2(trainer.model_dir / f, tmp / "model" / f)
        save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        write_json(tmp / "trainer.json", {
            **meta,
            "step": trainer.step_count,
            "pools": trainer.pools.to_json(),
            "keep_history": trainer.keep.to_json(),
            # In stream mode `accumulated` groups live in .grad; they are replayed on resume.
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


@dataclass
class SnapshotState:
    """What every snapshot holds besides weights and optimizer (Trainer.resume applies it)."""

    step: int
    pools: DifficultyPools
    keep_history: Any  # KeepRate.load_json's input
    queued_groups: list[Group]  # already selected and given advantages


def read_snapshot_state(snap: Path, meta: dict, cfg, *, lift_pools: bool) -> SnapshotState:
    """trainer.json's step, pools (thresholds from `cfg`, lifted when asked), keep-rate history and queued
    groups; the RNG is restored here, as the snapshot recorded it."""
    import torch
    from safetensors.torch import load_file

    torch.set_rng_state(load_file(str(snap / "rng.safetensors"))["torch_cpu"])
    step = int(meta["step"])
    pools = DifficultyPools.from_json(meta["pools"])
    pools.easy_threshold = cfg.buffer.easy_threshold
    pools.hard_threshold = cfg.buffer.hard_threshold
    if lift_pools:
        pools.lift(cfg.buffer.easy_fraction, cfg.buffer.hard_fraction, seed=cfg.seed + step)
    try:
        groups = [Group(g["prompt_id"], g["prompt_ids"], [Rollout(**r) for r in g["rollouts"]], g["advantages"])
                  for g in meta["queued_groups"]]
    except (KeyError, TypeError) as e:
        raise TrainerStateError(f"{snap}: queued groups are malformed: {e}") from None
    return SnapshotState(step, pools, meta["keep_history"], groups)


def latest_snapshot(state_dir: Path) -> Path:
    latest = state_dir / "LATEST"
    if not latest.is_file():
        raise TrainerStateError(f"{state_dir} holds no trainer state (no LATEST file)")
    name = latest.read_text().strip()
    if not _SNAPSHOT.match(name):  # never follow a path out of the state directory
        raise TrainerStateError(f"{latest}: {name!r} is not a snapshot name")
    snap = state_dir / name
    if not snap.is_dir():
        raise TrainerStateError(f"{latest} points at {name}, which does not exist")
    return snap


def flatten_optimizer(sd: dict) -> tuple[dict, dict]:
    """torch optimizer state_dict -> (name -> tensor, JSON structure). Scalars stay in JSON."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        state[str(idx)] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
                state[str(idx)][key] = {"tensor": f"{idx}.{key}"}
            else:
                state[str(idx)][key] = {"value": value}
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"state": state, "param_groups": groups}


def unflatten_optimizer(tensors: dict, structure: Any) -> dict:
    try:
        state = {}
        for idx, entry in structure["state"].items():
            state[int(idx)] = {k: tensors[v["tensor"]] if "tensor" in v else v["value"] for k, v in entry.items()}
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in structure["param_groups"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TrainerStateError(f"optimizer state is malformed: {e}") from None
    return {"state": state, "param_groups": groups}


def _group_json(g) -> dict:
    return {"prompt_id": g.prompt_id, "prompt_ids": list(g.prompt_ids), "advantages": list(g.advantages),
            "rollouts": [asdict(r) for r in g.rollouts]}


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, allow_nan=False))


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise TrainerStateError(f"{path} is missing")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise TrainerStateError(f"{path} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TrainerStateError(f"{path} is not valid JSON: {e}") from None


def _write_latest(state_dir: Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".LATEST.", dir=state_dir)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_dir / "LATEST")  # atomic: readers see the old or the new name, never half


def _prune(state_dir: Path, keep: int, current: str) -> None:
    snaps = sorted(p.name for p in state_dir.iterdir() if p.is_dir() and _SNAPSHOT.match(p.name))
    for name in snaps[:-keep] if keep > 0 else []:
        if name != current:
            shutil.rmtree(state_dir / name, ignore_errors=True)
