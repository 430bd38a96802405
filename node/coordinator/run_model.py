"""The run's model as the coordinator needs it outside the trainer: where its files are, its tokenizer,
the task that makes prompts and scores answers, and the two numbers every submission is checked against.
Loaded once, before anything else of the coordinator is built."""
from __future__ import annotations

import json
import subprocess
import sys
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
        if cfg.server.engine_process:  # building it takes torch, which this (the API) process never imports
            code = ("import sys, json; from pathlib import Path; from node.trainer.model import build_tiny_model_dir; "
                    "build_tiny_model_dir(Path(sys.argv[1]), **json.loads(sys.argv[2]))")
            subprocess.run([sys.executable, "-c", code, str(model_dir), json.dumps(kwargs)], check=True,
                           stdin=subprocess.DEVNULL)
        else:
            build_tiny_model_dir(model_dir, **kwargs)
    tokenizer = _tokenizer(cfg, model_dir)
    model_config = json.loads((model_dir / "config.json").read_text())
    return RunModel(model_dir=model_dir, tokenizer=tokenizer, task=load_task(cfg.task.name, cfg.task.kwargs),
                    model_config=model_config,
                    vocab_size=int(model_config["vocab_size"]), eos_token_id=int(tokenizer.eos_token_id))


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
