"""LoRA adapter checkpoints (encoding "lora-adapter", protocol/checkpoint/adapter.py; docs/PROTOCOL.md,
"lora-adapter"): a real trainer with peft publishes through the real Publisher (signed with Ed25519, zstd shards); a
worker's path (verify, rebuild the adapter payload, merge into the pinned base) gives the weights verification
replays, bit for bit, and the trainer's own merged model within the broadcast dtype's rounding; hostile adapters,
bases and manifests are refused with a clear CheckpointError; a reader without the encoding refuses it in one line."""
from __future__ import annotations

import shutil

import pytest
import torch

import protocol.checkpoint.manifest as manifest_module
from node.checkpoint_dir import CheckpointDir
from node.coordinator.publisher import Publisher
from node.trainer import Trainer, lora
from node.trainer.config import TrainerConfig
from node.trainer.model import build_tiny_model_dir
from node.worker.fetcher import Fetcher
from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, load_manifest, load_payload,
                                 merge_adapter_payload, merge_lora, pack_checkpoint, reconstruct_payload,
                                 scan_shard_dir, sign_manifest, verify_manifest)
from protocol.checkpoint.shard_files import shard_relpath
from protocol.identity import Identity
from tests.unit.test_trainer_step import make_groups, train_batches

RANK, ALPHA = 4, 8
SHARD = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=11)


@pytest.fixture(scope="module")
def key():
    return Identity.generate()


def _publisher(root, key) -> Publisher:
    return Publisher(CheckpointDir(root), key, "run", async_level=1, shard_size=SHARD, level=3, full_every=1000)


def _run(model_dir, root, key, *, dtype: str, warm: bool, steps: int = 2):
    """A LoRA trainer publishing steps 0..steps; returns (trainer, publisher, {step: Published}, {step: trainer's
    own merged weights in the broadcast dtype})."""
    t = Trainer(model_dir, TrainerConfig(lr=1e-2, broadcast_dtype=dtype, lora=dict(rank=RANK, alpha=ALPHA)),
                batch_prompts=2)
    if warm:  # an adapter not zero at step 0: a run warm-started through its adapters by an older version
        # (the warm start now trains the base, lora.base_trainable); the publisher still stacks such an adapter
        train_batches(t, [make_groups(2, seed=77)])
    pub = _publisher(root, key)
    out, own = {}, {}
    for step in range(steps + 1):
        if step:
            train_batches(t, [make_groups(2, seed=300 + step)])
        own[step] = t.weights_for_broadcast()
        out[step] = pub.publish(step, own[step], adapter=t.adapter_for_broadcast())
    return t, pub, out, own


def _worker_rebuild(root, step: int, key, tmp_path) -> dict[str, torch.Tensor]:
    """What a worker's fetcher does with the published directories: verify the signed manifest, rebuild the
    adapter payload from its shards, merge it into the held base (the full step 0, rebuilt the same way)."""
    store = CheckpointDir(root)
    base_dir, step_dir = store.step_dir(0), store.step_dir(step)
    base_m, m = load_manifest(base_dir), load_manifest(step_dir)
    verify_manifest(base_m, {key.public_hex})
    verify_manifest(m, {key.public_hex})
    assert not scan_shard_dir(step_dir, m)
    base_payload, adapter_payload = tmp_path / "base.safetensors", tmp_path / f"adapter-{step}.safetensors"
    reconstruct_payload(base_m, DirShardReader(base_dir, base_m), base_payload)
    reconstruct_payload(m, DirShardReader(step_dir, m), adapter_payload)
    return merge_adapter_payload(m, adapter_payload, base_m, base_payload, tmp_path / f"merged-{step}.safetensors")


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the bfloat16 spacing at the tensor's largest magnitude (an element near zero gets
    its value from a sum of larger terms, each rounded at its own magnitude)."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().max().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return float((a.float() - b.float()).abs().max() / spacing)


def test_fp32_adapter_steps_rebuild_bit_identical_to_the_trainer(model_dir, key, tmp_path):
    root = tmp_path / "coord"
    t, pub, published, own = _run(model_dir, root, key, dtype="float32", warm=False)
    assert [published[s].encoding for s in (0, 1, 2)] == ["full", "lora-adapter", "lora-adapter"]
    store = CheckpointDir(root)
    for step in (1, 2):
        m = store.manifest(step)
        assert m.base_step == 0 and m.lora is not None
        assert (m.lora.base, m.lora.rank, m.lora.alpha) == (store.manifest(0).canonical_hash(), RANK, ALPHA)
        assert m.parent == store.manifest(step - 1).canonical_hash()
        merged = _worker_rebuild(root, step, key, tmp_path)
        assert merged.keys() == own[step].keys()
        for name, w in own[step].items():  # no warm start: W + s * B @ A on the same fp32 inputs, the same function
            assert torch.equal(merged[name], w), name
            assert torch.equal(merged[name], published[step].weights[name]), name
        print(f"step {step}: adapter {m.compressed_size} B compressed vs full {store.manifest(0).compressed_size} B")
    # what the coordinator keeps as the step's payload (a restart's verification weights) is the same merge
    assert all(torch.equal(load_payload(store.payload_path(2))[n], w) for n, w in published[2].weights.items())


def test_bf16_after_a_warm_start_stacks_the_base_adapter_and_stays_within_rounding(model_dir, key, tmp_path):
    root = tmp_path / "coord"
    t, pub, published, own = _run(model_dir, root, key, dtype="bfloat16", warm=True)
    store = CheckpointDir(root)
    m = store.manifest(2)
    # the step-0 full payload already holds the warm start's B_0 @ A_0: the adapter undoes it (rank 2r, alpha 2a)
    assert (m.lora.rank, m.lora.alpha) == (2 * RANK, 2 * ALPHA)
    merged = _worker_rebuild(root, 2, key, tmp_path)
    worst = 0.0
    for name, w in own[2].items():
        assert torch.equal(merged[name], published[2].weights[name]), name  # worker == verifier, bit for bit
        worst = max(worst, _bf16_ulps(merged[name], w))
    # vs the trainer's bf16(W + s B_n A_n): the base's bf16 rounding, bf16 adapter factors, one more cast
    print(f"bf16 after warm start: worker vs trainer max {worst:.2f} bf16 ulps")
    assert worst <= 4.0
    targets = [n for n in own[2] if n.endswith("q_proj.weight")]
    assert targets and any(not torch.equal(merged[n], load_payload(store.payload_path(0))[n]) for n in targets)


def test_the_base_an_adapter_needs_is_pinned_and_kept(model_dir, key, tmp_path):
    root = tmp_path / "coord"
    _run(model_dir, root, key, dtype="bfloat16", warm=False, steps=4)
    store = CheckpointDir(root)
    pub = _publisher(root, key)
    pub.prune(4)  # window k + 1 = steps 3, 4; the base (full step 0) stays with its payload
    assert store.steps() == [0, 3, 4] and store.held_steps() == [0, 3, 4]

    # a worker holding the same steps prunes the same way (node/worker/fetcher.py)
    worker = CheckpointDir(tmp_path / "worker")
    for s in store.steps():
        shutil.copytree(store.step_dir(s), worker.step_dir(s))
        shutil.copy(store.payload_path(s), worker.payload_path(s))
    Fetcher(worker, [], key.public_hex, keep=1, on_new_step=lambda s, p: None).prune()
    assert worker.steps() == [0, 4] and worker.held_steps() == [0, 4]

    # an adapter whose pinned base is another full checkpoint than the one held is refused
    other = pack_checkpoint({"x": torch.zeros(4)}, tmp_path / "other", identity=key, step=0, run_id="run")
    with pytest.raises(CheckpointError, match="LoRA adapter on the step 0 checkpoint") as e:
        merge_adapter_payload(store.manifest(4), b"", other, b"", tmp_path / "never")
    assert e.value.code == "base_mismatch" and not (tmp_path / "never").exists()


def test_a_restarted_publisher_goes_on_publishing_adapters(model_dir, key, tmp_path):
    """A coordinator restart: a new Publisher on the same store finds the base, its payload and its adapter on disk,
    and the next step is an adapter again, merged as the worker merges it."""
    root = tmp_path / "coord"
    t, _, published, own = _run(model_dir, root, key, dtype="bfloat16", warm=True, steps=1)
    train_batches(t, [make_groups(2, seed=999)])
    again = _publisher(root, key).publish(2, t.weights_for_broadcast(), adapter=t.adapter_for_broadcast())
    assert again.encoding == "lora-adapter" and again.base_step == 0
    merged = _worker_rebuild(root, 2, key, tmp_path)
    assert all(torch.equal(merged[n], w) for n, w in again.weights.items())
    # without the base's adapter (a store from before adapters were published) the step goes out full
    CheckpointDir(root).payload_dir.joinpath("0.adapter.safetensors").unlink()
    train_batches(t, [make_groups(2, seed=1000)])
    assert _publisher(root, key).publish(3, t.weights_for_broadcast(), adapter=t.adapter_for_broadcast()).encoding \
        in ("full", "xor-delta")


def _adapter_manifest_fields(key, **lora) -> dict:
    return {"run_id": "run", "step": 1, "parent": None, "encoding": "lora-adapter", "base_step": 0,
            "lora": {"base": "ab" * 32, "rank": 4, "alpha": 8, **lora}, "dtype": "bfloat16",
            "compression": {"codec": "zstd", "level": 3}, "shard_size": SHARD, "total_size": 100,
            "sha256": "cd" * 32, "shards": [{"index": 0, "size": 100, "zsize": 50, "sha256": "ef" * 32}]}


@pytest.mark.parametrize("change,match", [
    ({"lora": {"base": "ab" * 32, "rank": 4096, "alpha": 8}}, "lora.rank"),
    ({"lora": {"base": "ab" * 32, "rank": 0, "alpha": 8}}, "lora.rank"),
    ({"lora": {"base": "ab" * 32, "rank": 4, "alpha": 1 << 21}}, "lora.alpha"),
    ({"lora": {"base": "ab" * 32, "rank": 4, "alpha": 8.0}}, "lora.alpha"),
    ({"lora": {"base": "nothex", "rank": 4, "alpha": 8}}, "lora.base"),
    ({"lora": {"base": "ab" * 32, "rank": 4, "alpha": 8, "extra": 1}}, "lora.extra"),
    ({"lora": None}, "lora is required"),
    ({"base_step": None}, "base_step is required"),
    ({"base_step": 1}, "must be before step"),
    ({"encoding": "full", "base_step": None}, "allowed for no other"),
])
def test_hostile_adapter_manifests_are_refused(key, change, match):
    fields = {**_adapter_manifest_fields(key), **change}
    if fields["lora"] is None:
        del fields["lora"]
    with pytest.raises(CheckpointError, match=match) as e:
        sign_manifest(key, fields)
    assert e.value.code == "manifest_schema"


def test_an_old_reader_refuses_the_encoding_in_one_line(key, monkeypatch):
    doc = sign_manifest(key, _adapter_manifest_fields(key)).to_dict()
    assert Manifest.from_dict(doc).is_adapter  # this reader knows it
    monkeypatch.setattr(manifest_module, "ENCODINGS", ("full", "xor-delta", "sparse-delta"))  # a reader before it
    with pytest.raises(CheckpointError) as e:
        Manifest.from_dict(doc)
    assert e.value.code == "unknown_encoding"
    line = e.value.line()
    assert "\n" not in line and "'lora-adapter' is not an encoding this reader knows" in line, line
    assert "upgrade prime-node" in line


def test_a_full_manifest_is_unchanged_by_the_new_field(key, tmp_path):
    m = pack_checkpoint({"x": torch.ones(8)}, tmp_path / "c", identity=key, step=0, run_id="run")
    assert "lora" not in m.to_dict() and b"lora" not in (tmp_path / "c" / "manifest.json").read_bytes()
    verify_manifest(load_manifest(tmp_path / "c"), {key.public_hex})


def _base():
    g = torch.Generator().manual_seed(0)
    return {"l.q.weight": torch.randn(6, 5, generator=g), "l.q.bias": torch.randn(6, generator=g)}


def _pair(rank=2, out=6, inp=5, module="l.q"):
    return {f"{module}.lora_A": torch.ones(rank, inp), f"{module}.lora_B": torch.ones(out, rank)}


@pytest.mark.parametrize("adapter,rank,match", [
    ({"l.q.lora_C": torch.ones(2, 5)}, 2, "neither"),
    ({"l.q.lora_A": torch.ones(2, 5)}, 2, "lacks l.q.lora_B"),
    (_pair(rank=3), 2, "rank is 2"),
    (_pair(out=7), 2, "but l.q.weight is"),
    (_pair(module="l.k"), 2, "the base has no tensor 'l.k.weight'"),
    (_pair(module="l.q.bias"[:-5] + ".nope"), 2, "no tensor"),
    ({"l.q.lora_A": torch.ones(2, 5, dtype=torch.int32), "l.q.lora_B": torch.ones(6, 2)}, 2, "not a float"),
    ({"l.q.lora_A": torch.ones(2, 5, 1), "l.q.lora_B": torch.ones(6, 2)}, 2, "not a matrix"),
    ({}, 2, "no tensor"),
])
def test_hostile_adapters_are_refused(adapter, rank, match):
    with pytest.raises(CheckpointError, match=match) as e:
        merge_lora(_base(), adapter, rank=rank, alpha=4)
    assert e.value.code == "bad_adapter"


def test_merge_formula(key):
    base, adapter = _base(), {"l.q.lora_A": torch.randn(2, 5), "l.q.lora_B": torch.randn(6, 2)}
    out = merge_lora(base, adapter, rank=2, alpha=3)
    want = base["l.q.weight"] + (adapter["l.q.lora_B"] @ adapter["l.q.lora_A"]) * 1.5
    assert torch.equal(out["l.q.weight"], want) and out["l.q.bias"] is base["l.q.bias"]
    half = merge_lora({k: v.to(torch.bfloat16) for k, v in base.items()}, adapter, rank=2, alpha=3)
    assert half["l.q.weight"].dtype == torch.bfloat16  # fp32 math, cast back to the base's dtype
    assert torch.equal(half["l.q.weight"], (base["l.q.weight"].to(torch.bfloat16).float()
                                            + (adapter["l.q.lora_B"] @ adapter["l.q.lora_A"]) * 1.5).to(torch.bfloat16))


def test_a_truncated_adapter_shard_is_refused(model_dir, key, tmp_path):
    root = tmp_path / "coord"
    _run(model_dir, root, key, dtype="bfloat16", warm=False, steps=1)
    store = CheckpointDir(root)
    m = store.manifest(1)
    shard = store.step_dir(1) / shard_relpath(0)
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CheckpointError) as e:
        reconstruct_payload(m, DirShardReader(store.step_dir(1), m), tmp_path / "adapter.safetensors")
    assert e.value.code == "shard_size" and e.value.shard == 0 and not (tmp_path / "adapter.safetensors").exists()
