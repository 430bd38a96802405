"""Who holds which shards, and which manifest each step has, as learned from announcements.

Lives on the asyncio side (one thread, no locks). Bounded: only the newest `max_steps` steps are
kept (the coordinator keeps k+1 checkpoints; anything older is useless), and at most
`max_peers_per_step` peers per step (the oldest announcer is forgotten first).
Holdings grow within a step: a node announces shards as it gets them, and each `have` adds to what we
already know; a shard a peer then says it does not hold is dropped (`drop_shard`: a lying or stale claim
costs one refused request), and a peer that fails a fetch can be forgotten with `forget`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from .announce import HaveAnnouncement, ManifestAnnouncement


@dataclass
class _Holding:
    manifest_hash: str
    indices: set[int] = field(default_factory=set)
    addrs: tuple[str, ...] = ()
    ts_ms: int = 0


class PeerTable:
    def __init__(self, *, max_steps: int = 8, max_peers_per_step: int = 4096):
        self.max_steps = max_steps
        self.max_peers_per_step = max_peers_per_step
        self._holdings: dict[int, OrderedDict[str, _Holding]] = {}
        self._manifests: dict[int, tuple[str, int]] = {}  # step -> (manifest hash, ts_ms)

    def record_manifest(self, ann: ManifestAnnouncement) -> None:
        current = self._manifests.get(ann.step)
        if current is None or ann.ts_ms >= current[1]:
            self._manifests[ann.step] = (ann.manifest_hash, ann.ts_ms)
        self._trim(self._manifests)

    def record_have(self, peer: str, ann: HaveAnnouncement) -> None:
        held = self._holding(peer, ann.step, ann.manifest_hash)
        held.indices.update(ann.indices)
        if ann.ts_ms >= held.ts_ms:
            held.addrs, held.ts_ms = tuple(ann.addrs), ann.ts_ms

    def record_hint(self, peer: str, step: int, manifest_hash: str, indices: Iterable[int], addr: str | None = None) -> None:
        """Peer holds these shards (the origin named it as a first holder, or its own HTTP shard server said
        so): like a `have` with at most one address."""
        held = self._holding(peer, step, manifest_hash)
        held.indices.update(indices)
        if addr is not None and addr not in held.addrs:
            held.addrs = (*held.addrs, addr)[-8:]

    def _holding(self, peer: str, step: int, manifest_hash: str) -> _Holding:
        """What `peer` holds of `step`, made the newest entry (within both bounds)."""
        peers = self._holdings.setdefault(step, OrderedDict())
        held = peers.get(peer)
        if held is None or held.manifest_hash != manifest_hash:
            # A different checkpoint under the same step number replaces what we knew.
            held = _Holding(manifest_hash)
        peers[peer] = held
        peers.move_to_end(peer)
        while len(peers) > self.max_peers_per_step:
            peers.popitem(last=False)
        self._trim(self._holdings)
        return held

    def _trim(self, by_step: dict) -> None:
        for step in sorted(by_step)[:-self.max_steps]:
            del by_step[step]

    def manifest_hash(self, step: int) -> str | None:
        entry = self._manifests.get(step)
        return entry[0] if entry else None

    def latest_manifest(self) -> tuple[int, str] | None:
        if not self._manifests:
            return None
        step = max(self._manifests)
        return step, self._manifests[step][0]

    def peers_with(self, step: int, index: int, manifest_hash: str | None = None) -> list[str]:
        """Peers that announced shard `index` of `step` (of `manifest_hash`, if given), newest first."""
        peers = self._holdings.get(step, {})
        return [p for p, h in reversed(peers.items())
                if index in h.indices and (manifest_hash is None or h.manifest_hash == manifest_hash)]

    def peer_count(self) -> int:
        """Distinct peers that announced holdings of any step we remember."""
        return len({p for peers in self._holdings.values() for p in peers})

    def addrs_of(self, peer: str) -> tuple[str, ...]:
        for step in sorted(self._holdings, reverse=True):
            held = self._holdings[step].get(peer)
            if held is not None and held.addrs:
                return held.addrs
        return ()

    def drop_shard(self, peer: str, step: int, index: int) -> None:
        held = self._holdings.get(step, {}).get(peer)
        if held is not None:
            held.indices.discard(index)

    def forget(self, peer: str) -> None:
        for peers in self._holdings.values():
            peers.pop(peer, None)
