"""How long a node told "no work now" waits before it asks again (docs/PROTOCOL.md, `POST /v1/work`).

An idle node used to ask every 0.2-0.5 s, so 10,000 idle nodes would send 20,000-50,000 requests a second of
which nearly all get a 204: more than any API core serves (docs/BENCHMARKS.md, "Where the API process's CPU
goes"). Instead the 204 carries `X-Prime-Retry-After-Ms`, chosen so that all idle nodes together ask at about
`server.idle_work_requests_per_s`: the wait is (nodes told "no work" in the last `WINDOW_MS`) / that rate,
within [MIN_MS, MAX_MS]. A node still asks at once when it gets a new step (that is when work opens), so a long
wait costs it only work that opens between steps (expired or voided places).

No IO, one dict bounded by the nodes that asked (admitted keys only: /v1/work is signed and checked first).
"""
from __future__ import annotations

from protocol.messages import NoWork

WINDOW_MS = 120_000  # a node not told "no work" for this long no longer counts as idle
MIN_MS = 250  # small runs keep the old cadence (tests, the demo)
MAX_MS = 60_000  # a node hears of new work within a minute at worst, new steps at once
SWEEP_MS = 5_000


class IdlePacer:
    def __init__(self, requests_per_s: float):
        self.requests_per_s = requests_per_s
        self._idle: dict[str, int] = {}  # node id -> when it was last told "no work"
        self._swept_ms = 0

    def no_work(self, node_id: str, now_ms: int) -> NoWork:
        """`node_id` is told "no work now", with how many ms it should wait before asking again."""
        self._idle[node_id] = now_ms
        if now_ms - self._swept_ms >= SWEEP_MS:
            self._swept_ms = now_ms
            cutoff = now_ms - WINDOW_MS
            self._idle = {n: t for n, t in self._idle.items() if t >= cutoff}
        return NoWork(retry_after_ms=max(MIN_MS, min(MAX_MS, round(len(self._idle) * 1000 / self.requests_per_s))))

    def got_work(self, node_id: str) -> None:
        self._idle.pop(node_id, None)

    def idle_nodes(self) -> int:
        return len(self._idle)
