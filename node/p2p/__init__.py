"""Peer-to-peer checkpoint distribution over libp2p (py-libp2p on trio, in its own thread).

Public API (asyncio side), see `node.p2p.host` for the full story:

    P2PNode(identity, cfg: P2PConfig, *, run_id, coordinator_key=None, shard_root=None | shard_source=None,
            name=None)                 every setting comes from cfg (node/p2p/config.py: keys, bounds, meaning)
    await node.start() -> list[str]            listen multiaddrs with /p2p/<peer id>; dials bootstrap
    await node.stop()                          idempotent; joins the trio thread
    await node.connect(addrs) -> list[str]     peer ids reached
    await node.connected_peers() -> list[str]
    await node.wait_for_mesh(peer, timeout_s=5) -> bool
    node.subscribe(maxsize=256) -> AnnouncementSubscription   (async iterator of AnnouncementEvent)
    node.add_listener(callback)
    await node.announce_manifest(step, manifest_hash)          coordinator
    await node.announce_have(step, indices, manifest_hash)     anyone holding shards
    node.peers_with(step, index, manifest_hash=None) -> list[str]
    node.manifest_hash(step) -> str | None ; node.latest_manifest() -> (step, hash) | None
    await node.fetch_shard(peer, step, index, max_bytes, *, manifest_hash=None, timeout_s=None) -> bytes
    node.stats.snapshot() / .bytes_served_by_peer() / .bytes_fetched_by_peer()
    node.peer_id, node.node_id, node.listen_addrs, node.announce_addrs, node.running

Shard stores: a directory `<root>/<step>/shards/NNNNN.zst` (+ `<root>/<step>/manifest.json` for
manifest-hash checks), a callable `(step, index) -> bytes | None`, or any object with
`open(step, index, manifest_hash) -> ShardBody | None`. `manifest_hash(manifest_dict)` is the sha256
of the canonical JSON of the manifest without its signature.

Nothing here imports libp2p or trio at import time; `P2PNode.start()` does.
"""
from __future__ import annotations

from typing import Any

_LAZY = {
    "P2PNode": "node.p2p.host",
    "AnnouncementSubscription": "node.p2p.host",
    "AnnouncementEvent": "node.p2p.announce",
    "HaveAnnouncement": "node.p2p.announce",
    "ManifestAnnouncement": "node.p2p.announce",
    "manifest_hash": "node.p2p.shard_store",
    "DirectoryShardStore": "node.p2p.shard_store",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'node.p2p' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
