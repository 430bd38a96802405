"""Publishes each new policy as a signed checkpoint into the coordinator's `CheckpointDir`, and prunes.

Step 0 and every `full_every` steps are `full`; the rest are xor-delta against the previous step.
With trainer.lora (a `BroadcastAdapter` given), every step after 0 is a `lora-adapter` checkpoint instead: the
adapter alone, its base the full step 0 pinned by its manifest hash (docs/PROTOCOL.md, "lora-adapter"); the
weights verification replays are the base merged with it by the protocol's `merge_lora`, the bytes every
worker rebuilds, also kept as the step's payload file.
Pruning keeps the last k + 1 steps plus the delta chain back to the newest full checkpoint at or
before the window's start, so a node that holds nothing can always rebuild the newest step; payloads
(delta bases, the LoRA base, and the weights verification replays) are kept for the window only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.checkpoint_dir import CheckpointDir
from node.trainer.lora import BroadcastAdapter
from protocol.checkpoint import (ADAPTER_ENCODING, CheckpointError, Manifest, load_payload, merge_lora,
                                 pack_checkpoint, write_state)
from protocol.checkpoint.adapter import A_SUFFIX, B_SUFFIX
from protocol.identity import Identity

log = logging.getLogger("prime_node.publisher")

LORA_BASE = 0  # the full step every adapter applies to


@dataclass
class Published:
    step: int
    manifest_hash: str
    encoding: str
    base_step: int | None
    compressed_bytes: int
    # the weights a worker rebuilds when they are not the state given (an adapter step: base + adapter), else None
    weights: dict[str, torch.Tensor] | None = None


def stack_adapters(now: BroadcastAdapter, at_base: BroadcastAdapter) -> BroadcastAdapter:
    """The adapter that takes the base step's weights to `now`'s: the base step was published merged with its
    own adapter (the warm start trains it), W_0 = W + s * B_0 @ A_0, so the step's adapter is
    [B_n | -B_0] @ [A_n ; A_0] = B_n @ A_n - B_0 @ A_0, rank 2r at alpha 2 * alpha (the same scale). An adapter
    still zero at the base (no warm start: B_0 = 0) is published as it is."""
    if now.rank != at_base.rank or now.alpha != at_base.alpha or now.tensors.keys() != at_base.tensors.keys():
        raise ValueError("the base step's adapter has other targets, rank or alpha than this step's")
    if not any(t.any() for n, t in at_base.tensors.items() if n.endswith(B_SUFFIX)):
        return now
    out = {}
    for name, t in now.tensors.items():
        old = at_base.tensors[name]
        out[name] = (torch.cat([t, old], dim=0) if name.endswith(A_SUFFIX) else torch.cat([t, -old], dim=1)).contiguous()
    return BroadcastAdapter(out, 2 * now.rank, 2 * now.alpha)


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
        self._base: tuple[str, dict[str, torch.Tensor]] | None = None  # (manifest hash, tensors) of the LoRA base

    def base_adapter_path(self) -> Path:
        """The adapter the LoRA base step was merged with (kept for every later step's `stack_adapters`; named so
        that CheckpointDir's payload pruning, which takes `{step}.safetensors` only, leaves it)."""
        return self.store.payload_dir / f"{LORA_BASE}.adapter.safetensors"

    def publish(self, step: int, state, adapter: BroadcastAdapter | None = None) -> Published:
        """Pack `state` as `step`: full at step 0 / every `full_every`, else xor-delta vs step - 1; with `adapter`
        (trainer.lora) a lora-adapter on step 0 for every step after 0."""
        if adapter is not None and step > LORA_BASE:
            pub = self._publish_adapter(step, adapter)
            if pub is not None:
                return pub
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
        if adapter is not None and step == LORA_BASE:
            write_state(adapter.tensors, self.base_adapter_path())
        store.published(step, manifest)
        return Published(step, manifest.canonical_hash(), manifest.encoding, manifest.base_step,
                         manifest.compressed_size)

    def _base_weights(self, base: Manifest) -> dict[str, torch.Tensor]:
        h = base.canonical_hash()
        if self._base is None or self._base[0] != h:
            self._base = (h, load_payload(self.store.payload_path(base.step)))
        return self._base[1]

    def _publish_adapter(self, step: int, adapter: BroadcastAdapter) -> Published | None:
        store = self.store
        base = store.manifest(LORA_BASE)
        if (base is None or base.encoding != "full" or not store.payload_path(LORA_BASE).is_file()
                or not self.base_adapter_path().is_file()):
            # e.g. a run started before adapters were published: its steps stay full weights
            log.warning("step %d: no LoRA base (full step %d, its payload and adapter) held; publishing full weights",
                        step, LORA_BASE)
            return None
        at_base = load_payload(self.base_adapter_path())
        sent = stack_adapters(adapter, BroadcastAdapter(at_base, adapter.rank, adapter.alpha))
        store.remove(step)  # a half-published step from before a crash: the ledger never recorded it
        manifest = pack_checkpoint(sent.tensors, store.step_dir(step), identity=self.identity, step=step,
                                   run_id=self.run_id, parent=store.manifest(step - 1), base_step=LORA_BASE,
                                   encoding=ADAPTER_ENCODING, shard_size=self.shard_size, level=self.level,
                                   lora={"base": base.canonical_hash(), "rank": sent.rank, "alpha": sent.alpha})
        # what every worker rebuilds from the same two payloads (protocol/checkpoint/adapter.py), kept as the step's
        # payload: verification replays it, a restarted coordinator reloads it
        weights = merge_lora(self._base_weights(base), sent.tensors, rank=sent.rank, alpha=sent.alpha)
        write_state(weights, store.payload_path(step))
        store.published(step, manifest)
        return Published(step, manifest.canonical_hash(), manifest.encoding, manifest.base_step,
                         manifest.compressed_size, weights)

    def prune(self, current: int) -> list[int]:
        """Keep the last k+1 steps and the delta chain back to a full checkpoint (for an adapter: its base).
        Returns removed."""
        steps = self.store.steps()
        window = {s for s in steps if s >= max(0, current - self.k)}
        keep = set(window)
        for s in window:
            keep.update(self.store.chain_to_full(s, set(steps)))
        return self.store.prune(keep, keep_payloads=window | self.store.adapter_bases(window))
