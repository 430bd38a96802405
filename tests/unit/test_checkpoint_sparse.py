"""Encoding "sparse-delta": block format, bit-exact round trips, and every way a block can be wrong.

Real files, real zstd, real Ed25519, real torch; blocks that are wrong are signed by the real key (the
manifest re-signed), so only the block checks themselves can refuse them.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import zstandard

from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, ShardDecoder, apply_block,
                                 encode_block, load_manifest, load_payload, open_base, pack_checkpoint,
                                 reconstruct_payload, serialize_state, unpack_checkpoint)
from protocol.checkpoint.sparse import MODE_DENSE, MODE_SPARSE, ParsedBlock, word_size_for
from protocol.identity import Identity
from protocol.signing import sign_document
from verify.checkpoint import verify_checkpoint_dir

SHARD = 64 * 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(dtype=torch.bfloat16, seed=0, tied=False):
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(1000, 96, generator=g) * 0.02,
        "layers.0.mlp.weight": torch.randn(288, 96, generator=g) * 0.02,
        "norm.weight": torch.ones(96),
        "odd": torch.randn(7, 3, generator=g),  # 21 elements: nothing lines up nicely
    }
    state = {k: v.to(dtype) for k, v in state.items()}
    state["position_ids"] = torch.arange(13)  # an int64 buffer rides along unchanged
    if tied:
        state["lm_head.weight"] = state["embed.weight"]
    return state


def small_step(state, lr=1e-4, seed=1):
    """A small update on fp32 master weights: only some bf16 values move, by an ulp or two."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight":
            continue
        if v.is_floating_point():
            out[k] = (v.float() + lr * torch.randn(v.shape, generator=g)).to(v.dtype)
        else:
            out[k] = v.clone()
    if "lm_head.weight" in state:
        out["lm_head.weight"] = out["embed.weight"]
    return out


@pytest.fixture
def key():
    return Identity.generate()


# --- the block format ----------------------------------------------------------------------------
@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001, 65536 + 3])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_block_round_trip_bit_exact(word, n, density):
    rng = np.random.default_rng(n * 31 + word)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    new = base.copy()
    mask = rng.random(n) < density
    new[mask] = rng.integers(0, 256, int(mask.sum()), dtype=np.uint8)
    block = encode_block(memoryview(new), memoryview(base), word)
    mode, w, k = block[5], block[6], struct.unpack_from("<I", block, 12)[0]
    assert block[:5] == b"PNSD\x01" and w == word and struct.unpack_from("<I", block, 8)[0] == n
    assert len(block) <= 16 + n  # never larger than the dense fallback
    if mode == MODE_SPARSE:
        assert len(block) == 16 + k * (4 + word) + n % word
        changed = (new[:n // word * word] != base[:n // word * word]).reshape(-1, word).any(axis=1)
        assert k == int(changed.sum())
    else:
        assert mode == MODE_DENSE and k == 0 and len(block) == 16 + n
    dest = bytearray(base.tobytes())
    apply_block(block, memoryview(dest))
    assert bytes(dest) == new.tobytes()
    # Applied piece by piece (how a shard is written out of a small buffer), the result is the same.
    if n:
        parsed, dest, piece = ParsedBlock(block, n), bytearray(base.tobytes()), 8 * 5
        for start in range(0, n, piece):
            parsed.apply(memoryview(dest)[start:start + piece], start)
        assert bytes(dest) == new.tobytes()


def test_small_changes_are_listed_not_xored():
    """One ulp up and one down in bf16 words: two entries, zigzag 2 and 1, everything else absent."""
    base = np.array([0x3c00, 0x3c00, 0xbc00, 0x0001] * 1000, dtype="<u2")
    new = base.copy()
    new[5] += 1
    new[2002] -= 1
    block = encode_block(memoryview(new.view(np.uint8)), memoryview(base.view(np.uint8)), 2)
    assert block[5] == MODE_SPARSE and struct.unpack_from("<I", block, 12)[0] == 2
    body = bytes(block[16:])
    gaps = [body[i] | body[2 + i] << 8 | body[4 + i] << 16 | body[6 + i] << 24 for i in (0, 1)]  # 4 planes
    assert gaps == [5, 2002 - 5 - 1]
    zigzag = [body[8] | body[10] << 8, body[9] | body[11] << 8]
    assert zigzag == [2, 1] and len(block) == 16 + 2 * 6


def test_word_size_follows_the_payload_dtype():
    assert word_size_for("bfloat16") == 2 and word_size_for("float32") == 4 and word_size_for("int64") == 8
    assert word_size_for("uint8") == 1 and word_size_for("no-such-type") == 1


def _header(mode=MODE_SPARSE, word=2, n=64, k=1, magic=b"PNSD", version=1, reserved=0):
    return struct.pack("<4sBBBBII", magic, version, mode, word, reserved, n, k)


@pytest.mark.parametrize("block,must_say", [
    (b"PNSD\x01", "shorter than its header"),
    (_header(magic=b"XXXX") + bytes(6), "bad header"),
    (_header(version=2) + bytes(6), "bad header"),
    (_header(reserved=1) + bytes(6), "bad header"),
    (_header(word=3) + bytes(7), "word size 3"),
    (_header(n=63) + bytes(6), "covers 63 bytes"),
    (_header(mode=7) + bytes(6), "unknown mode 7"),
    (_header(k=1) + bytes(5), "expected 22"),                       # one byte short
    (_header(k=1) + bytes(7), "expected 22"),                       # one byte too many
    (_header(k=33) + bytes(33 * 6), "k=33"),                        # more changed words than there are
    (_header(k=1) + bytes([32, 0, 0, 0, 1, 0]), "changes word 32"),  # position past the range
    (_header(k=2) + bytes([31, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]), "changes word 32"),
    (_header(k=1) + bytes([0xff, 0xff, 0xff, 0xff, 1, 0]), "changes word 4294967295"),
    (_header(mode=MODE_DENSE, k=0) + bytes(63), "(dense)"),
    (_header(mode=MODE_DENSE, k=1) + bytes(64), "(dense)"),
])
def test_malformed_blocks_are_refused_before_anything_is_written(block, must_say):
    dest = bytearray(range(64))
    with pytest.raises(CheckpointError) as e:
        apply_block(block, memoryview(dest), index=3)
    assert e.value.code == "bad_delta" and e.value.shard == 3
    assert "shard 3" in str(e.value) and must_say in str(e.value), str(e.value)
    assert dest == bytearray(range(64))


# --- through the checkpoint format ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_delta_chain_round_trip_bit_exact(tmp_path, key, dtype):
    """Steps 0 (full), 1 and 2 (sparse-delta against the previous step), tied weights, odd sizes."""
    s0 = make_state(dtype, tied=True)
    s1 = small_step(s0, seed=1)
    s2 = small_step(s1, seed=2)
    m0 = pack_checkpoint(s0, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=SHARD,
                         payload_out=tmp_path / "p0.safetensors")
    m1 = pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", parent=m0, shard_size=SHARD,
                         base_payload=tmp_path / "p0.safetensors", encoding="sparse-delta",
                         payload_out=tmp_path / "p1.safetensors")
    m2 = pack_checkpoint(s2, tmp_path / "c2", identity=key, step=2, run_id="r", parent=m1, shard_size=SHARD,
                         base_payload=serialize_state(s1), encoding="sparse-delta")
    assert (m1.encoding, m1.base_step, m2.base_step) == ("sparse-delta", 0, 1) and m1.is_delta
    assert m1.total_size % SHARD and m1.num_shards > 2
    assert m1.sha256 == hashlib.sha256(serialize_state(s1)).hexdigest()
    assert load_manifest(tmp_path / "c1") == m1
    for i, entry in enumerate(m1.shards):  # `size` is the decompressed block, `total_size` the raw payload
        assert 16 <= entry.size <= 16 + m1.raw_size(i)
        assert zstandard.ZstdDecompressor().decompress(
            (tmp_path / "c1" / "shards" / f"{i:05d}.zst").read_bytes())[:4] == b"PNSD"
    # The model dir of step 0 is the base of step 1, whose model dir is the base of step 2.
    unpack_checkpoint(tmp_path / "c0", tmp_path / "u0", trusted_keys={key.public_hex})
    unpack_checkpoint(tmp_path / "c1", tmp_path / "u1", trusted_keys={key.public_hex}, base=tmp_path / "u0")
    unpack_checkpoint(tmp_path / "c2", tmp_path / "u2", trusted_keys={key.public_hex}, base=tmp_path / "u1")
    for u, s in (("u1", s1), ("u2", s2)):
        payload = (tmp_path / u / "model.safetensors").read_bytes()
        assert payload == serialize_state(s)
        got = load_payload(tmp_path / u / "model.safetensors")
        assert got["lm_head.weight"] is got["embed.weight"]  # tied again
        for k in s:
            assert torch.equal(got[k].view(torch.uint8), s[k].contiguous().view(torch.uint8)), k
    # A full checkpoint dir works as the base too (rebuilt and verified first).
    unpack_checkpoint(tmp_path / "c1", tmp_path / "u1b", trusted_keys={key.public_hex}, base=tmp_path / "c0")
    assert (tmp_path / "u1b" / "model.safetensors").read_bytes() == serialize_state(s1)
    report = verify_checkpoint_dir(tmp_path / "c2", {key.public_hex}, parent=tmp_path / "c1",
                                   base=tmp_path / "u1")
    assert report.ok and report.payload_verified and report.shards_ok == m2.num_shards, report.failures
    report = verify_checkpoint_dir(tmp_path / "c2", {key.public_hex})
    assert report.ok and not report.payload_verified and "sparse-delta" in report.notes[0]
    assert not [p for p in os.listdir(tmp_path / "u1") if p.startswith(".")]  # no temporary leftovers


def test_sparse_delta_is_much_smaller_than_xor_delta_for_small_steps(tmp_path, key):
    s0 = make_state()
    s1 = small_step(s0, lr=2e-6)
    p0 = serialize_state(s0)
    changed = np.count_nonzero(np.frombuffer(serialize_state(s1), "<u2") != np.frombuffer(p0, "<u2"))
    assert 0 < changed < 0.05 * len(p0) / 2  # a few per cent of the bf16 values move
    xor = pack_checkpoint(s1, tmp_path / "x", identity=key, step=1, run_id="r", base_payload=p0, base_step=0)
    sparse = pack_checkpoint(s1, tmp_path / "s", identity=key, step=1, run_id="r", base_payload=p0, base_step=0,
                             encoding="sparse-delta")
    assert sparse.compressed_size < 0.7 * xor.compressed_size < xor.total_size


def test_every_reader_path_rebuilds_the_same_bytes(tmp_path, key):
    """A plain callable reader (HTTP, a peer), the directory reader, the buffered and the streamed decoder."""
    s0, s1 = make_state(), small_step(make_state())
    p0 = serialize_state(s0)
    m = pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", base_payload=p0, base_step=0,
                        encoding="sparse-delta", shard_size=SHARD)
    reader = DirShardReader(tmp_path / "c1", m)
    plain = lambda i: reader(i)  # noqa: E731 - no read_into: the pooled path is not taken
    want = serialize_state(s1)
    for r in (reader, plain):
        for out in (tmp_path / f"o-{id(r)}.safetensors", None):
            assert reconstruct_payload(m, r, out, base_payload=p0) == m.sha256
            if out is not None:
                assert out.read_bytes() == want
    decoder = ShardDecoder(m, reader, open_base(p0))
    got = bytearray(m.total_size)
    for i in range(m.num_shards):
        view = memoryview(got)[m.shard_offset(i):m.shard_offset(i) + m.raw_size(i)]
        decoder.decode_into(i, view)
        pieces = bytearray(m.raw_size(i))
        decoder.decode_to(i, lambda off, piece: pieces.__setitem__(
            slice(off - m.shard_offset(i), off - m.shard_offset(i) + len(piece)), piece))
        assert pieces == view
    assert bytes(got) == want


def test_pack_argument_checks(tmp_path, key):
    s = make_state()
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(s, tmp_path / "a", identity=key, step=1, run_id="r", encoding="sparse-delta")
    assert e.value.code == "base_mismatch" and "needs base_payload" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(s, tmp_path / "b", identity=key, step=1, run_id="r", encoding="full",
                        base_payload=serialize_state(s), base_step=0)
    assert e.value.code == "base_mismatch"
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(s, tmp_path / "c", identity=key, step=1, run_id="r", encoding="xor-planes")
    assert e.value.code == "unknown_encoding" and "xor-planes" in str(e.value)
    other = dict(s, extra=torch.zeros(3))
    with pytest.raises(CheckpointError) as e:  # same base-layout rule as xor-delta: the caller packs full
        pack_checkpoint(other, tmp_path / "d", identity=key, step=1, run_id="r", base_payload=serialize_state(s),
                        base_step=0, encoding="sparse-delta")
    assert e.value.code == "delta_layout"
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"))


# --- tampering -------------------------------------------------------------------------------------
@pytest.fixture
def sparse_world(tmp_path, key):
    s0, s1 = make_state(), small_step(make_state())
    p0 = tmp_path / "p0.safetensors"
    p0.write_bytes(serialize_state(s0))
    m0 = pack_checkpoint(s0, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=SHARD)
    m1 = pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", parent=m0, base_payload=p0,
                         encoding="sparse-delta", shard_size=SHARD)
    return {"dir": tmp_path / "c1", "m0": m0, "m1": m1, "p0": p0, "key": key, "s0": s0, "s1": s1}


def _refused(w, code, must_name, base="p0"):
    kw = {"base": w[base]} if base else {}
    report = verify_checkpoint_dir(w["dir"], {w["key"].public_hex}, **kw)
    assert not report.ok and code in report.codes, report.failures
    assert must_name in report.failures[report.codes.index(code)], report.failures
    with pytest.raises(CheckpointError) as e:
        unpack_checkpoint(w["dir"], w["dir"].parent / "out", trusted_keys={w["key"].public_hex}, **kw)
    assert not (w["dir"].parent / "out" / "model.safetensors").exists()  # nothing half-written is kept
    return e.value


def _resign(w, edit):
    doc = json.loads((w["dir"] / "manifest.json").read_bytes())
    edit(doc)
    doc = sign_document(w["key"], {k: v for k, v in doc.items() if k not in ("signer", "signature")})
    (w["dir"] / "manifest.json").write_text(json.dumps(doc))


def _replace_block(w, index, block):
    """Put `block` in shard `index` as a valid zstd frame and sign a manifest that lists it."""
    data = zstandard.ZstdCompressor(level=1).compress(bytes(block))
    (w["dir"] / "shards" / f"{index:05d}.zst").write_bytes(data)

    def edit(doc):
        doc["shards"][index].update(size=len(block), zsize=len(data), sha256=hashlib.sha256(data).hexdigest())
    _resign(w, edit)


def test_flipped_byte_in_a_sparse_shard(sparse_world):
    path = sparse_world["dir"] / "shards" / "00001.zst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert _refused(sparse_world, "shard_hash", "shard 1").shard == 1


def test_signed_malformed_block_is_refused(sparse_world):
    m1 = sparse_world["m1"]
    n = m1.raw_size(2)
    _replace_block(sparse_world, 2, _header(n=n, k=1) + struct.pack("<I", n) + bytes(2))  # past the range
    err = _refused(sparse_world, "bad_delta", "shard 2")
    assert err.code == "bad_delta" and "beyond" in str(err)


def test_signed_block_for_the_wrong_range_is_refused(sparse_world):
    n = sparse_world["m1"].raw_size(0)
    _replace_block(sparse_world, 0, _header(mode=MODE_DENSE, n=n - 2, k=0) + bytes(n - 2))
    assert "covers" in str(_refused(sparse_world, "bad_delta", "shard 0"))


def test_signed_block_that_changes_nothing_fails_the_payload_hash(sparse_world):
    n = sparse_world["m1"].raw_size(1)
    _replace_block(sparse_world, 1, _header(n=n, k=0, word=2) + bytes(n % 2))
    _refused(sparse_world, "payload_hash", "differs from the manifest")


def test_bomb_in_a_sparse_shard_is_cut_off(sparse_world):
    """The frame says more than the manifest's `size`: decompression stops one byte past it."""
    m1 = sparse_world["m1"]
    path = sparse_world["dir"] / "shards" / "00000.zst"
    real = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    data = zstandard.ZstdCompressor(level=1).compress(real + bytes(10 * 1024 * 1024))

    def edit(doc):
        doc["shards"][0].update(zsize=len(data), sha256=hashlib.sha256(data).hexdigest())
    assert len(data) <= m1.shards[0].size + m1.shards[0].size // 128 + 1024  # passes the schema's bound
    path.write_bytes(data)
    _resign(sparse_world, edit)
    _refused(sparse_world, "decompress_bomb", "shard 0")


def test_wrong_or_missing_base(sparse_world, tmp_path):
    w = sparse_world
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(serialize_state(small_step(w["s0"], seed=9)))
    w["wrong"] = wrong
    _refused(w, "payload_hash", "wrong base", base="wrong")
    w["short"] = tmp_path / "short.safetensors"
    w["short"].write_bytes(w["p0"].read_bytes()[:-2])
    _refused(w, "base_mismatch", "wrong base", base="short")
    with pytest.raises(CheckpointError) as e:
        unpack_checkpoint(w["dir"], tmp_path / "nobase", trusted_keys={w["key"].public_hex})
    assert e.value.code == "base_mismatch" and "sparse-delta against step 0" in str(e.value)
    # A delta is never a base for another delta (its own base would be needed first).
    with pytest.raises(CheckpointError) as e:
        unpack_checkpoint(w["dir"], tmp_path / "x", trusted_keys={w["key"].public_hex}, base=w["dir"])
    assert e.value.code == "base_mismatch" and "is itself a sparse-delta" in str(e.value)


@pytest.mark.parametrize("edit,must_say", [
    (lambda d: d["shards"][0].update(size=d["shards"][0]["size"] + SHARD), "impossible for a sparse-delta block"),
    (lambda d: d["shards"][0].update(size=15), "impossible for a sparse-delta block"),
    (lambda d: d.update(base_step=None), "base_step is required for encoding 'sparse-delta'"),
    (lambda d: d.update(base_step=1), "base_step 1 must be before step 1"),
])
def test_inconsistent_sparse_manifest_is_refused_by_schema(sparse_world, edit, must_say):
    _resign(sparse_world, edit)
    err = _refused(sparse_world, "manifest_schema", must_say)
    assert err.code == "manifest_schema"


# --- unknown encodings --------------------------------------------------------------------------------
def test_unknown_encoding_is_refused_with_a_clear_error(sparse_world):
    """A signed manifest from a newer coordinator, with an encoding this reader does not know."""
    _resign(sparse_world, lambda d: d.update(encoding="xor-planes"))
    raw = (sparse_world["dir"] / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError) as e:
        Manifest.from_json_bytes(raw)
    assert e.value.code == "unknown_encoding"
    assert "'xor-planes' is not an encoding this reader knows (full, xor-delta, sparse-delta, lora-adapter)" in str(e.value)
    err = _refused(sparse_world, "unknown_encoding", "'xor-planes'")
    assert err.code == "unknown_encoding"
    out = subprocess.run([sys.executable, "-m", "node.cli", "verify", "checkpoint", str(sparse_world["dir"]),
                          "--key", sparse_world["key"].public_hex], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 1
    assert "[unknown_encoding]" in out.stderr and "'xor-planes' is not an encoding" in out.stderr, out.stderr
    # Not a string at all: still the schema's error, naming the field.
    _resign(sparse_world, lambda d: d.update(encoding=3))
    with pytest.raises(CheckpointError) as e:
        Manifest.from_json_bytes((sparse_world["dir"] / "manifest.json").read_bytes())
    assert e.value.code == "manifest_schema" and "encoding" in str(e.value)


def test_cli_packs_verifies_and_unpacks_sparse_delta(tmp_path, key):
    from safetensors.torch import save_file

    s0, s1 = make_state(), small_step(make_state())
    for name, s in (("m0", s0), ("m1", s1)):
        (tmp_path / name).mkdir()
        save_file({k: v for k, v in s.items()}, tmp_path / name / "model.safetensors")
    key.save(tmp_path / "k.key")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "node.cli", *map(str, args)], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
    common = ("--key", tmp_path / "k.key", "--run-id", "r", "--shard-size", SHARD)
    assert cli("checkpoint", "pack", "--model", tmp_path / "m0", "--out", tmp_path / "c0", "--step", 0,
               *common).returncode == 0
    out = cli("checkpoint", "pack", "--model", tmp_path / "m1", "--out", tmp_path / "c1", "--step", 1,
              "--parent", tmp_path / "c0", "--encoding", "sparse-delta", *common)
    assert out.returncode == 0 and "sparse-delta, base step 0" in out.stdout, out.stderr
    assert load_manifest(tmp_path / "c1").encoding == "sparse-delta"
    out = cli("verify", "checkpoint", tmp_path / "c1", "--key", key.public_hex, "--base", tmp_path / "c0")
    assert out.returncode == 0 and "payload sha256 verified" in out.stdout, out.stdout + out.stderr
    out = cli("checkpoint", "unpack", tmp_path / "c1", "--out", tmp_path / "u1", "--key", key.public_hex,
              "--base", tmp_path / "c0")
    assert out.returncode == 0, out.stderr
    from protocol.checkpoint import layout_from_files
    with layout_from_files(tmp_path / "m1") as layout:
        assert (tmp_path / "u1" / "model.safetensors").read_bytes() == layout.to_bytes()
    out = cli("checkpoint", "pack", "--model", tmp_path / "m1", "--out", tmp_path / "c9", "--step", 1,
              "--encoding", "sparse-delta", *common)
    assert out.returncode != 0 and "needs --parent" in out.stderr
    shutil.rmtree(tmp_path / "c9", ignore_errors=True)
