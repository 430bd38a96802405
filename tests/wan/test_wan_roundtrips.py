"""Round trips per step on a long link: a node at home behind NAT, 50 ms one way from the datacenter (a 100 ms
round trip), follows the real CLI coordinator's steps, and the packets on its line (sniffed in its namespace, not
counted by the code under test) show what each step cost it (bench/wan.py measures the same at 20-200 ms).

p2p is off: the node's only source is the origin, so what is measured is the fetcher's own round trips. With p2p on
and every node behind NAT, the origin's super-seeding defers shards to nodes that cannot serve them (up to 3
deferrals a shard), which costs more than everything measured here (bench/wan.py without --no-p2p shows it)."""
from pathlib import Path

import pytest

from bench.wan import run_loop

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]


def test_a_delta_step_costs_at_most_three_round_trips_plus_its_transfer(tmp_path):
    # 40 steps: enough fetches of exactly one delta however the fetches group the steps (3-7 of 10 steps were; CI
    # runs on slow days fetched 14 steps in 9 syncs and 20 steps in 11, only 2 of one delta each time; here 30 steps
    # gave 3 and 13, 40 steps 4 and 5). Neither k = 1 nor one assignment at a time makes every fetch a single delta:
    # tried, 4-7 of 13-15 were, or the run slowed to 15-19 steps in 180 s
    r = run_loop(REPO, [50.0], steps=40, workdir=tmp_path / "run", timeout_s=180, extra=("--set=p2p.enabled=false",))
    node = r["nodes"]["50"]
    print("round trips at 100 ms:", node)
    assert r["trainer_steps"] >= 40, r
    assert node["delta_fetches"] >= 3, node  # the steady state was seen, not only the catch-up
    # The target: a delta step costs at most 3 round trips plus its transfer time. Round trips on the
    # critical path (request waves: listing and the guessed manifest together, then every shard together)
    assert node["delta_waves"] <= 3, node
    # ... and in time, from the listing's request to the shards' last byte: the median fetch of one delta, in
    # round trips after its transfer time. Reported, and bounded only loosely: the coordinator's and the node's CPU
    # time on a shared box and TCP's slow start after idle are in it, so it varies from run to run with the same
    # 2 waves (2.6 and 3.9 here, 5.05 on the CI machine; the old fetcher, 4 waves, ~6.2). The structural claim
    # is the wave count above; this bound catches a fetch that waits on a timer (a 1 s poll is 10 round trips).
    assert node["delta_rtts_beyond_transfer"] <= 8.0, node
    # kept-alive connections: the fetcher's requests (~8 a step) reuse connections. Counted: connections whose first
    # request is a checkpoint's. Measured 0.6-0.8 a step (a wave of 5 parallel shard requests sometimes finds
    # fewer idle pooled connections, and the client drops idle ones after 4 s); a connection per request would be
    # ~8. The API's connections are in connects_per_step (printed).
    assert node["fetch_connects_per_step"] <= 2.0, node
    assert node["fetch_connects"] < 0.25 * node["requests_per_step"] * node["steps_fetched"], node
