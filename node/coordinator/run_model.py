"""The run's model as the coordinator needs it outside the trainer: where its files are, its tokenizer,
the task that makes prompts and scores answers, and the two numbers every submission is checked against.
Loaded once, before anything else of the coordinator is built."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import Config
from node.envs import Task, load_task
from node.real_model import resolve_model_path
from node.trainer.light_tokenizer import UnsupportedTokenizer, load_light_tokenizer
from node.trainer.model import build_tiny_model_dir
from node.trainer.model_dir import ModelLoadError
from node.trainer.tokenizer import load_tokenizer


@dataclass(frozen=True)
class RunModel:
    model_dir: Path
    tokenizer: object  # a transformers tokenizer, or a LightTokenizer with server.engine_process
    task: Task
    model_config: dict  # config.json, sent to nodes in the join response
    vocab_size: int
    eos_token_id: int


def load_run_model(cfg: Config, storage: Path) -> RunModel:
    """`model.path`, or the tiny demo model built once under the storage directory from `run.seed`."""
    model_dir = Path(resolve_model_path(cfg.model.path)) if cfg.model.path else storage / "model"
    if not cfg.model.path and not (model_dir / "config.json").is_file():
        m = cfg.model
        kwargs: dict[str, Any] = dict(hidden_size=m.tiny_hidden_size, layers=m.tiny_layers, heads=m.tiny_heads, seed=cfg.run.seed)
        cache = os.environ.get(TINY_CACHE_ENV)
        if not cache:
            _build_tiny(model_dir, kwargs, in_child=cfg.server.engine_process)
        else:
            shutil.copytree(_cached_tiny(Path(cache), kwargs, in_child=cfg.server.engine_process), model_dir,
                            dirs_exist_ok=True)
    tokenizer = _tokenizer(cfg, model_dir)
    model_config = json.loads((model_dir / "config.json").read_text())
    return RunModel(model_dir=model_dir, tokenizer=tokenizer, task=load_task(cfg.task.name, cfg.task.kwargs),
                    model_config=model_config,
                    vocab_size=int(model_config["vocab_size"]), eos_token_id=int(tokenizer.eos_token_id))


# Set (to a directory): tiny models are built once per set of arguments and code there, then copied. The test
# suite sets it (tests/conftest.py): the engine-process layout builds its tiny model in a child Python that
# imports torch and transformers, ~4-5 s on 2 loaded cores, for every fresh storage directory. Unset: built
# in place, once per storage directory (the weights are deterministic in the arguments, so a copy is the same).
TINY_CACHE_ENV = "PRIME_NODE_TINY_MODEL_CACHE"
_TINY_SOURCES = ("node/trainer/model.py", "node/trainer/tokenizer.py")  # what writes the directory: in the key


def _build_tiny(model_dir: Path, kwargs: dict[str, Any], *, in_child: bool) -> None:
    if in_child:  # building it takes torch, which the API process of server.engine_process never imports
        code = ("import sys, json; from pathlib import Path; from node.trainer.model import build_tiny_model_dir; "
                "build_tiny_model_dir(Path(sys.argv[1]), **json.loads(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, str(model_dir), json.dumps(kwargs)], check=True,
                       stdin=subprocess.DEVNULL)
    else:
        build_tiny_model_dir(model_dir, **kwargs)


def _cached_tiny(cache: Path, kwargs: dict[str, Any], *, in_child: bool) -> Path:
    """The cache's directory for `kwargs`, built first if absent. Keyed by the arguments, the source of the
    code that writes it and the torch / transformers versions; a build goes to a private directory renamed
    into place (a directory under its key is complete; two processes building at once both succeed)."""
    h = hashlib.sha256(json.dumps(kwargs, sort_keys=True).encode())
    repo = Path(__file__).resolve().parents[2]
    for name in _TINY_SOURCES:
        h.update((repo / name).read_bytes())
    for dist in ("torch", "transformers"):
        h.update(importlib.metadata.version(dist).encode())
    done = cache / h.hexdigest()[:24]
    if not (done / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
        try:
            _build_tiny(part / "model", kwargs, in_child=in_child)
            os.rename(part / "model", done)
        except OSError:
            if not (done / "config.json").is_file():  # not another process's build that won the rename
                raise
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return done


def _tokenizer(cfg: Config, model_dir: Path):
    """transformers' tokenizer, or with server.engine_process one loaded without transformers: transformers 5
    imports torch to load any tokenizer, and that layout's API process never imports torch. Both of its processes
    load this same one, so the prompts the API hands out and the engine's evaluation and warm start agree.
    A directory the light tokenizer cannot load exactly as transformers does is refused rather than loaded
    through transformers with a warning: the layout's promise (no torch in the API process: its memory, its
    start-up, nothing of torch's threads beside the requests) would be broken without anyone noticing."""
    if not cfg.server.engine_process:
        return load_tokenizer(model_dir)
    try:
        return load_light_tokenizer(model_dir)
    except UnsupportedTokenizer as e:
        raise ModelLoadError(f"{e}; the API process of server.engine_process = true loads its tokenizer without "
                             "transformers (docs/ARCHITECTURE.md, \"Processes\"): run this model with "
                             "server.engine_process = false") from None
