"""How long a node waits before its next request of a kind: the coordinator paces the requests whose number grows
with the swarm, not with its work (docs/PROTOCOL.md, `X-Prime-Retry-After-Ms`).

* `POST /v1/work` answered 204 (no work now): an idle node used to ask every 0.2-0.5 s, so 1,000 idle nodes sent
  ~800 requests a second, nearly all 204s, and p99 was 2.4 s (docs/BENCHMARKS.md, "Idle nodes paced by the
  coordinator"). Now the 204 names a wait; a node still asks at once when it holds a new step (that is when work
  opens), so a long wait costs it only work that opens between steps (expired or voided places).
* `POST /v1/heartbeat`: every 5 s per node is 2,000 requests a second at 10,000 nodes; the answer names when to
  send the next one, and status's "online" window follows it (`online_ms`).

Each wait is (nodes that asked in the last `window_ms`) / the budget in requests per second, within
[min_ms, max_ms], so that all nodes together ask at about the budget. No IO; one dict bounded by the nodes that
asked (admitted keys only: both requests are signed and checked first), swept every few seconds.
"""
from __future__ import annotations

import math

SWEEP_MS = 5_000

WORK_MIN_MS, WORK_MAX_MS = 250, 60_000  # small runs keep the old cadence; new work is heard of within a minute
HEARTBEAT_MIN_MS, HEARTBEAT_MAX_MS = 5_000, 30_000  # worker.heartbeat_seconds' default, and at most 6x it


def work_min_ms(rate_limit_per_second: float) -> int:
    """The shortest wait a 204 names: WORK_MIN_MS, or longer where `server.rate_limit_per_second` is lower, so that
    a node's idle re-asks take at most half of its rate limit (the rest is its heartbeats, submissions and
    checkpoint fetches). Told to come back every 250 ms under a limit of 3 requests a second, a node that did as
    told was answered 429 (bench/load.py's limit of 2 a second, at N = 100)."""
    return max(WORK_MIN_MS, math.ceil(2000 / rate_limit_per_second))


class Pacer:
    def __init__(self, requests_per_s: float, min_ms: int, max_ms: int):
        self.requests_per_s, self.min_ms, self.max_ms = requests_per_s, min_ms, max_ms
        self.window_ms = 2 * max_ms  # a node that asked less often than the longest wait has gone
        self._asked: dict[str, int] = {}  # node id -> when it last asked
        self._swept_ms = 0

    def asked(self, node_id: str, now_ms: int) -> int:
        """`node_id` asked now: how many ms it should wait before asking again."""
        self._asked[node_id] = now_ms
        if now_ms - self._swept_ms >= SWEEP_MS:
            self._swept_ms = now_ms
            cutoff = now_ms - self.window_ms
            self._asked = {n: t for n, t in self._asked.items() if t >= cutoff}
        return self.wait_ms()

    def wait_ms(self) -> int:
        return max(self.min_ms, min(self.max_ms, round(len(self._asked) * 1000 / self.requests_per_s)))

    def forget(self, node_id: str) -> None:
        self._asked.pop(node_id, None)

    def nodes(self) -> int:
        return len(self._asked)


def online_ms(heartbeat_ms: int) -> int:
    """How long a node counts as online after it was last heard from: three heartbeat periods, at least 30 s."""
    return max(30_000, 3 * heartbeat_ms)
