"""Checkpoint bytes each node says it got, by source (its heartbeats' `bytes_by_source`), bounded.

Every admitted key may heartbeat, and keys are cheap to make, so the table keeps only nodes heard from in
the last `ttl_ms` and at most `max_nodes` of them (least recently heard first out); a node's row has only
the sources the wire model allows (`coordinator`, `relay`, `peer`). What a node that is forgotten had
reported is added to one `departed` row, so the swarm's totals (status `bytes_by_source`) never go back.
Expired rows are swept at most every `sweep_ms`, from `record` itself: no task of its own.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterator, Literal, Mapping

Source = Literal["coordinator", "relay", "peer"]
SOURCES: tuple[Source, ...] = ("coordinator", "relay", "peer")  # HeartbeatRequest.bytes_by_source's keys


class NodeBytes:
    def __init__(self, *, max_nodes: int = 10_000, ttl_ms: int = 3_600_000, sweep_ms: int = 60_000):
        self.max_nodes, self.ttl_ms, self.sweep_ms = max_nodes, ttl_ms, sweep_ms
        self._rows: OrderedDict[str, tuple[int, dict[str, int]]] = OrderedDict()  # node -> (last heard ms, counts)
        self.departed: Counter[str] = Counter()
        self._swept_ms = 0

    def record(self, node_id: str, counts: Mapping[Source, int], now_ms: int) -> None:
        """The node's cumulative counts as of now (they replace what it said before)."""
        self._rows[node_id] = (now_ms, {s: int(n) for s, n in counts.items() if s in SOURCES})
        self._rows.move_to_end(node_id)
        while len(self._rows) > self.max_nodes:
            self._depart(next(iter(self._rows)))
        if now_ms - self._swept_ms >= self.sweep_ms:
            self._swept_ms = now_ms
            self.prune(now_ms - self.ttl_ms)

    def prune(self, heard_before_ms: int) -> int:
        """Forget nodes last heard before this time; returns how many."""
        old = []
        for node_id, (heard, _) in self._rows.items():  # oldest first: stop at the first recent one
            if heard >= heard_before_ms:
                break
            old.append(node_id)
        for node_id in old:
            self._depart(node_id)
        return len(old)

    def forget(self, node_id: str) -> None:
        if node_id in self._rows:
            self._depart(node_id)

    def _depart(self, node_id: str) -> None:
        _, counts = self._rows.pop(node_id)
        self.departed.update(counts)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._rows

    def __getitem__(self, node_id: str) -> dict[str, int]:
        return self._rows[node_id][1]

    def values(self) -> Iterator[Mapping[str, int]]:
        """Each known node's counts, then the departed nodes' together: summing them gives the swarm's totals."""
        for _, counts in self._rows.values():
            yield counts
        if self.departed:
            yield self.departed

    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.values():
            total.update(counts)
        return total
