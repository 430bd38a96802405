"""Bit-exact round trips of the checkpoint format: real files, real zstd, real Ed25519, real torch."""
import hashlib
import os

import pytest
import torch
from safetensors.torch import save_file

from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, load_manifest, load_payload,
                                 pack_checkpoint, reconstruct_payload, serialize_state, unpack_checkpoint,
                                 verify_manifest)
from protocol.identity import Identity

SHARD = 64 * 1024


def make_state(dtype=torch.bfloat16, seed=0, tied=False, hidden=192, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
        "layers.0.attn.weight": torch.randn(hidden, hidden, generator=g) * 0.02,
        "layers.0.mlp.weight": torch.randn(3 * hidden, hidden, generator=g) * 0.02,
        "norm.weight": torch.ones(hidden),
        "odd": torch.randn(7, 3, generator=g),  # 21 elements: payload size is not a multiple of anything nice
    }
    state = {k: v.to(dtype) for k, v in state.items()}
    state["position_ids"] = torch.arange(13)  # int64 buffer rides along in its own dtype
    if tied:
        state["lm_head.weight"] = state["embed.weight"]
    return state


def step_update(state, lr=1e-4, seed=1):
    """An Adam-like first step on fp32 master weights, cast back to each tensor's dtype."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            out[k] = (v.float() - lr * torch.sign(torch.randn(v.shape, generator=g))).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def assert_same_state(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].contiguous().reshape(-1).view(torch.uint8)), k


@pytest.fixture
def key():
    return Identity.generate()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_round_trip_bit_exact(tmp_path, key, dtype):
    state = make_state(dtype)
    m = pack_checkpoint(state, tmp_path / "c0", identity=key, step=0, run_id="run-1", shard_size=SHARD)
    assert m.total_size % SHARD != 0 and m.num_shards > 3
    assert m.dtype == str(dtype).removeprefix("torch.")
    assert sorted(os.listdir(tmp_path / "c0" / "shards")) == [f"{i:05d}.zst" for i in range(m.num_shards)]
    assert load_manifest(tmp_path / "c0") == m
    assert verify_manifest(m, {key.public_hex}) == key.public_hex
    unpack_checkpoint(tmp_path / "c0", tmp_path / "out", trusted_keys={key.public_hex})
    payload = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert hashlib.sha256(payload).hexdigest() == m.sha256
    assert payload == serialize_state(state)
    assert_same_state(load_payload(tmp_path / "out" / "model.safetensors"), state)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp leftovers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_xor_delta_round_trip_bit_exact(tmp_path, key, dtype):
    s0 = make_state(dtype, tied=True)
    s1 = step_update(s0)
    s1["lm_head.weight"] = s1["embed.weight"]
    m0 = pack_checkpoint(s0, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=SHARD,
                         payload_out=tmp_path / "p0.safetensors")
    assert (tmp_path / "p0.safetensors").read_bytes() == serialize_state(s0)
    m1 = pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", parent=m0,
                         base_payload=tmp_path / "p0.safetensors", shard_size=SHARD)
    assert (m1.encoding, m1.base_step, m1.parent) == ("xor-delta", 0, m0.canonical_hash())
    assert m1.compressed_size < m0.compressed_size
    verify_manifest(m1, {key.public_hex}, previous=m0)
    unpack_checkpoint(tmp_path / "c0", tmp_path / "u0", trusted_keys={key.public_hex})
    # The base can be the unpacked directory of the previous step; unpacking into it replaces it atomically.
    unpack_checkpoint(tmp_path / "c1", tmp_path / "u0", trusted_keys={key.public_hex}, base=tmp_path / "u0",
                      previous=m0)
    got = load_payload(tmp_path / "u0" / "model.safetensors")
    assert_same_state(got, s1)
    assert got["lm_head.weight"] is got["embed.weight"]  # tied weights come back tied


def test_base_can_be_a_full_checkpoint_dir_or_bytes(tmp_path, key):
    s0, s1 = make_state(), step_update(make_state())
    m0 = pack_checkpoint(s0, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=SHARD)
    pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", parent=m0,
                    base_payload=serialize_state(s0), shard_size=SHARD)
    unpack_checkpoint(tmp_path / "c1", tmp_path / "a", trusted_keys={key.public_hex}, base=tmp_path / "c0")
    unpack_checkpoint(tmp_path / "c1", tmp_path / "b", trusted_keys={key.public_hex}, base=serialize_state(s0))
    for d in ("a", "b"):
        assert (tmp_path / d / "model.safetensors").read_bytes() == serialize_state(s1)
    with pytest.raises(CheckpointError) as e:
        unpack_checkpoint(tmp_path / "c1", tmp_path / "c", trusted_keys={key.public_hex})
    assert e.value.code == "base_mismatch" and "base" in str(e.value)


def test_tied_weights_stored_once_and_plain_safetensors_can_read(tmp_path, key):
    from safetensors.torch import load_file

    tied, untied = make_state(tied=True), make_state()
    assert len(serialize_state(tied)) < len(serialize_state(untied)) + 200  # embedding not written twice
    pack_checkpoint(tied, tmp_path / "c", identity=key, step=3, run_id="r", shard_size=SHARD)
    unpack_checkpoint(tmp_path / "c", tmp_path / "o", trusted_keys={key.public_hex})
    plain = load_file(tmp_path / "o" / "model.safetensors")  # any safetensors reader works, sees one name
    assert "lm_head.weight" not in plain and torch.equal(plain["embed.weight"], tied["embed.weight"])
    assert_same_state(load_payload(tmp_path / "o" / "model.safetensors"), tied)


def test_pack_from_file_and_sharded_model_dir_matches_state(tmp_path, key):
    state = make_state()
    names = sorted(state)
    save_file(state, tmp_path / "one.safetensors")
    model = tmp_path / "model"
    model.mkdir()
    save_file({k: state[k] for k in names[:3]}, model / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({k: state[k] for k in names[3:]}, model / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (model / "config.json").write_text("{}")
    a = pack_checkpoint(state, tmp_path / "a", identity=key, step=0, run_id="r", shard_size=SHARD)
    b = pack_checkpoint(tmp_path / "one.safetensors", tmp_path / "b", identity=key, step=0, run_id="r", shard_size=SHARD)
    c = pack_checkpoint(model, tmp_path / "c", identity=key, step=0, run_id="r", shard_size=SHARD)
    assert a.sha256 == b.sha256 == c.sha256  # deterministic layout whatever the source


def test_reconstruct_from_any_shard_source(tmp_path, key):
    """A fetcher passes its own reader (peers, HTTP); here shards come from an in-memory dict."""
    state = make_state()
    m = pack_checkpoint(state, tmp_path / "c", identity=key, step=0, run_id="r", shard_size=SHARD, level=3)
    shards = {i: DirShardReader(tmp_path / "c", m)(i) for i in range(m.num_shards)}
    digest = reconstruct_payload(m, shards.__getitem__, tmp_path / "x.safetensors", threads=2)
    assert digest == m.sha256 and (tmp_path / "x.safetensors").read_bytes() == serialize_state(state)
    assert reconstruct_payload(m, shards.__getitem__, None) == m.sha256  # verify-only mode writes nothing


def test_delta_against_a_different_layout_is_refused(tmp_path, key):
    s0 = make_state(hidden=192)
    s1 = make_state(hidden=128)
    m0 = pack_checkpoint(s0, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=SHARD)
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(s1, tmp_path / "c1", identity=key, step=1, run_id="r", parent=m0,
                        base_payload=serialize_state(s0), shard_size=SHARD)
    assert e.value.code == "delta_layout" and "full" in str(e.value)
    assert not (tmp_path / "c1").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_pack_is_atomic_and_never_overwrites(tmp_path, key):
    state = make_state()
    state["bad"] = torch.zeros(3, dtype=torch.complex64)  # unsupported: fails after the temp dir exists
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        pack_checkpoint(state, tmp_path / "c", identity=key, step=0, run_id="r", shard_size=SHARD)
    assert os.listdir(tmp_path) == []
    pack_checkpoint(make_state(), tmp_path / "c", identity=key, step=0, run_id="r", shard_size=SHARD)
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(make_state(), tmp_path / "c", identity=key, step=1, run_id="r", shard_size=SHARD)
    assert e.value.code == "out_exists"


def test_pack_refuses_backwards_parent_and_pickle(tmp_path, key):
    m5 = pack_checkpoint(make_state(), tmp_path / "c5", identity=key, step=5, run_id="r", shard_size=SHARD)
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(make_state(), tmp_path / "c4", identity=key, step=4, run_id="r", parent=m5)
    assert e.value.code == "rollback"
    (tmp_path / "m").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        pack_checkpoint(tmp_path / "m", tmp_path / "c6", identity=key, step=6, run_id="r")
    with pytest.raises(CheckpointError) as e:
        load_payload(tmp_path / "m" / "pytorch_model.bin")
    assert e.value.code == "bad_payload"


def test_manifest_json_round_trip_and_hash(tmp_path, key):
    m = pack_checkpoint(make_state(), tmp_path / "c", identity=key, step=0, run_id="r", shard_size=SHARD)
    assert Manifest.from_json_bytes(m.to_json_bytes()) == m
    assert (tmp_path / "c" / "manifest.json").read_bytes() == m.to_json_bytes()
    body = {k: v for k, v in m.to_dict().items() if k != "signature"}
    from protocol.signing import canonical_json
    assert m.canonical_hash() == hashlib.sha256(canonical_json(body)).hexdigest()
    assert set(m.to_dict()) == {"format", "run_id", "step", "parent", "encoding", "base_step", "dtype",
                                "compression", "shard_size", "total_size", "sha256", "shards", "created_at",
                                "signer", "signature"}


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("encoding", ["full", "xor-delta", "sparse-delta"])
def test_payload_hash_in_order_whatever_the_workers_timing(tmp_path, key, monkeypatch, threads, encoding):
    """The workers hash the payload themselves, in order (the head shard's worker hashes its pieces as
    it writes them; shards written ahead are read back). Small pieces and a reader that stalls at random
    make the head move mid-shard, after a shard was finished, and several shards at once."""
    import random
    import time

    from protocol.checkpoint import reconstruct

    monkeypatch.setattr(reconstruct, "WRITE_CHUNK", 4096)
    monkeypatch.setattr(reconstruct, "READ_BACK_CHUNK", 3000)
    s0 = make_state()
    s1 = step_update(s0, lr=1e-3)
    p0 = serialize_state(s0)
    base = p0 if encoding != "full" else None
    m = pack_checkpoint(s1, tmp_path / "c", identity=key, step=1, run_id="r", shard_size=SHARD,
                        base_payload=base, base_step=0 if base is not None else None, encoding=encoding)
    assert m.num_shards >= 8
    reader = DirShardReader(tmp_path / "c", m)
    rng = random.Random(threads)

    def slow(i):
        time.sleep(rng.random() * 0.01)
        return reader(i)

    want = serialize_state(s1)
    for attempt in range(3):
        out = tmp_path / f"o{attempt}.safetensors"
        assert reconstruct_payload(m, slow, out, base_payload=base, threads=threads) == m.sha256
        assert out.read_bytes() == want
