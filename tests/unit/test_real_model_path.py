"""model.path = "real:<name>" (node/real_model.py resolve_model_path) and configs/real.toml, the real-model demo's
config, without the model itself (tests/real/ builds and uses it)."""
from __future__ import annotations

from pathlib import Path

import pytest

from node.config import load_config
from node.envs import load_task
from node.real_model import RealModelError, resolve_model_path

REAL_TOML = Path(__file__).resolve().parents[2] / "configs" / "real.toml"


def test_plain_paths_pass_through_and_unknown_real_names_are_clear_errors(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(RealModelError, match="unknown real model.*real:smollm2-135m"):
        resolve_model_path("real:gpt-5")


def test_real_demo_config_loads_and_names_a_real_model_and_a_task_that_exists():
    cfg = load_config(REAL_TOML)
    assert cfg.model.path == "real:smollm2-135m"
    task = load_task(cfg.task.name, cfg.task.kwargs)
    p = task.sample(cfg.run.seed, 0)
    assert task.score(p, p.answer) == 1.0 and p.system
    assert cfg.trainer.warm_start_steps == 0  # the demo shows RL alone
    assert cfg.eval.every_steps > 0  # the demo's curve has held-out eval points
