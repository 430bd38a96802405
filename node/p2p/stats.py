"""Per-peer transfer counters (for `checkpoint_bytes_by_source`), announcement drop counts (by reason
and by forwarding peer) and shard-stream refusals. `snapshot()` is the JSON-ready view a caller
exports (e.g. to /metrics or a status page).

Written by the trio thread, read by the asyncio thread: every access holds one lock. Keys are
peer ids (base58); the number of peers is bounded by the connections a node accepts.
"""
from __future__ import annotations

import threading
from collections import Counter


class P2PStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: Counter[str] = Counter()
        self._fetched: Counter[str] = Counter()
        self._shards_served: Counter[str] = Counter()
        self._shards_fetched: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._dropped_by_peer: Counter[str] = Counter()
        self._serve_refused: Counter[str] = Counter()
        self._serve_aborted: Counter[str] = Counter()
        self._undelivered = 0

    def add_served(self, peer: str, n: int, *, shard_done: bool = False) -> None:
        with self._lock:
            self._served[peer] += n
            if shard_done:
                self._shards_served[peer] += 1

    def add_fetched(self, peer: str, n: int, *, shard_done: bool = False) -> None:
        with self._lock:
            self._fetched[peer] += n
            if shard_done:
                self._shards_fetched[peer] += 1

    def count_dropped(self, reason: str, peer: str | None = None) -> None:
        """An announcement dropped for `reason`; `peer`: the forwarding peer it came from."""
        with self._lock:
            self._dropped[reason] += 1
            if peer is not None:
                self._dropped_by_peer[peer] += 1

    def count_undelivered(self, n: int = 1) -> None:
        """A valid announcement a local subscriber had no room for (it fell behind)."""
        with self._lock:
            self._undelivered += n

    def count_received(self, kind: str) -> None:
        with self._lock:
            self._received[kind] += 1

    def count_refused(self, status: str) -> None:
        with self._lock:
            self._serve_refused[status] += 1

    def count_aborted(self, reason: str) -> None:
        """A shard stream cut before its response was complete (no request in time, client gone, stall)."""
        with self._lock:
            self._serve_aborted[reason] += 1

    def bytes_served_by_peer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._served)

    def bytes_fetched_by_peer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fetched)

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

    def dropped_by_peer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped_by_peer)

    def snapshot(self) -> dict:
        """A JSON-ready copy of every counter."""
        with self._lock:
            return {
                "bytes_served_by_peer": dict(self._served),
                "bytes_fetched_by_peer": dict(self._fetched),
                "shards_served_by_peer": dict(self._shards_served),
                "shards_fetched_by_peer": dict(self._shards_fetched),
                "bytes_served": sum(self._served.values()),
                "bytes_fetched": sum(self._fetched.values()),
                "announcements_received": dict(self._received),
                "announcements_dropped": dict(self._dropped),
                "announcements_dropped_by_peer": dict(self._dropped_by_peer),
                "announcements_undelivered": self._undelivered,
                "requests_refused": dict(self._serve_refused),
                "streams_aborted": dict(self._serve_aborted),
            }
