"""Per-peer transfer counters (for `checkpoint_bytes_by_source`) and announcement drop counts.

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
        self._serve_refused: Counter[str] = Counter()

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

    def count_dropped(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] += 1

    def count_received(self, kind: str) -> None:
        with self._lock:
            self._received[kind] += 1

    def count_refused(self, status: str) -> None:
        with self._lock:
            self._serve_refused[status] += 1

    def bytes_served_by_peer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._served)

    def bytes_fetched_by_peer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fetched)

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

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
                "requests_refused": dict(self._serve_refused),
            }
