"""Log what hostile peers make us drop without letting them write our log.

`PeerEventLog.note(peer, reason, detail)` logs the first event of a peer at once, then at most one
summary line per peer per `interval_s` ("12345 more from X in the last 60 s: {reason: n}; latest:
..."). Between lines, events are only counted (the caller counts them in P2PStats too), so a flood
costs a dict update per message, never a log line. `flush()` writes the summaries that are due
(the service calls it every few seconds), so a flood that stopped is still reported once.

Bounded: at most `max_peers` peers are tracked; events of further peers share one "other peers"
entry. Pure (no trio, no libp2p); the clock is injectable. Used from one thread (the trio one).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Union

Detail = Union[str, Callable[[], str]]  # a callable is only called when a line is written

OTHERS = "(other peers)"


@dataclass
class _Entry:
    logged_at: float
    pending: Counter = field(default_factory=Counter)
    latest: tuple = ("", "")


class PeerEventLog:
    def __init__(self, logger: logging.Logger, what: str, *, level: int = logging.INFO, interval_s: float = 60.0,
                 max_peers: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.log = logger
        self.what = what  # e.g. "announcements dropped"
        self.level = level
        self.interval_s = interval_s
        self.max_peers = max_peers
        self.clock = clock
        self._peers: dict[str, _Entry] = {}

    def note(self, peer: str, reason: str, detail: Detail = "") -> None:
        now = self.clock()
        entry = self._peers.get(peer)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                peer = OTHERS
                entry = self._peers.get(OTHERS)
            if entry is None:
                self._peers[peer] = _Entry(logged_at=now)
                self.log.log(self.level, "%s from %s: %s (further ones from this peer: one summary line "
                             "per %.0f s at most)", self.what, peer, _describe(reason, detail), self.interval_s)
                return
        entry.pending[reason] += 1
        entry.latest = (reason, detail)
        if now - entry.logged_at >= self.interval_s:
            self._summarize(peer, entry, now)

    def flush(self) -> None:
        """Write the summaries that are due; forget peers that were quiet for a whole interval."""
        now = self.clock()
        for peer, entry in list(self._peers.items()):
            if now - entry.logged_at >= self.interval_s:
                if entry.pending:
                    self._summarize(peer, entry, now)
                else:
                    del self._peers[peer]

    def _summarize(self, peer: str, entry: _Entry, now: float) -> None:
        n = sum(entry.pending.values())
        self.log.log(self.level, "%s from %s: %d more in the last %.0f s %s; latest: %s", self.what, peer, n,
                     now - entry.logged_at, dict(entry.pending.most_common()), _describe(*entry.latest))
        entry.pending.clear()
        entry.logged_at = now


def _describe(reason: str, detail: Detail) -> str:
    if callable(detail):
        try:
            detail = detail()
        except Exception as e:  # a log line must never take the caller down
            detail = f"(detail unavailable: {e!r})"
    return f"{reason}: {detail}" if detail else reason
