"""The worker's store stays bounded on disk: it keeps the delta chain back to a full checkpoint as shard files
(peers and relays serve it to nodes that hold nothing), but reconstructed payloads, a full model each, only of
the newest k + 1 steps and of any step an engine is loading. Real signed checkpoints (the coordinator's
Publisher: one full step, then xor-deltas) in a real CheckpointDir."""
from __future__ import annotations

import torch

from node.checkpoint_dir import CheckpointDir
from node.coordinator.publisher import Publisher
from node.worker.fetcher import Fetcher
from protocol.identity import Identity


def published(tmp_path, steps: int) -> tuple[CheckpointDir, Publisher]:
    store = CheckpointDir(tmp_path / "ckpt")
    pub = Publisher(store, Identity.generate(), "prune", async_level=2, shard_size=4096, level=1, full_every=1000)
    torch.manual_seed(0)
    state = {"w": torch.randn(4096, dtype=torch.float32)}
    for step in range(steps):
        state = {"w": state["w"] + 0.01 * torch.randn_like(state["w"])}
        pub.publish(step, state)
    return store, pub


def payloads(store: CheckpointDir) -> list[int]:
    return sorted(int(p.stem) for p in store.payload_dir.glob("*.safetensors"))


def test_chain_kept_as_shards_payloads_only_for_the_newest_k_plus_1(tmp_path):
    store, pub = published(tmp_path, 6)
    fetcher = Fetcher(store, [], pub.identity.public_hex, keep=3, on_new_step=lambda step, path: None)
    assert store.manifest(0).encoding == "full" and all(store.manifest(s).base_step == s - 1 for s in range(1, 6))
    fetcher.prune()
    assert store.steps() == list(range(6)) and payloads(store) == [3, 4, 5]
    # a second prune follows the chain through complete steps, not held payloads: nothing of it is lost
    pub.publish(6, {"w": torch.zeros(4096)})
    fetcher.prune()
    assert store.steps() == list(range(7)) and payloads(store) == [4, 5, 6]
    assert store.held_steps() == [4, 5, 6]


def test_the_payload_an_engine_is_loading_outlives_newer_steps(tmp_path):
    """The engine started loading step 1; meanwhile the fetcher committed steps 2-5 in one go and pruned (in
    the WAN lab a worker died of FileNotFoundError when its payload went). Once loaded, it may go."""
    store, pub = published(tmp_path, 6)
    loading: set[int] = {1}
    fetcher = Fetcher(store, [], pub.identity.public_hex, keep=3, on_new_step=lambda step, path: None,
                      in_use=lambda: loading)
    fetcher.prune()
    assert payloads(store) == [1, 3, 4, 5] and store.payload_path(1).is_file()
    loading.clear()
    fetcher.prune()
    assert payloads(store) == [3, 4, 5] and store.steps() == list(range(6))


def lora_published(tmp_path, steps: int) -> tuple[CheckpointDir, Publisher]:
    """A LoRA run's checkpoints as the coordinator publishes them: step 0 the full base, then adapter steps."""
    from node.trainer import lora
    from node.trainer.config import LoraConfig
    from tests.integration.test_verify_matrix import tiny_model

    store = CheckpointDir(tmp_path / "coord")
    pub = Publisher(store, Identity.generate(), "lora", async_level=2, shard_size=4096, level=1, full_every=1000)
    torch.manual_seed(0)
    model = lora.wrap(tiny_model(0), LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    pub.publish(0, lora.base_state_dict(model), adapter=lora.adapter_for_broadcast(model, torch.bfloat16))
    for step in range(1, steps):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.add_(0.01 * torch.randn_like(p))
        pub.publish(step, None, adapter=lora.adapter_for_broadcast(model, torch.bfloat16))
    return store, pub


async def test_a_worker_serving_adapters_unmerged_holds_them_unmerged_and_bounded(tmp_path):
    """worker.lora_serving = "adapter": the fetcher commits an adapter step as its rebuilt adapter, never merged into
    a full model (before, every step was merged, ~1 s and a full model on disk, then rebuilt again for the engine);
    the store counts it as held, prunes it like a payload, and a store opened in the merged mode does not take it for
    full weights."""
    import shutil

    from node.worker.backends import LoraAdapter

    coord, pub = lora_published(tmp_path, 6)
    assert [coord.manifest(s).encoding for s in range(6)] == ["full"] + ["lora-adapter"] * 5
    store = CheckpointDir(tmp_path / "worker", unmerged_adapters=True)
    fetcher = Fetcher(store, [], pub.identity.public_hex, keep=3, on_new_step=lambda step, path: None)
    for step in range(6):  # what a download leaves: the verified shard files in the partial directory
        m = coord.manifest(step)
        partial = store.begin(step, m)
        for i in range(m.num_shards):
            shutil.copy(coord.shard_path(step, i), partial / "shards" / coord.shard_path(step, i).name)
        await fetcher._commit(m)
    assert store.payload_path(0).is_file() and not any(store.payload_path(s).is_file() for s in range(1, 6))
    assert store.held_steps() == list(range(6)) and store.weights_path(5) == store.adapter_payload_path(5)
    assert store.adapter_payload_path(5).stat().st_size < store.payload_path(0).stat().st_size / 4
    # the engine's adapter is the fetcher's, the same as one rebuilt from the shards
    kept = LoraAdapter.from_store(store, 5)
    rebuilt = LoraAdapter.from_store(CheckpointDir(tmp_path / "worker"), 5)
    assert kept.pairs.keys() == rebuilt.pairs.keys() and kept.base == coord.manifest(0).canonical_hash()
    assert all(torch.equal(kept.pairs[k][0], rebuilt.pairs[k][0]) and torch.equal(kept.pairs[k][1], rebuilt.pairs[k][1])
               for k in kept.pairs)
    fetcher.prune()  # the newest k + 1 adapters and their base stay; older adapter files go
    held = sorted(p.name for p in store.payload_dir.glob("*.safetensors"))
    assert held == ["0.safetensors", "3.adapter.safetensors", "4.adapter.safetensors", "5.adapter.safetensors"]
    # the same directory opened by a worker restarted in the merged mode: only full weights count as held
    assert CheckpointDir(tmp_path / "worker").held_steps() == [0]
    store.remove(5)
    assert not store.adapter_payload_path(5).exists()
