"""The tiny-model cache (node/coordinator/run_model.py, TINY_CACHE_ENV, set by tests/conftest.py for the whole
suite): a copy from the cache is byte-for-byte the directory a build in place writes, and a second storage
directory is served from the cache without a build."""
from __future__ import annotations

from pathlib import Path

from node.config import load_config
from node.coordinator import run_model
from node.coordinator.run_model import TINY_CACHE_ENV, load_run_model

REPO = Path(__file__).resolve().parents[2]


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_cached_tiny_model_is_the_one_built_in_place(tmp_path, monkeypatch):
    sets = ["model.tiny_hidden_size=16", "server.engine_process=false"]
    monkeypatch.delenv(TINY_CACHE_ENV, raising=False)
    load_run_model(load_config(REPO / "configs/local.toml", sets), tmp_path / "plain")
    monkeypatch.setenv(TINY_CACHE_ENV, str(tmp_path / "cache"))
    load_run_model(load_config(REPO / "configs/local.toml", sets), tmp_path / "a")
    assert files(tmp_path / "a" / "model") == files(tmp_path / "plain" / "model")
    assert len([p for p in (tmp_path / "cache").iterdir()]) == 1  # one key, no leftover .building- directory

    builds: list[Path] = []
    monkeypatch.setattr(run_model, "_build_tiny", lambda d, kw, in_child: builds.append(d))  # must not be called
    load_run_model(load_config(REPO / "configs/local.toml", sets), tmp_path / "b")
    assert builds == [] and files(tmp_path / "b" / "model") == files(tmp_path / "plain" / "model")
