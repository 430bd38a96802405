"""Who holds which shards, and which manifest each step has, as learned from announcements.

Lives on the asyncio side (one thread, no locks). Holdings grow within a step: a node announces shards as
it gets them, and each `have` adds to what we already know; a shard a peer then says it does not hold is
dropped (`drop_shard`: a lying or stale claim costs one refused request), and a peer that fails a fetch can
be forgotten with `forget`.

Bounded by what the coordinator has signed. A `have` costs no join (any libp2p key can send one), so a
step number in it is only a claim: the table keeps holdings for the window of `max_steps` steps ending at
the newest *signed* step it knows (a coordinator `manifest` announcement, or a manifest this node verified
itself: `note_manifest`), and a `have` whose step has a known signed manifest must name that manifest's
hash. A `have` for a step newer than the newest signed one is held aside (`_pending`: at most
`max_pending_per_peer` steps per peer and `max_pending` in all, and no more than `max_ahead` steps past
the newest signed step) until the coordinator's manifest for it arrives, and is never able to push a real
step out: far-future announcements from one key used to trim every real step from every node's table.
Within a step, at most `max_peers_per_step` peers (the oldest announcer is forgotten first).

Addresses are those a stranger may make us dial (addrs.py): with `allow_private_addrs` off, loopback,
private, link-local and the like are dropped from announcements and hints as they are recorded.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from .addrs import allowed_addrs
from .announce import HaveAnnouncement, ManifestAnnouncement


@dataclass
class _Holding:
    manifest_hash: str
    indices: set[int] = field(default_factory=set)
    addrs: tuple[str, ...] = ()
    ts_ms: int = 0


class PeerTable:
    def __init__(self, *, max_steps: int = 8, max_peers_per_step: int = 4096, allow_private_addrs: bool = False,
                 max_ahead: int = 2, max_pending: int = 1024, max_pending_per_peer: int = 2):
        self.max_steps = max_steps
        self.max_peers_per_step = max_peers_per_step
        self.allow_private_addrs = allow_private_addrs
        self.max_ahead = max_ahead
        self.max_pending = max_pending
        self.max_pending_per_peer = max_pending_per_peer
        self._holdings: dict[int, OrderedDict[str, _Holding]] = {}
        self._manifests: dict[int, tuple[str, int]] = {}  # step -> (signed manifest hash, ts_ms)
        # (step, peer) -> the announcement, for steps past the newest signed one; oldest first.
        self._pending: OrderedDict[tuple[int, str], HaveAnnouncement] = OrderedDict()
        self._pending_by_peer: dict[str, int] = {}

    # --- what the coordinator signed ------------------------------------------------------------
    def record_manifest(self, ann: ManifestAnnouncement) -> None:
        """The coordinator's (verified) announcement of a signed manifest."""
        self._signed(ann.step, ann.manifest_hash, ann.ts_ms)

    def note_manifest(self, step: int, manifest_hash: str) -> None:
        """A manifest this node verified against the coordinator's key itself (the fetcher's): it bounds
        announcements like a `manifest` announcement does, so a node that missed the gossip is not stuck."""
        current = self._manifests.get(step)
        if current is None or current[0] != manifest_hash:  # the fetcher says so for every shard: once is enough
            self._signed(step, manifest_hash, 0)

    def _signed(self, step: int, manifest_hash: str, ts_ms: int) -> None:
        current = self._manifests.get(step)
        if current is None or ts_ms >= current[1]:
            self._manifests[step] = (manifest_hash, ts_ms)
        for old in sorted(self._manifests)[:-self.max_steps]:
            del self._manifests[old]
        newest = self.newest_signed_step()
        for old in [s for s in self._holdings if s <= newest - self.max_steps]:  # out of the window
            del self._holdings[old]
        if self._pending:
            self._release_pending(newest)

    def newest_signed_step(self) -> int:
        """The newest step with a signed manifest known here, -1 if none."""
        return max(self._manifests) if self._manifests else -1

    def _in_window(self, step: int) -> bool:
        newest = self.newest_signed_step()
        return newest - self.max_steps < step <= newest

    # --- announcements --------------------------------------------------------------------------
    def record_have(self, peer: str, ann: HaveAnnouncement) -> bool:
        """Record a verified `have`. False if it was dropped (outside the window, or a manifest other than
        the signed one for its step); a `have` for a step not yet signed is held (True) until it is."""
        newest = self.newest_signed_step()
        if ann.step > newest:
            return self._hold(peer, ann, newest)
        return self._apply(peer, ann)

    def _apply(self, peer: str, ann: HaveAnnouncement) -> bool:
        signed = self._manifests.get(ann.step)
        if not self._in_window(ann.step) or (signed is not None and signed[0] != ann.manifest_hash):
            return False
        held = self._holding(peer, ann.step, ann.manifest_hash)
        held.indices.update(ann.indices)
        if ann.ts_ms >= held.ts_ms:
            held.addrs, held.ts_ms = allowed_addrs(ann.addrs, self.allow_private_addrs), ann.ts_ms
        return True

    def _hold(self, peer: str, ann: HaveAnnouncement, newest: int) -> bool:
        """Keep a `have` for a not-yet-signed step aside, within the pending bounds. Before anything is signed
        (newest = -1) any step may wait; after, only the next `max_ahead` steps (the manifest's gossip and a
        fast node's `have` can arrive in either order)."""
        if newest >= 0 and ann.step > newest + self.max_ahead:
            return False
        key = (ann.step, peer)
        if key in self._pending:
            old = self._pending[key]
            if old.manifest_hash == ann.manifest_hash:  # keep the union, as _apply would
                ann = ann.model_copy(update={"indices": sorted(set(old.indices) | set(ann.indices))})
            self._pending[key] = ann
            self._pending.move_to_end(key)
            return True
        if self._pending_by_peer.get(peer, 0) >= self.max_pending_per_peer:  # a peer replaces its own oldest
            self._unpend(next(k for k in self._pending if k[1] == peer))
        while len(self._pending) >= self.max_pending:
            self._unpend(next(iter(self._pending)))
        self._pending[key] = ann
        self._pending_by_peer[peer] = self._pending_by_peer.get(peer, 0) + 1
        return True

    def _unpend(self, key: tuple[int, str]) -> HaveAnnouncement:
        ann = self._pending.pop(key)
        n = self._pending_by_peer[key[1]] - 1
        if n:
            self._pending_by_peer[key[1]] = n
        else:
            del self._pending_by_peer[key[1]]
        return ann

    def _release_pending(self, newest: int) -> None:
        """Apply the held `have`s whose step is now signed (in arrival order); drop those too far ahead."""
        for key in [k for k in self._pending if k[0] <= newest or k[0] > newest + self.max_ahead]:
            ann = self._unpend(key)
            if key[0] <= newest:
                self._apply(key[1], ann)

    def record_hint(self, peer: str, step: int, manifest_hash: str, indices: Iterable[int], addr: str | None = None) -> None:
        """Peer holds these shards (the origin named it as a first holder, or its own HTTP shard server said
        so): like a `have` with at most one address, and under the same window."""
        signed = self._manifests.get(step)
        if not self._in_window(step) or (signed is not None and signed[0] != manifest_hash):
            return
        held = self._holding(peer, step, manifest_hash)
        held.indices.update(indices)
        if addr is not None and addr not in held.addrs and allowed_addrs((addr,), self.allow_private_addrs):
            held.addrs = (*held.addrs, addr)[-8:]

    def usable_addrs(self, addrs: Iterable[str]) -> tuple[str, ...]:
        """The addresses of `addrs` this table would keep (the node's address policy)."""
        return allowed_addrs(addrs, self.allow_private_addrs)

    def _holding(self, peer: str, step: int, manifest_hash: str) -> _Holding:
        """What `peer` holds of `step`, made the newest entry (within the per-step bound)."""
        peers = self._holdings.setdefault(step, OrderedDict())
        held = peers.get(peer)
        if held is None or held.manifest_hash != manifest_hash:
            # A different checkpoint under the same step number replaces what we knew.
            held = _Holding(manifest_hash)
        peers[peer] = held
        peers.move_to_end(peer)
        while len(peers) > self.max_peers_per_step:
            peers.popitem(last=False)
        return held

    # --- queries --------------------------------------------------------------------------------
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
        peers: dict[str, _Holding] = self._holdings.get(step, {})
        return [p for p, h in reversed(peers.items())
                if index in h.indices and (manifest_hash is None or h.manifest_hash == manifest_hash)]

    def peer_count(self) -> int:
        """Distinct peers that announced holdings of any step we remember."""
        return len({p for peers in self._holdings.values() for p in peers})

    def pending_count(self) -> int:
        """`have`s held until their step is signed."""
        return len(self._pending)

    def addrs_of(self, peer: str) -> tuple[str, ...]:
        for step in sorted(self._holdings, reverse=True):
            held = self._holdings[step].get(peer)
            if held is not None and held.addrs:
                return held.addrs
        return ()

    def direct_peers(self, limit: int = 64) -> list[str]:
        """Peers that announced a direct libp2p address (reachable ones: since #26 nobody announces another
        kind but a relay circuit), newest announcers of the newest steps first; at most `limit`."""
        out: list[str] = []
        for step in sorted(self._holdings, reverse=True):
            for peer, held in reversed(self._holdings[step].items()):
                if peer not in out and any("/p2p/" in a and "/p2p-circuit" not in a for a in held.addrs):
                    out.append(peer)
                    if len(out) >= limit:
                        return out
        return out

    def drop_shard(self, peer: str, step: int, index: int) -> None:
        peers: dict[str, _Holding] = self._holdings.get(step, {})
        held = peers.get(peer)
        if held is not None:
            held.indices.discard(index)

    def forget(self, peer: str) -> None:
        for peers in self._holdings.values():
            peers.pop(peer, None)
