import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.config import ConfigError, coordinator_warnings, load_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["run.async_level=0", "server.port=1234", "storage.dir=/tmp/x", "task.name=arith"])
    assert cfg.run.async_level == 0 and cfg.server.port == 1234
    assert cfg.storage.dir == "/tmp/x" and cfg.task.name == "arith"
    assert cfg.distribution.origin_upload_limit == 0


def test_unknown_key_and_bad_value_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="run.asynclevel"):
        load_config(None, ["run.asynclevel=1"])
    with pytest.raises(ConfigError, match="run.async_level"):
        load_config(None, ["run.async_level=-1"])
    bad = tmp_path / "c.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("overrides, warned", [
    ([], False),  # bf16 broadcast: nodes and verifier hold the same weights
    (["trainer.broadcast_dtype=float32"], True),  # a bf16 node rounds them alone (bench/bf16_token_tail.py)
    (["trainer.broadcast_dtype=float32", "verification.fraction=0", "verification.new_node_fraction=0"], False),
])
def test_float32_broadcast_with_replays_is_warned_about(overrides, warned):
    cfg = load_config(None, overrides)
    assert any("broadcast_dtype = float32" in w for w in coordinator_warnings(cfg)) is warned
    assert len(coordinator_warnings(cfg)) == int(warned)


def test_engine_process_with_a_verifier_pool_is_a_valid_config():
    """Refused until the pool's path ran without torch in the API process (tests/integration/test_verifier_pool.py
    runs both layouts)."""
    key = "ab" * 32
    cfg = load_config(REPO / "configs/local.toml", ["server.engine_process=true",
                                                    f'verification.verifier_keys=["{key}"]'])
    assert cfg.server.engine_process and cfg.verification.verifier_keys == [key]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True)


def test_cli_keys(tmp_path):
    key = tmp_path / "k.pem"
    r = run_cli("keys", "new", "--out", str(key))
    assert r.returncode == 0, r.stderr
    pub = r.stdout.strip()
    assert len(pub) == 64
    r = run_cli("keys", "show", "--key", str(key))
    assert r.returncode == 0 and r.stdout.strip() == pub
    r = run_cli("keys", "show", "--key", str(tmp_path / "nope"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("keys")
    assert r.returncode == 2


@pytest.mark.parametrize("args", [
    ("keys", "show", "--bogus"),                                           # argparse's own refusal
    ("join", "--coordinator", "http://127.0.0.1:9", "--coordinator-key", "zz"),
    ("relay", "--upstream", "http://127.0.0.1:9", "--upstream-key", "00" * 31),
    ("verify", "checkpoint", ".", "--key", "not-hex" * 9 + "x"),
    ("verify", "rollouts", "x.jsonl", "--checkpoint", ".", "--key", "12"),
    ("checkpoint", "unpack", ".", "--out", "u", "--key", "12"),
    ("token", "new", "--key", "k.pem", "--run-id", "r", "--node", "abc"),
    ("token", "new", "--key", "k.pem", "--run-id", "r", "--valid-hours", "0"),
])
def test_every_bad_argument_is_one_line_and_exit_2(args, tmp_path):
    r = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
