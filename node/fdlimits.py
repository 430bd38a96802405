"""Open-file descriptors: the limit raised at start, and a budget per purpose.

Every socket, shard file, sqlite handle and checkpoint being written costs a descriptor, and the common
soft limit (1,024) is far below the hard one. A server that lets strangers hold descriptors (a download
that is never read holds a socket and an open shard file) must not let them take the ones that
publishing a checkpoint, the ledger or the trainer need: at that point `open()` fails with EMFILE.

So each process raises its soft limit to the hard limit once (`raise_open_file_limit`), and the
connections our servers accept (every HTTP server of the process and the libp2p shard server's open
files together) may use at most `SERVE_SHARE` of it (`serving_budget()`); the rest stays reserved for
everything else. A server whose share is full refuses new connections at once (503 with Retry-After)
instead of accepting more. Counting is approximate by design: a served connection is charged
`FDS_PER_CONNECTION` (its socket and, while it sends a shard, the shard's file).
"""
from __future__ import annotations

import logging
import resource
import threading

log = logging.getLogger("prime_node.fdlimits")

# What serving strangers may take of the open-file limit; the rest (publishing, ledger, trainer,
# outbound fetches, accept bursts of up to one listen backlog) is always left free.
SERVE_SHARE = 0.5
FDS_PER_CONNECTION = 2  # a socket, and the file of the shard it is sending
# With no hard limit (RLIM_INFINITY) the soft limit is raised to this; the kernel's nr_open caps it anyway.
UNLIMITED_TARGET = 1 << 20


def raise_open_file_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (idempotent); returns the soft limit now in force.
    Failure (a platform or sandbox that refuses) is logged and the old limit kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft
    log.info("open-file limit raised from %d to %d", soft, target)
    return target


class FdBudget:
    """A share of the process's descriptors for one purpose. `try_take(n)` / `give(n)`; thread-safe (the
    libp2p shard server runs in the trio thread, the HTTP servers on the asyncio loop)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("an fd budget must allow at least one descriptor")
        self.limit = int(limit)
        self.used = 0
        self.refused = 0  # times a caller was turned away (a full budget), for tests and metrics
        self._lock = threading.Lock()

    def try_take(self, n: int = FDS_PER_CONNECTION) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                self.refused += 1
                return False
            self.used += n
            return True

    def give(self, n: int = FDS_PER_CONNECTION) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


_serving: FdBudget | None = None
_serving_lock = threading.Lock()

# The reserve must also hold the sockets the budget never sees. asyncio accepts up to `backlog` connections
# per turn of the event loop, and a connection refused for want of descriptors (node/http.py) keeps its
# socket until the fourth turn after its accept (transport made; connection_made refuses; close; socket
# closed): up to ACCEPT_TURNS x backlog sockets at once under a flood. listen_backlog() sizes the backlog so
# that they, and OTHER_FDS for the process's own (ledger, logs, pipes, a checkpoint being written), fit in
# the reserve; with the common limits (thousands and up) that is aiohttp's default of 128.
ACCEPT_TURNS = 5
OTHER_FDS = 64
MAX_BACKLOG = 128


def serving_budget() -> FdBudget:
    """The process's budget for serving connections: SERVE_SHARE of the open-file limit, which is raised to
    the hard limit on the first call. Every server of the process shares it."""
    global _serving
    with _serving_lock:
        if _serving is None:
            _serving = FdBudget(max(FDS_PER_CONNECTION, int(raise_open_file_limit() * SERVE_SHARE)))
        return _serving


def listen_backlog() -> int:
    """The listen backlog for a server that serves strangers: at most MAX_BACKLOG, and small enough that
    ACCEPT_TURNS backlogs of sockets accepted but not yet counted (or refused and not yet closed) fit in
    the part of the open-file limit that serving_budget() leaves free."""
    reserve = raise_open_file_limit() - serving_budget().limit
    return max(1, min(MAX_BACKLOG, (reserve - OTHER_FDS) // ACCEPT_TURNS))
