"""The lab itself: latency, NAT and shaping are what the profiles say (measured, not assumed)."""
import json
import sys
import time
from pathlib import Path

import pytest

from tests.wan.lab import DATACENTER, Lab, home

pytestmark = pytest.mark.timeout(120)
PROBE = str(Path(__file__).with_name("probe_server.py"))

CONNECT_MS = """
import socket, sys, time
best = 1e9
for _ in range(5):
    t0 = time.monotonic(); s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    best = min(best, time.monotonic() - t0); s.close()
print(best * 1000)
"""
FETCH = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
"""
UPLOAD = """
import sys, time, urllib.request
n = int(sys.argv[2]); t0 = time.monotonic()
urllib.request.urlopen(urllib.request.Request(sys.argv[1], data=bytes(n), method="POST"), timeout=60).read()
print(n * 8 / (time.monotonic() - t0) / 1e6)
"""
REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close(); print("reached")
except OSError as e:
    print("unreachable", type(e).__name__)
"""


def wait_listening(lab, site, host, port, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if lab.run(site, [sys.executable, "-c", REACH, host, str(port)]).stdout.startswith("reached"):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {host}:{port}")


def test_lab_latency_nat_and_shaping_are_as_configured():
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        h1 = lab.add("h1", home(20.0))
        h2 = lab.add("h2", home(35.0))
        lab.spawn(dc, "probe-dc", [sys.executable, PROBE, dc.addr, "8000"])
        lab.spawn(h2, "probe-h2", [sys.executable, PROBE, "0.0.0.0", "8000"])
        wait_listening(lab, dc, dc.addr, 8000)
        wait_listening(lab, h2, "127.0.0.1", 8000)

        # round trip home -> datacenter = 2 x the home's one-way delay (the datacenter's is 0)
        for site, rtt in ((h1, 40.0), (h2, 70.0)):
            ms = float(lab.run(site, [sys.executable, "-c", CONNECT_MS, dc.addr, "8000"]).stdout)
            assert rtt * 0.9 <= ms <= rtt * 1.5 + 5, (site.name, ms)
        # home to home: both delays, both ways
        # NAT: the datacenter sees the home's router, never its private address
        seen = lab.run(h1, [sys.executable, "-c", FETCH, f"http://{dc.addr}:8000/whoami"]).stdout.strip()
        assert seen == h1.public_addr and h1.addr.startswith("192.168.")
        # nothing dials into a home: not from the datacenter, not from another home, public or private address
        for src, dst in ((dc, h2.public_addr), (h1, h2.public_addr), (h1, h2.addr)):
            out = lab.run(src, [sys.executable, "-c", REACH, dst, "8000"]).stdout
            assert out.startswith("unreachable"), (src.name, dst, out)
        # the home's uplink is 20 Mbit/s
        mbit = float(lab.run(h1, [sys.executable, "-c", UPLOAD, f"http://{dc.addr}:8000/", str(6 << 20)]).stdout)
        assert 14.0 <= mbit <= 21.0, mbit
        lab.close()
        # the delay lines' own account: every packet left within 2 ms of its due time (they run as real-time
        # tasks, so a loaded box does not lengthen the lab's round trips)
        for name in ("h1", "h2"):
            line = next(x for x in lab.log(f"delay-{name}").splitlines() if x.startswith("delay_line stats "))
            stats = json.loads(line.removeprefix("delay_line stats "))
            assert stats["packets"] > 0 and stats["late_p99_ms"] <= 2.0, (name, stats)
