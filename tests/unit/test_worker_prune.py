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
