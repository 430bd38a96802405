"""NATed nodes serve too, and never block anyone (#26 items 3 and 4), across the WAN lab with real CLI processes.

- `test_nated_homes_serve_peers`: a coordinator in the datacenter (its libp2p host is a circuit relay v2 hop) and
  homes behind their own NAT routers, nobody else. The homes learn at join that nobody can dial them; they keep a
  relay reservation on the coordinator (node/p2p/nat.py), so the coordinator's super-seeding counts them as
  servable (seeding.py): the first home to ask for a shard gets its first copy, and the other is deferred to it.
  Asserted: every node holds every step, the coordinator saw the homes' reservations, a circuit was made into a
  home (nothing else connects two homes) and the homes served bytes to each other.
- `test_with_every_peer_unreachable_each_node_still_gets_each_step`: only homes, no relay hop: no peer can reach
  another. Each node still gets each step from the origin; the seconds from "step n published" to "holding step n"
  are measured with p2p on and with p2p off (origin only) in the same lab, and the extra time p2p costs is
  printed and bounded.

Only lab addresses (10.77.x, 192.168.x). `python -m tests.wan.test_wan_nat_serving` (as root) runs both, then
`nated_share` (a home with a port forward beside NATed homes, same uplink and round trip), and prints the numbers;
`... share --runs 3 --json out.json` the share alone.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

import pytest

from tests.wan.lab import DATACENTER, STATUS, Lab, Profile, cli, home, json_lines, wait_for

pytestmark = pytest.mark.timeout(400)
REPO = Path(__file__).resolve().parents[2]
TOTALS = re.compile(r"p2p totals: served (\d+) bytes, fetched (\d+) bytes \((\w+|reach \?)\); relay (\{[^}]*\})")
# The reachable yardstick for "NATed nodes serve >= 30 % of what a reachable node with the same uplink serves"
# (measured by `python -m tests.wan.test_wan_nat_serving share`, not asserted: who asks first is a race): a home
# like the others, same uplink and same round trip, whose router forwards its libp2p port. (It used to be a
# public node 10 ms from the origin against homes at 20 and 30 ms: it asked first and held the first copies.)
SHARE_ONE_WAY_MS = 25.0
FORWARDED_PORT = 4001
FORWARDED_HOME = home(SHARE_ONE_WAY_MS, forward=(FORWARDED_PORT,))


def run_lab(tmp_path: Path, sites: dict[str, Profile], *, steps: int, p2p: bool = True, relay_hop: bool = True,
            extra: tuple[str, ...] = (), deadline_s: float = 150.0, hop_extra: tuple[str, ...] = ()) -> dict:
    """Coordinator in the datacenter, one real `prime-node join` per site; run `steps` steps; return the status,
    each node's last "p2p totals" line and the seconds from "step n published" to "holding step n" per node."""
    common = ["--config", str(REPO / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", "--set=server.log_format=json", *extra]
    if not p2p:
        common.append("--set=p2p.enabled=false")
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        nodes = {name: lab.add(name, profile) for name, profile in sites.items()}
        ready = tmp_path / "coordinator.ready"
        coord = lab.spawn(dc, "coordinator", cli(
            "coordinator", *common, f"--set=server.host={dc.addr}", "--set=server.port=8000",
            f"--set=storage.dir={tmp_path / 'coord'}", f"--set=run.max_steps={steps}",
            f"--set=p2p.relay_hop={'true' if relay_hop else 'false'}", "--set=p2p.stats_log_s=1", *hop_extra,
            "--ready-file", str(ready)), cwd=REPO)

        def coordinator_alive():
            assert coord.poll() is None, lab.log("coordinator")[-3000:]

        wait_for("the coordinator", ready.is_file, 120, coordinator_alive)
        info = json.loads(ready.read_text())
        url = info["url"]
        for name, site in nodes.items():
            # a forwarded home listens on the port its router forwards (what its owner would set)
            port = [f"--set=p2p.listen_port={site.profile.forward[0]}"] if site.profile.forward else []
            lab.spawn(site, f"worker-{name}", cli(
                "join", "--coordinator", url, "--coordinator-key", info["key"], *common, *port,
                f"--set=worker.storage_dir={tmp_path / name}", "--set=worker.heartbeat_seconds=1",
                "--set=p2p.stats_log_s=1"), cwd=REPO)

        def status() -> dict:
            out = lab.run(dc, [sys.executable, "-c", STATUS, url])
            return json.loads(out.stdout) if out.returncode == 0 else {}

        def done():
            s = status()
            rows = s.get("nodes", [])
            return s if (s.get("step", 0) >= steps and len(rows) == len(nodes)
                         and {r.get("policy_step") for r in rows} == {steps}) else None

        s = wait_for(f"every node at step {steps}", done, deadline_s, coordinator_alive)
        time.sleep(2.5)  # the last "p2p totals" lines (every second, when they changed)
        lab.check_delay_lines()  # the latencies held for the whole run
        published = {int(m.group(1)): r["ts"] for r in json_lines(lab.log("coordinator"))
                     if (m := re.match(r"step (\d+) published", r["msg"]))}
        lag, totals = {}, {}
        for name in nodes:
            rows = json_lines(lab.log(f"worker-{name}"))
            held = {int(m.group(1)): r["ts"] for r in rows if (m := re.match(r"holding step (\d+)", r["msg"]))}
            lag[name] = {n: round(held[n] - published[n], 2) for n in sorted(held) if n in published}
            last = [m for r in rows if (m := TOTALS.match(r["msg"]))]
            totals[name] = ({"served": int(last[-1].group(1)), "fetched": int(last[-1].group(2)),
                             "reach": last[-1].group(3), "relay": last[-1].group(4)} if last else
                            {"served": 0, "fetched": 0, "reach": None, "relay": "{}"})
        hop = [m.group(4) for r in json_lines(lab.log("coordinator")) if (m := TOTALS.match(r["msg"]))]
        return {"status": s, "lag": lag, "totals": totals, "hop": hop[-1] if hop else "{}", "sites": nodes}


def _relay(totals: dict) -> dict:
    return json.loads(totals["relay"].replace("'", '"'))


def test_nated_homes_serve_peers(tmp_path):
    r = run_lab(tmp_path, {"home1": home(20.0), "home2": home(30.0)}, steps=4)
    t = r["totals"]
    print("per node (bytes served / fetched over p2p, reachability, relay counters):")
    for name, row in t.items():
        print(f"  {name}: served {row['served']:>9} fetched {row['fetched']:>9} {row['reach']} relay {row['relay']}")
    print("coordinator's hop:", r["hop"], "\nseconds from publish to held:", r["lag"],
          "\nbytes by source:", r["status"].get("checkpoint_bytes_by_source"))
    s = r["status"]
    assert all(row["reach"] == "NATed" for row in t.values()), t
    # the coordinator knew both homes were reachable through its hop (what lets super-seeding defer to them)
    assert [(n["reachable"], n["relayed"]) for n in s["nodes"]] == [(False, True)] * 2, s["nodes"]
    assert all(_relay(row).get("reservations", 0) >= 1 for row in t.values()), t
    # Before super-seeding counted relayed homes, no home held a first copy and both fetched everything from the
    # origin: 0 bytes served (the CI run that failed: 0 and 0).
    assert sum(row["served"] for row in t.values()) > 0, "the NATed homes served no bytes to each other"
    # Two homes can only have met through the relay: a circuit was made into a home.
    assert sum(_relay(row).get("circuits_in", 0) for row in t.values()) >= 1, t
    assert s["verification"]["rejected"] == 0 and s["verification"]["accepted"] > 0, s["verification"]
    assert all(len(lags) >= 4 for lags in r["lag"].values()), r["lag"]  # every node held every step 1..4


def test_with_every_peer_unreachable_each_node_still_gets_each_step(tmp_path):
    sites = {"home1": home(20.0), "home2": home(30.0)}
    runs = {}
    for label, p2p in (("p2p on, no relay", True), ("origin only (p2p off)", False)):
        r = run_lab(tmp_path / label.split()[0], sites, steps=3, p2p=p2p, relay_hop=False, deadline_s=120)
        runs[label] = r
        assert all(len(lags) >= 3 for lags in r["lag"].values()), (label, r["lag"])  # every node, every step
    # Step 0 is published before the nodes start (its "lag" is their start-up and join), so steps 1.. count.
    on, off = (sorted(v for lags in r["lag"].values() for n, v in lags.items() if n > 0) for r in runs.values())
    extra = statistics.median(on) - statistics.median(off)
    print("seconds from publish to held, p2p on with every peer unreachable:", runs["p2p on, no relay"]["lag"])
    print("                              origin only:                       ", runs["origin only (p2p off)"]["lag"])
    print(f"median {statistics.median(on):.2f} s vs {statistics.median(off):.2f} s: extra {extra:+.2f} s; "
          f"worst {max(on):.2f} s vs {max(off):.2f} s")
    assert all(row["reach"] == "NATed" for row in runs["p2p on, no relay"]["totals"].values())
    # Bounded: no fetch waits on a peer nobody can reach (a dial is 3 s, super-seeding never defers to a NATed
    # node): the median extra under one dial, and no step later than the worst origin-only one plus 2 dials.
    assert extra < 3.0, extra
    assert max(on) < max(off) + 6.0, (max(on), max(off))


def nated_share(tmp_path: Path, *, steps: int = 6, homes: int = 2) -> dict:
    """The issue's yardstick: bytes a NATed home serves on average, against a reachable home with the same uplink
    and round trip (its router forwards its libp2p port), over `steps` steps. Returns the per-node numbers."""
    sites = {"fwd": FORWARDED_HOME, **{f"home{i + 1}": home(SHARE_ONE_WAY_MS) for i in range(homes)}}
    r = run_lab(tmp_path, sites, steps=steps)
    t = r["totals"]
    for name, row in t.items():
        print(f"  {name}: served {row['served']:>9} fetched {row['fetched']:>9} {row['reach']} relay {row['relay']}")
    assert t["fwd"]["reach"] == "reachable" and all(t[h]["reach"] == "NATed" for h in sites if h != "fwd"), t
    nated = statistics.mean(t[h]["served"] for h in sites if h != "fwd")
    share = nated / max(1, t["fwd"]["served"])
    print(f"NATed homes served on average {nated:.0f} bytes, the forwarded home {t['fwd']['served']}: {share:.0%}; "
          f"origin bytes {r['status'].get('checkpoint_bytes_by_source')}; seconds from publish to held: {r['lag']}")
    return {"share": share, "served": {n: row["served"] for n, row in t.items()},
            "fetched": {n: row["fetched"] for n, row in t.items()}, "relay": {n: _relay(row) for n, row in t.items()},
            "hop": r["hop"], "lag": r["lag"], "by_source": r["status"].get("checkpoint_bytes_by_source")}


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="the NAT-serving lab tests, or (share) the NATed share alone")
    ap.add_argument("what", nargs="?", choices=("all", "share"), default="all")
    ap.add_argument("--runs", type=int, default=1, help="share: repeat the measurement")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", type=Path, help="share: write every run's numbers here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if a.what == "all":
            test_nated_homes_serve_peers(Path(d) / "a")
            test_with_every_peer_unreachable_each_node_still_gets_each_step(Path(d) / "b")
        runs = [nated_share(Path(d) / f"c{i}", steps=a.steps) for i in range(a.runs)]
        print("NATed share per run:", ", ".join(f"{r['share']:.0%}" for r in runs))
        if a.json:
            a.json.write_text(json.dumps({"runs": runs, "steps": a.steps, "one_way_ms": SHARE_ONE_WAY_MS}, indent=1))
