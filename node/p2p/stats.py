"""Per-peer transfer counters (for `checkpoint_bytes_by_source`), announcement drop counts (by reason
and by forwarding peer) and shard-stream refusals. `snapshot()` is the JSON-ready view a caller
exports (e.g. to a status page); `totals()` is the part without per-peer counts, what /metrics reads.

Written by the trio thread, read by the asyncio thread: every access holds one lock.

Bounded: peer ids cost a stranger nothing (a fresh libp2p key, or a fresh source port over HTTP), so per-peer
counters are kept for the `max_peers` most recently active peers; a peer pushed out is added to one
"other" entry, so sums stay whole. Reasons are the code's own strings, so those counters are bounded by it.
Totals are kept as running sums: a scrape copies a few reason counters, never the per-peer tables.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict

OTHER = "other"  # the peers pushed out of the per-peer tables, together
MAX_PEERS = 256
_SERVED, _FETCHED, _SHARDS_SERVED, _SHARDS_FETCHED = range(4)


class _PeerCounters:
    """peer -> fixed-size row of counters, least recently active first, at most `max_peers` rows + OTHER."""

    def __init__(self, max_peers: int, width: int):
        self.max_peers, self.width = max_peers, width
        self.rows: OrderedDict[str, list[int]] = OrderedDict()
        self.other = [0] * width

    def add(self, peer: str, slot: int, n: int) -> None:
        row = self.rows.get(peer)
        if row is None:
            if len(self.rows) >= self.max_peers:
                _, old = self.rows.popitem(last=False)
                self.other = [a + b for a, b in zip(self.other, old)]
            row = self.rows[peer] = [0] * self.width
        else:
            self.rows.move_to_end(peer)
        row[slot] += n

    def column(self, slot: int) -> dict[str, int]:
        out = {p: row[slot] for p, row in self.rows.items() if row[slot]}
        if self.other[slot]:
            out[OTHER] = out.get(OTHER, 0) + self.other[slot]
        return out


class P2PStats:
    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._lock = threading.Lock()
        self._by_peer = _PeerCounters(max_peers, 4)
        self._dropped_by_peer = _PeerCounters(max_peers, 1)
        self._bytes_served = 0
        self._bytes_fetched = 0
        self._dropped: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._serve_refused: Counter[str] = Counter()
        self._serve_aborted: Counter[str] = Counter()
        self._undelivered = 0
        self._have_named = self._have_quiet = 0

    def add_served(self, peer: str, n: int, *, shard_done: bool = False) -> None:
        with self._lock:
            self._bytes_served += n
            self._by_peer.add(peer, _SERVED, n)
            if shard_done:
                self._by_peer.add(peer, _SHARDS_SERVED, 1)

    def add_fetched(self, peer: str, n: int, *, shard_done: bool = False) -> None:
        with self._lock:
            self._bytes_fetched += n
            self._by_peer.add(peer, _FETCHED, n)
            if shard_done:
                self._by_peer.add(peer, _SHARDS_FETCHED, 1)

    def count_dropped(self, reason: str, peer: str | None = None) -> None:
        """An announcement dropped for `reason`; `peer`: the forwarding peer it came from."""
        with self._lock:
            self._dropped[reason] += 1
            if peer is not None:
                self._dropped_by_peer.add(peer, 0, 1)

    def count_undelivered(self, n: int = 1) -> None:
        """A valid announcement a local subscriber had no room for (it fell behind)."""
        with self._lock:
            self._undelivered += n

    def count_received(self, kind: str) -> None:
        with self._lock:
            self._received[kind] += 1

    def count_have_shards(self, *, named: int, quiet: int) -> None:
        """Shards our `have`s named, and those left out as not worth naming (P2PNode.worth_naming)."""
        with self._lock:
            self._have_named += named
            self._have_quiet += quiet

    def count_refused(self, status: str) -> None:
        with self._lock:
            self._serve_refused[status] += 1

    def count_aborted(self, reason: str) -> None:
        """A shard stream cut before its response was complete (no request in time, client gone, stall)."""
        with self._lock:
            self._serve_aborted[reason] += 1

    def bytes_served_by_peer(self) -> dict[str, int]:
        with self._lock:
            return self._by_peer.column(_SERVED)

    def bytes_fetched_by_peer(self) -> dict[str, int]:
        with self._lock:
            return self._by_peer.column(_FETCHED)

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

    def dropped_by_peer(self) -> dict[str, int]:
        with self._lock:
            return self._dropped_by_peer.column(0)

    def totals(self) -> dict:
        """Every counter but the per-peer ones (a few small dicts): cheap enough for each /metrics scrape."""
        with self._lock:
            return {
                "bytes_served": self._bytes_served,
                "bytes_fetched": self._bytes_fetched,
                "announcements_received": dict(self._received),
                "announcements_dropped": dict(self._dropped),
                "announcements_undelivered": self._undelivered,
                "have_shards_named": self._have_named,
                "have_shards_quiet": self._have_quiet,
                "requests_refused": dict(self._serve_refused),
                "streams_aborted": dict(self._serve_aborted),
            }

    def snapshot(self) -> dict:
        """A JSON-ready copy of every counter (per peer: the `max_peers` most recently active, plus OTHER)."""
        out = self.totals()
        with self._lock:
            out.update({
                "bytes_served_by_peer": self._by_peer.column(_SERVED),
                "bytes_fetched_by_peer": self._by_peer.column(_FETCHED),
                "shards_served_by_peer": self._by_peer.column(_SHARDS_SERVED),
                "shards_fetched_by_peer": self._by_peer.column(_SHARDS_FETCHED),
                "announcements_dropped_by_peer": self._dropped_by_peer.column(0),
            })
        return out
