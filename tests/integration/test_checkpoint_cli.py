"""`prime-node checkpoint pack|unpack` and `prime-node verify checkpoint` as real processes, plus HTTP."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.checkpoint_server import CheckpointServer
from protocol.checkpoint import load_payload, serialize_state
from verify.checkpoint import verify_checkpoint_url

REPO = Path(__file__).resolve().parents[2]
SHARD = str(64 * 1024)


def cli(*args, check_rc=None):
    out = subprocess.run([sys.executable, "-m", "node.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    if check_rc is not None:
        assert out.returncode == check_rc, (out.returncode, out.stdout, out.stderr)
    return out


def model_dir(path: Path, seed: int, base: dict | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    if base is None:
        state = {"model.embed_tokens.weight": torch.randn(1000, 128, generator=g) * 0.02,
                 "model.layers.0.mlp.up_proj.weight": torch.randn(512, 128, generator=g) * 0.02,
                 "model.norm.weight": torch.ones(128)}
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    else:
        state = {k: (v.float() - 1e-4 * torch.sign(torch.randn(v.shape, generator=g))).to(v.dtype)
                 for k, v in base.items()}
    path.mkdir(parents=True)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    return state


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Steps 0 (full) and 1 (xor-delta by default with --parent), packed by `prime-node` subprocesses."""
    root = tmp_path_factory.mktemp("cli")
    pub = cli("keys", "new", "--out", root / "coord.key", check_rc=0).stdout.strip()
    s0 = model_dir(root / "m0", 0)
    s1 = model_dir(root / "m1", 1, base=s0)
    out = cli("checkpoint", "pack", "--model", root / "m0", "--out", root / "c0", "--key", root / "coord.key",
              "--step", 0, "--run-id", "cli-run", "--shard-size", SHARD, check_rc=0)
    assert "packed step 0" in out.stdout
    out = cli("checkpoint", "pack", "--model", root / "m1", "--out", root / "c1", "--key", root / "coord.key",
              "--step", 1, "--run-id", "cli-run", "--parent", root / "c0", "--shard-size", SHARD, check_rc=0)
    assert "xor-delta" in out.stdout
    return {"root": root, "pub": pub, "s0": s0, "s1": s1}


def test_valid_checkpoints_verify_exit_0(packed):
    root, pub = packed["root"], packed["pub"]
    out = cli("verify", "checkpoint", root / "c0", "--key", pub, check_rc=0)
    assert out.stdout.startswith("valid: step 0") and "payload sha256 verified" in out.stdout
    out = cli("verify", "checkpoint", root / "c1", "--key", pub, "--parent", root / "c0", "--base", root / "c0",
              check_rc=0)
    assert "payload sha256 verified" in out.stdout
    out = cli("verify", "checkpoint", root / "c1", "--key", pub, check_rc=0)
    assert "NOT checked" in out.stdout and "xor-delta" in out.stderr


def test_unpack_cli_restores_bit_exact(packed):
    root, pub = packed["root"], packed["pub"]
    cli("checkpoint", "unpack", root / "c0", "--out", root / "u0", "--key", pub, check_rc=0)
    out = cli("checkpoint", "unpack", root / "c1", "--out", root / "u1", "--key", pub, "--base", root / "u0",
              check_rc=0)
    assert "sha256 verified" in out.stdout
    got = load_payload(root / "u1" / "model.safetensors")
    assert (root / "u1" / "model.safetensors").read_bytes() == serialize_state(packed["s1"])
    assert all(torch.equal(got[k], packed["s1"][k]) for k in packed["s1"])
    out = cli("checkpoint", "unpack", root / "c0", "--out", root / "u0b", check_rc=0)  # no --key: warns
    assert "no --key" in out.stderr


def one_clear_line(out, rc: int = 1):
    assert out.returncode == rc, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    return lines[0]


def test_tampered_checkpoint_exits_1_with_one_line(packed, tmp_path):
    import shutil
    root, pub = packed["root"], packed["pub"]
    shutil.copytree(root / "c0", tmp_path / "bad")
    shard = tmp_path / "bad" / "shards" / "00003.zst"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = one_clear_line(cli("verify", "checkpoint", tmp_path / "bad", "--key", pub))
    assert "shard 3" in line and "shard_hash" in line
    line = one_clear_line(cli("checkpoint", "unpack", tmp_path / "bad", "--out", tmp_path / "o", "--key", pub))
    assert "shard 3" in line
    other = cli("keys", "new", "--out", tmp_path / "other.key", check_rc=0).stdout.strip()
    line = one_clear_line(cli("verify", "checkpoint", root / "c0", "--key", other))
    assert "unknown_signer" in line
    line = one_clear_line(cli("verify", "checkpoint", root / "c0", "--key", "zz"), rc=2)  # a bad argument: exit 2
    assert "--key" in line
    line = one_clear_line(cli("verify", "checkpoint", tmp_path / "nope", "--key", pub))
    assert "manifest.json is missing" in line


def test_cli_pack_errors_are_one_line(packed, tmp_path):
    root = packed["root"]
    line = one_clear_line(cli("checkpoint", "pack", "--model", root / "m0", "--out", root / "c0", "--key",
                              root / "coord.key", "--step", 2))
    assert "already exists" in line
    line = one_clear_line(cli("checkpoint", "pack", "--model", tmp_path / "missing", "--out", tmp_path / "c",
                              "--key", root / "coord.key", "--step", 0))
    assert "does not exist" in line
    line = one_clear_line(cli("checkpoint", "pack", "--model", root / "m1", "--out", tmp_path / "c", "--key",
                              root / "coord.key", "--step", 0, "--parent", root / "c1", "--run-id", "cli-run"))
    assert "rollback" in line or "forward" in line


def test_verify_url_served_by_real_aiohttp(packed):
    root, pub = packed["root"], packed["pub"]
    with CheckpointServer({0: root / "c0", 1: root / "c1"}) as server:
        out = cli("verify", "checkpoint", server.url(0), "--key", pub, check_rc=0)
        assert "payload sha256 verified" in out.stdout
        r = verify_checkpoint_url(server.url(1), {pub}, parent=root / "c0", base=root / "c0")
        assert r.ok and r.payload_verified, r.failures
        out = cli("verify", "checkpoint", server.url(1), "--key", pub, "--parent", server.url(0), "--base",
                  root / "c0", check_rc=0)  # the parent can be a URL too
        assert "payload sha256 verified" in out.stdout
        line = one_clear_line(cli("verify", "checkpoint", server.url(0), "--key", pub, "--parent", server.url(1)))
        assert "parent_chain" in line
        line = one_clear_line(cli("verify", "checkpoint", server.url(7), "--key", pub))
        assert "HTTP 404" in line
        import urllib.error
        import urllib.request
        for bad in ("..%2F..%2Fmanifest.json", "%2Fetc%2Fpasswd", "1e3", "99999"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{server.url(0)}/shards/{bad}", timeout=10)
            assert e.value.code in (400, 404)
        # The URL names step 1 but the server hands out step 0's files: refused.
    with CheckpointServer({1: root / "c0"}) as server:
        r = verify_checkpoint_url(server.url(1), {pub})
        assert "step_mismatch" in r.codes


def test_url_with_tampered_shard(packed, tmp_path):
    import shutil
    root, pub = packed["root"], packed["pub"]
    shutil.copytree(root / "c0", tmp_path / "c0")
    (tmp_path / "c0" / "shards" / "00001.zst").write_bytes(b"garbage")
    with CheckpointServer({0: tmp_path / "c0"}) as server:
        r = verify_checkpoint_url(server.url(0), {pub})
    assert r.codes == ["shard_size"] and "shard 1" in r.failures[0]
