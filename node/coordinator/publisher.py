"""Publishes each new policy as a signed checkpoint into the coordinator's `CheckpointDir`, and prunes.

Step 0 and every `full_every` steps are `full`; the rest are xor-delta against the previous step.
Pruning keeps the last k + 1 steps plus the delta chain back to the newest full checkpoint at or
before the window's start, so a node that holds nothing can always rebuild the newest step; payloads
(delta bases, and the weights verification replays) are kept for the window only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node.checkpoint_dir import CheckpointDir
from protocol.checkpoint import CheckpointError, pack_checkpoint
from protocol.identity import Identity


@dataclass
class Published:
    step: int
    manifest_hash: str
    encoding: str
    base_step: int | None
    compressed_bytes: int


class Publisher:
    def __init__(self, store: CheckpointDir, identity: Identity, run_id: str, *, async_level: int, shard_size: int,
                 level: int, full_every: int):
        self.store = store
        self.identity = identity
        self.run_id = run_id
        self.k = async_level
        self.shard_size = shard_size
        self.level = level
        self.full_every = full_every

    def publish(self, step: int, state) -> Published:
        """Pack `state` as `step`: full at step 0 / every `full_every`, else xor-delta vs step - 1."""
        store, prev = self.store, step - 1
        parent = store.manifest(prev)
        base = store.payload_path(prev)
        delta = step % self.full_every != 0 and parent is not None and base.is_file()
        store.remove(step)  # a half-published step from before a crash: the ledger never recorded it
        common: dict[str, Any] = dict(identity=self.identity, step=step, run_id=self.run_id, parent=parent,
                                      shard_size=self.shard_size, level=self.level,
                                      payload_out=store.payload_path(step))
        out = store.step_dir(step)
        try:
            manifest = pack_checkpoint(state, out, base_payload=base if delta else None,
                                       base_step=prev if delta else None, **common)
        except CheckpointError as e:
            if e.code != "delta_layout":
                raise
            manifest = pack_checkpoint(state, out, **common)  # the tensor layout changed: send it whole
        store.published(step, manifest)
        return Published(step, manifest.canonical_hash(), manifest.encoding, manifest.base_step,
                         manifest.compressed_size)

    def prune(self, current: int) -> list[int]:
        """Keep the last k+1 steps and the delta chain back to a full checkpoint. Returns removed."""
        steps = self.store.steps()
        window = {s for s in steps if s >= max(0, current - self.k)}
        keep = set(window)
        for s in window:
            keep.update(self.store.chain_to_full(s, set(steps)))
        return self.store.prune(keep, keep_payloads=window)
