"""Tamper matrix: every way a checkpoint can be wrong is refused with a reason naming the shard or field."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import zstandard

from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, check_parent, decompress_shard,
                                 load_manifest, pack_checkpoint, parse_shard_index, serialize_state,
                                 unpack_checkpoint, verify_manifest, verify_shard)
from protocol.identity import Identity
from protocol.signing import sign_document
from verify.checkpoint import verify_checkpoint_dir

SHARD = 64 * 1024


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": (torch.randn(800, 160, generator=g) * 0.02).to(torch.bfloat16),
            "mlp.weight": (torch.randn(480, 160, generator=g) * 0.02).to(torch.bfloat16),
            "norm.weight": torch.ones(160, dtype=torch.bfloat16)}


def update(state, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Steps 0 (full), 1 and 2 (xor-delta chain) of one run, signed by `key`; tests copy before tampering."""
    root = tmp_path_factory.mktemp("ckpts")
    key = Identity.generate()
    s0 = make_state()
    s1 = update(s0, 1)
    s2 = update(s1, 2)
    m0 = pack_checkpoint(s0, root / "c0", identity=key, step=0, run_id="r", shard_size=SHARD)
    m1 = pack_checkpoint(s1, root / "c1", identity=key, step=1, run_id="r", parent=m0,
                         base_payload=serialize_state(s0), shard_size=SHARD)
    m2 = pack_checkpoint(s2, root / "c2", identity=key, step=2, run_id="r", parent=m1,
                         base_payload=serialize_state(s1), shard_size=SHARD)
    return {"root": root, "key": key, "m": [m0, m1, m2], "payload": [serialize_state(s) for s in (s0, s1, s2)]}


@pytest.fixture
def ckpt(world, tmp_path):
    """A private copy of step 0 (full, 4+ shards)."""
    shutil.copytree(world["root"] / "c0", tmp_path / "c0")
    return tmp_path / "c0"


def trusted(world):
    return {world["key"].public_hex}


def resign(ckpt_dir, key, edit):
    """Edit the manifest dict, sign it again with `key` (so only the targeted check can catch it)."""
    doc = json.loads((ckpt_dir / "manifest.json").read_bytes())
    edit(doc)
    doc = sign_document(key, {k: v for k, v in doc.items() if k not in ("signer", "signature")})
    (ckpt_dir / "manifest.json").write_text(json.dumps(doc))


def refused(world, ckpt_dir, code, must_name, **kw):
    report = verify_checkpoint_dir(ckpt_dir, trusted(world), **kw)
    assert not report.ok and code in report.codes, report.failures
    line = report.failures[report.codes.index(code)]
    assert must_name in line, line
    # The stop-at-first-problem path (unpack) refuses too.
    with pytest.raises(CheckpointError):
        unpack_checkpoint(ckpt_dir, ckpt_dir.parent / "out", trusted_keys=trusted(world),
                          base=kw.get("base"))
    return report


def test_untampered_checkpoints_verify(world):
    m0, m1, m2 = world["m"]
    r = verify_checkpoint_dir(world["root"] / "c0", trusted(world))
    assert r.ok and r.payload_verified and r.shards_ok == m0.num_shards, r.failures
    r = verify_checkpoint_dir(world["root"] / "c2", trusted(world), parent=world["root"] / "c1",
                              base=world["payload"][1])
    assert r.ok and r.payload_verified, r.failures
    r = verify_checkpoint_dir(world["root"] / "c2", trusted(world))
    assert r.ok and not r.payload_verified and "xor-delta" in r.notes[0]


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_flipped_byte_in_any_shard(world, ckpt, which):
    n = world["m"][0].num_shards
    index = {"first": 0, "middle": n // 2, "last": n - 1}[which]
    path = ckpt / "shards" / f"{index:05d}.zst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    report = refused(world, ckpt, "shard_hash", f"shard {index}:")
    assert report.codes == ["shard_hash"]  # nothing else is blamed


def test_shard_swapped_in_from_another_step(world, ckpt):
    shutil.copy(world["root"] / "c1" / "shards" / "00002.zst", ckpt / "shards" / "00002.zst")
    report = verify_checkpoint_dir(ckpt, trusted(world))
    assert set(report.codes) <= {"shard_hash", "shard_size"} and report.codes
    assert "shard 2:" in report.failures[0]


def test_truncated_missing_and_extra_shards(world, ckpt):
    path = ckpt / "shards" / "00001.zst"
    path.write_bytes(path.read_bytes()[:-10])
    (ckpt / "shards" / "00003.zst").unlink()
    shutil.copy(ckpt / "shards" / "00000.zst", ckpt / "shards" / "00042.zst")
    report = verify_checkpoint_dir(ckpt, trusted(world))
    lines = "\n".join(report.failures)
    assert {"shard_size", "missing_shard", "extra_shard"} <= set(report.codes), lines
    assert "shard 1:" in lines and "shard 3:" in lines and "shard 42:" in lines
    assert not report.payload_verified


@pytest.mark.parametrize("case", ["truncated", "missing", "extra", "stray-name"])
def test_each_shard_file_problem_alone(world, ckpt, case):
    if case == "truncated":
        p = ckpt / "shards" / "00002.zst"
        p.write_bytes(p.read_bytes()[:100])
        refused(world, ckpt, "shard_size", "shard 2:")
    elif case == "missing":
        (ckpt / "shards" / "00002.zst").unlink()
        refused(world, ckpt, "missing_shard", "shard 2:")
    elif case == "extra":
        (ckpt / "shards" / "99998.zst").write_bytes(b"x")
        refused(world, ckpt, "extra_shard", "shard 99998:")
    else:
        (ckpt / "shards" / "00001.zst.bak").write_bytes(b"x")
        refused(world, ckpt, "bad_shard_name", "00001.zst.bak")


@pytest.mark.parametrize("field,value", [("step", 7), ("total_size", 1), ("sha256", "0" * 64),
                                         ("run_id", "other"), ("created_at", 1)])
def test_edited_manifest_field_breaks_signature(world, ckpt, field, value):
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    doc[field] = value
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    report = verify_checkpoint_dir(ckpt, trusted(world))
    assert report.codes[0] in ("bad_signature", "manifest_schema"), report.failures
    assert not report.ok


def test_edited_shard_entry_breaks_signature(world, ckpt):
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    data = (ckpt / "shards" / "00001.zst").read_bytes()
    doc["shards"][1]["sha256"] = __import__("hashlib").sha256(data[:-1]).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    report = verify_checkpoint_dir(ckpt, trusted(world))
    assert "bad_signature" in report.codes and "shard_hash" in report.codes


@pytest.mark.parametrize("mutate,must_name", [
    (lambda d: d.update(extra=1), "'extra'"),
    (lambda d: d.update(step="3"), "'step'"),
    (lambda d: d.update(step=True), "'step'"),
    (lambda d: d.update(shard_size=1.5), "'shard_size'"),
    (lambda d: d.pop("sha256"), "'sha256'"),
    (lambda d: d["shards"].pop(), "shards"),
    (lambda d: d["shards"][0].update(index="../x"), "'shards.0.index'"),
    (lambda d: d["shards"][1].update(size=5), "shards[1].size"),
    (lambda d: d.update(total_size=10 ** 12), "shards"),
    (lambda d: d.update(encoding="full", base_step=0), "base_step"),
    (lambda d: d.update(format="prime-node/checkpoint/v2"), "'format'"),
])
def test_ill_formed_manifest_is_refused_by_schema(world, ckpt, mutate, must_name):
    resign(ckpt, world["key"], mutate)  # properly signed: only the schema can refuse it
    report = refused(world, ckpt, "manifest_schema", must_name)
    assert report.codes == ["manifest_schema"]


def test_manifest_size_and_json_limits(world, ckpt):
    (ckpt / "manifest.json").write_bytes(b'{"step": NaN}')
    refused(world, ckpt, "manifest_schema", "JSON")
    (ckpt / "manifest.json").write_bytes(b" " * (17 * 1024 * 1024))
    with pytest.raises(CheckpointError) as e:
        load_manifest(ckpt)
    assert e.value.code == "manifest_too_large"


def test_wrong_or_unknown_signer(world, ckpt):
    resign(ckpt, Identity.generate(), lambda d: None)
    refused(world, ckpt, "unknown_signer", "not a trusted key")
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    doc["signer"] = world["key"].public_hex  # claims the trusted key, signature is someone else's
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    refused(world, ckpt, "bad_signature", "signature does not match")


def test_rollback_is_refused(world):
    m0, m1, m2 = world["m"]
    verify_manifest(m2, trusted(world), previous=m1)
    for older in (m1, m0, m2):  # an older step after a newer one, or the same step again
        with pytest.raises(CheckpointError) as e:
            verify_manifest(older, trusted(world), previous=m2)
        assert e.value.code == "rollback" and f"step {older.step}" in str(e.value)
    report = verify_checkpoint_dir(world["root"] / "c1", trusted(world), previous=m2)
    assert report.codes == ["rollback"]


def test_broken_parent_chain(world, tmp_path):
    m0, m1, m2 = world["m"]
    with pytest.raises(CheckpointError) as e:
        check_parent(m2, m0)  # m2's parent is m1
    assert e.value.code == "parent_chain" and "field 'parent'" in str(e.value)
    # A properly signed step 2 whose parent points at step 0 is refused by anyone holding step 1.
    shutil.copytree(world["root"] / "c2", tmp_path / "c2")
    resign(tmp_path / "c2", world["key"], lambda d: d.update(parent=m0.canonical_hash()))
    with pytest.raises(CheckpointError) as e:
        verify_manifest(load_manifest(tmp_path / "c2"), trusted(world), previous=m1)
    assert e.value.code == "parent_chain"
    report = verify_checkpoint_dir(tmp_path / "c2", trusted(world), parent=world["root"] / "c1",
                                   base=world["payload"][1])
    assert report.codes == ["parent_chain"], report.failures


def test_payload_hash_mismatch_and_wrong_base(world, ckpt, tmp_path):
    resign(ckpt, world["key"], lambda d: d.update(sha256="ab" * 32))
    refused(world, ckpt, "payload_hash", "payload sha256")
    # Step 2 applied on step 0's payload (same layout, wrong base) does not hash to the signed value.
    report = verify_checkpoint_dir(world["root"] / "c2", trusted(world), base=world["payload"][0])
    assert report.codes == ["payload_hash"] and "wrong base" in report.failures[0]
    with pytest.raises(CheckpointError) as e:
        unpack_checkpoint(world["root"] / "c2", tmp_path / "o", trusted_keys=trusted(world),
                          base=world["payload"][0])
    assert e.value.code == "payload_hash"
    assert not (tmp_path / "o" / "model.safetensors").exists()  # nothing half-written is left behind


def write_bomb(path, zeros=200 * 1024 * 1024):
    """A real zstd stream of `zeros` zero bytes, built in 1 MiB chunks (this test never holds 200 MiB)."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1024 * 1024)
    with open(path, "wb") as f:
        for _ in range(zeros // len(chunk)):
            f.write(cobj.compress(chunk))
        f.write(cobj.flush())
    return path.read_bytes()


def test_zstd_bomb_is_cut_off(world, ckpt, tmp_path):
    bomb = write_bomb(tmp_path / "bomb.zst")
    assert len(bomb) < SHARD  # tiny on the wire
    (ckpt / "shards" / "00001.zst").write_bytes(bomb)
    import hashlib
    resign(ckpt, world["key"], lambda d: d["shards"][1].update(zsize=len(bomb),
                                                               sha256=hashlib.sha256(bomb).hexdigest()))
    report = refused(world, ckpt, "decompress_bomb", "shard 1:")
    assert report.codes == ["decompress_bomb"]


def test_zstd_bomb_memory_stays_bounded(world, ckpt, tmp_path):
    """In a fresh process (no torch): decompressing the 200 MiB bomb raises with peak RSS far below it."""
    import hashlib
    bomb = write_bomb(tmp_path / "bomb.zst")
    resign(ckpt, world["key"], lambda d: d["shards"][1].update(zsize=len(bomb),
                                                               sha256=hashlib.sha256(bomb).hexdigest()))
    script = textwrap.dedent(f"""
        import resource, sys
        from protocol.checkpoint import load_manifest, decompress_shard, verify_shard, CheckpointError
        m = load_manifest({str(ckpt)!r})
        data = open({str(tmp_path / 'bomb.zst')!r}, 'rb').read()
        verify_shard(m, 1, data)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            decompress_shard(m, 1, data)
            print("NOT REFUSED")
        except CheckpointError as e:
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(e.code, (after - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=os.getcwd())
    code, grew_mib = out.stdout.split()
    assert code == "decompress_bomb", out.stderr
    assert int(grew_mib) < 16  # declared shard is 64 KiB; the bomb would be 200 MiB


def test_decompress_never_exceeds_declared_size_and_rejects_short(world):
    m0 = world["m"][0]
    data = DirShardReader(world["root"] / "c0", m0)(0)
    raw = decompress_shard(m0, 0, data)
    assert len(raw) == m0.shards[0].size
    short = zstandard.ZstdCompressor().compress(bytes(raw[:-1]))
    fake = Manifest.from_dict({**m0.to_dict(), "shards": [{**m0.to_dict()["shards"][0], "zsize": len(short)}]
                               + m0.to_dict()["shards"][1:]})
    with pytest.raises(CheckpointError) as e:
        decompress_shard(fake, 0, short)
    assert e.value.code == "shard_size" and "shard 0" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        decompress_shard(fake, 0, b"\x00" * len(short))
    assert e.value.code == "decompress_error"
    with pytest.raises(CheckpointError) as e:
        verify_shard(m0, m0.num_shards, data)
    assert e.value.code == "shard_index"


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "00001.zst/../../x", "1e3", "-1", "", "０１",
                                  "123456", "1 ", "0x10"])
def test_shard_names_that_could_escape_are_refused(name):
    with pytest.raises(CheckpointError) as e:
        parse_shard_index(name)
    assert e.value.code == "bad_shard_name"
    assert parse_shard_index("00003") == 3 and parse_shard_index("7", 8) == 7


def test_symlinked_shard_pointing_outside(world, ckpt, tmp_path):
    outside = tmp_path / "secret"
    outside.write_bytes((ckpt / "shards" / "00002.zst").read_bytes())  # even identical content is refused
    (ckpt / "shards" / "00002.zst").unlink()
    os.symlink(outside, ckpt / "shards" / "00002.zst")
    report = refused(world, ckpt, "bad_shard_name", "shard 2:")
    assert "symlink" in report.failures[0]
    with pytest.raises(CheckpointError) as e:
        DirShardReader(ckpt, world["m"][0])(2)
    assert e.value.code == "bad_shard_name"


def test_symlinked_shards_dir_and_absolute_link(world, ckpt, tmp_path):
    real = tmp_path / "elsewhere"
    shutil.move(ckpt / "shards", real)
    os.symlink(real, ckpt / "shards")
    refused(world, ckpt, "bad_shard_name", "shards")
    os.unlink(ckpt / "shards")
    shutil.move(real, ckpt / "shards")
    (ckpt / "shards" / "00001.zst").unlink()
    os.symlink("/etc/passwd", ckpt / "shards" / "00001.zst")  # absolute target outside the checkpoint
    report = refused(world, ckpt, "bad_shard_name", "shard 1:")
    assert report.codes == ["bad_shard_name"]
