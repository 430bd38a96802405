"""Round trips per step on WAN links, measured on the wire in the WAN lab (tests/wan/lab.py), old code against new.

    sudo .venv/bin/python bench/wan.py [--base /tmp/w2base] [--steps 20] [--delays 10,50,100]
Prints a table and writes bench/results/wan.json.

Each run is the real loop: the real CLI coordinator in the lab's datacenter (the demo's config with
trainer.warm_start_steps=0 and evaluation off), one node at home behind its own NAT per one-way delay (20 Mbit/s
up, 100 down; the round trip to the coordinator is twice the delay). `--base` names a checkout of the old code
(`git worktree add /tmp/w2base <commit>`): the same lab is run with the coordinator and the nodes from there, then
from this checkout.

What is counted does not come from the code under test: a packet sniffer (AF_PACKET, this file's `sniff` mode)
runs in each node's namespace and records every TCP packet to and from the coordinator, with the request line of
each HTTP request. From that, per node:
* steps: the distinct steps whose shards the node asked for; requests/step: checkpoint requests (the listing,
  manifests, shards, including listings that found nothing new) per step fetched; connects/step: TCP connections
  the node opened to the coordinator's HTTP port (any request, heartbeats included) per step fetched; fetch
  connects/step: those of them whose first request was a checkpoint's (the fetcher's own).
* a fetch: from a listing request that is followed by a manifest request to the last byte of the last
  checkpoint response before the next listing. s/step: a fetch's wire time over the steps it fetched; round
  trips/step: that over the round-trip time, and the same after taking away the transfer time at the line's
  100 Mbit/s ("round trips + transfer" is the issue's target form: at most 3 round trips plus transfer).
  Medians over the fetches of exactly one delta step (the steady state), and over all fetches.
* accepted: rollouts accepted by the coordinator, per node (from /v1/status at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PORT = 8000
DOWN_MBIT = 100.0
STATUS = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/v1/status", timeout=5).read().decode())
"""
_GET = re.compile(rb"^GET (/v1/checkpoints(?:/(\d+)/(manifest|shards/\d+))?)[ ?]")


# -- the sniffer (run inside a node's namespace) ----------------------------------------------------------
def sniff(iface: str, peer: str, out: Path) -> None:
    """Record every TCP packet between this namespace and `peer` on `iface` until SIGTERM, one JSON line each:
    [time, "out"|"in", local port, remote port, syn-without-ack, payload bytes, request line or ""]."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL: sent packets too
    s.bind((iface, 0))
    s.settimeout(0.5)
    peer_b = socket.inet_aton(peer)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    with open(out, "w") as f:
        while not stop:
            try:
                pkt = s.recv(256)
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            t = time.time()
            ip = pkt[14:]
            if pkt[12:14] != b"\x08\x00" or len(ip) < 40 or ip[9] != 6:
                continue
            ihl = (ip[0] & 0x0F) * 4
            total = struct.unpack("!H", ip[2:4])[0]
            src, dst = ip[12:16], ip[16:20]
            if peer_b not in (src, dst):
                continue
            tcp = ip[ihl:]
            sport, dport = struct.unpack("!HH", tcp[:4])
            doff = (tcp[12] >> 4) * 4
            flags = tcp[13]
            payload = total - ihl - doff
            outward = dst == peer_b
            line = ""
            if outward and payload > 0 and tcp[doff:doff + 4] == b"GET ":
                line = tcp[doff:doff + 120].split(b"\r\n")[0].decode("latin-1")
            f.write(json.dumps([round(t, 6), "out" if outward else "in", sport if outward else dport,
                                dport if outward else sport, bool(flags & 0x02 and not flags & 0x10), payload,
                                line]) + "\n")
            f.flush()


# -- analysis ----------------------------------------------------------------------------------------------
@dataclass
class Fetch:
    start: float
    end: float
    steps: set = field(default_factory=set)
    bytes_in: int = 0
    requests: int = 0
    sent: list = field(default_factory=list)  # when each checkpoint request of the fetch left

    def waves(self, rtt_s: float) -> int:
        """Round trips on the fetch's critical path: requests sent within half a round trip of the first of a
        group went out together (in parallel); a request sent later waited for an answer."""
        n, start = 0, None
        for t in sorted(self.sent):
            if start is None or t - start > rtt_s / 2:
                n, start = n + 1, t
        return n


def analyse(packets: list[list], rtt_s: float, deltas: set[int] | None = None) -> dict:
    """Per-node numbers from a sniff (see the module docstring). `deltas`: the steps that are deltas (else every
    step but a fetch's first counts as one)."""
    current: dict[int, tuple[str, int | None]] = {}  # local port -> (kind of the request in flight, its fetch)
    fetches: list[Fetch] = []
    connects = requests = listings = fetch_connects = 0
    fresh: set[int] = set()  # local ports of new connections that have sent nothing yet
    steps: set[int] = set()
    last = None  # the last manifest or shard request: (time, local port, step, what)
    for t, way, lport, rport, syn, size, line in packets:
        if rport != PORT:
            continue
        if way == "out":
            if syn:
                connects += 1
                fresh.add(lport)
            m = _GET.match(line.encode("latin-1")) if line else None
            if lport in fresh and size > 0:  # a connection's first request: the fetcher's, or the API's
                fresh.discard(lport)
                fetch_connects += m is not None
            if not m:
                if size > 0:  # another request (a POST, its body, an API GET): what answers it is not a checkpoint's
                    current[lport] = ("api", None)
                continue
            requests += 1
            if m.group(2) is None:  # the listing: a new fetch begins
                listings += 1
                fetches.append(Fetch(t, t, sent=[t]))
                current[lport] = ("ckpt", len(fetches) - 1)
                if last is not None and t - last[0] < 0.02 and last[3] == b"manifest":
                    # a manifest asked for together with this listing (the new fetcher's guess) belongs to it
                    lt, lport2, step, _ = last
                    fetches[-2].requests -= 1
                    fetches[-2].sent.remove(lt)
                    fetches[-1].sent.append(lt)
                    fetches[-1].start = lt
                    fetches[-1].requests += 1
                    current[lport2] = ("ckpt", len(fetches) - 1)
                last = None
                continue
            if not fetches:
                continue
            f = fetches[-1]
            step = int(m.group(2))
            if m.group(3) != b"manifest":  # a step is fetched when its shards are (a manifest may be a guess)
                f.steps.add(step)
                steps.add(step)
            f.requests += 1
            f.sent.append(t)
            current[lport] = ("ckpt", len(fetches) - 1)
            last = (t, lport, step, m.group(3))
        else:
            kind, i = current.get(lport, ("api", None))
            if kind == "ckpt" and i is not None and size > 0:
                fetches[i].end = max(fetches[i].end, t)
                fetches[i].bytes_in += size
    useful = [f for f in fetches if f.steps]
    per_step = []
    for f in useful:
        wire = f.end - f.start
        transfer = f.bytes_in * 8 / (DOWN_MBIT * 1e6)
        one_delta = len(f.steps) == 1 and (deltas is None or next(iter(f.steps)) in deltas)
        per_step.append({"steps": len(f.steps), "s": wire, "s_per_step": wire / len(f.steps),
                         "rtts_per_step": wire / len(f.steps) / rtt_s,
                         "rtts_beyond_transfer": (wire - transfer) / len(f.steps) / rtt_s,
                         "requests": f.requests + 1, "one_delta": one_delta,
                         "waves_per_step": f.waves(rtt_s) / len(f.steps)})
    one = [x for x in per_step if x["one_delta"]]

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 3) if rows else None

    n = max(1, len(steps))
    return {"rtt_ms": round(rtt_s * 1e3), "steps_fetched": len(steps), "fetches": len(useful),
            "requests_per_step": round(requests / n, 2), "listings": listings,
            "connects_per_step": round(connects / n, 2), "connects": connects,
            "fetch_connects_per_step": round(fetch_connects / n, 2), "fetch_connects": fetch_connects,
            "delta_s_per_step": med(one, "s_per_step"), "delta_rtts": med(one, "rtts_per_step"),
            "delta_rtts_beyond_transfer": med(one, "rtts_beyond_transfer"), "delta_fetches": len(one),
            "delta_waves": med(one, "waves_per_step"),
            "all_s_per_step": round(sum(x["s"] for x in per_step) / n, 3) if per_step else None,
            "all_rtts_per_step": round(sum(x["s"] for x in per_step) / n / rtt_s, 2) if per_step else None}


def read_sniff(path: Path) -> list[list]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


# -- one run in the lab ------------------------------------------------------------------------------------
def cli(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "node.cli", *args]


def run_loop(root: Path, delays_ms: list[float], steps: int, workdir: Path, *, timeout_s: float = 300.0,
             extra: tuple[str, ...] = (), lab=None) -> dict:
    """The real loop from the checkout at `root`: coordinator in the datacenter, a home node per one-way delay,
    `steps` trainer steps. Returns per-node numbers keyed by delay. In `lab` if given (it is closed at the end:
    the sniffers flush), else in a new one; either way it raises if a delay line died during the run."""
    sys.path.insert(0, str(REPO))
    from tests.wan.lab import Lab

    if lab is None:
        with Lab() as lab:
            return run_loop(root, delays_ms, steps, workdir, timeout_s=timeout_s, extra=extra, lab=lab)
    return _run_loop(lab, root, delays_ms, steps, workdir, timeout_s, extra)


def start_run(lab, root: Path, sites: list[tuple[str, object]], workdir: Path, coord_sets: list[str],
              node_sets: list[str], before_nodes=None) -> tuple[object, list, str, object]:
    """The coordinator (real CLI) in a datacenter site of `lab` and one `prime-node join` per (name, profile) in
    `sites`, with the demo's config and `--set` overrides; `before_nodes(dc, nodes)` runs after the sites exist
    and before any process starts (sniffers). Returns (dc site, node sites, coordinator URL, its process)."""
    from tests.wan.lab import DATACENTER

    dc = lab.add("dc", DATACENTER)
    nodes = [lab.add(name, prof) for name, prof in sites]
    if before_nodes is not None:
        before_nodes(dc, nodes)
    ready = workdir / "coordinator.ready"
    ready.unlink(missing_ok=True)
    coord = lab.spawn(dc, "coordinator", cli(
        root, "coordinator", *coord_sets, f"--set=server.host={dc.addr}", f"--set=server.port={PORT}",
        f"--set=storage.dir={workdir / 'coord'}", f"--set=p2p.listen_host={dc.addr}", "--ready-file", str(ready)),
        cwd=root)
    t0 = time.monotonic()
    while not ready.is_file():
        if coord.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError("the coordinator did not start:\n" + lab.log("coordinator")[-3000:])
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    url = info["url"]
    for n in nodes:
        lab.spawn(n, f"worker-{n.name}", cli(
            root, "join", "--coordinator", url, "--coordinator-key", info["key"], *node_sets,
            f"--set=worker.storage_dir={workdir / n.name}", "--set=worker.heartbeat_seconds=1",
            "--set=p2p.listen_host=0.0.0.0"), cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dc, nodes, url, coord


def lab_status(lab, dc, url: str) -> dict:
    out = lab.run(dc, [sys.executable, "-c", STATUS, url])
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _run_loop(lab, root: Path, delays_ms: list[float], steps: int, workdir: Path, timeout_s: float,
              extra: tuple[str, ...]) -> dict:
    from tests.wan.lab import home

    common = ["--config", str(root / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", *extra]
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: no steps held from an earlier one
    workdir.mkdir(parents=True)
    sniffs = {}

    def sniffers(dc, nodes):
        for n in nodes:
            sniffs[n.name] = workdir / f"{n.name}.sniff"
            lab.spawn(n, f"sniff-{n.name}", [sys.executable, str(Path(__file__).resolve()), "sniff", "--iface",
                                             "e0", "--peer", dc.addr, "--out", str(sniffs[n.name])])

    dc, nodes, url, coord = start_run(lab, root, [(f"home{int(d)}", home(d)) for d in delays_ms], workdir,
                                      [*common, f"--set=run.max_steps={steps}"], common, sniffers)

    def status() -> dict:
        return lab_status(lab, dc, url)

    deadline, s, t_start = time.monotonic() + timeout_s, {}, time.monotonic()
    steady = None  # accepted rollouts per node when every node had started generating (engines start at
    while time.monotonic() < deadline:  # different times on a loaded box: the split after it is the fair one)
        s = status()
        rows_now = s.get("nodes", [])
        if steady is None and len(rows_now) == len(nodes) and all((r.get("policy_step") or -1) >= 1 for r in rows_now):
            steady = ({r["node_id"][:8]: r.get("accepted") or 0 for r in rows_now}, s.get("step", 0))
        if s.get("step", 0) >= steps:
            break
        if coord.poll() is not None:
            raise RuntimeError("the coordinator exited:\n" + lab.log("coordinator")[-3000:])
        time.sleep(1)
    wall = time.monotonic() - t_start
    time.sleep(3)  # the last step reaches the nodes
    s = status() or s
    ids = {}
    for n in nodes:
        m = re.search(r"joined run \S+ as ([0-9a-f]{8})", lab.log(f"worker-{n.name}"))
        ids[n.name] = m.group(1) if m else None
    # every step published as a delta (the status lists only the steps still kept, the last k + 2)
    deltas = {int(n) for n, enc in re.findall(r"step (\d+) published \(([\w-]+),", lab.log("coordinator"))
              if enc != "full"}
    deltas |= {c["step"] for c in s.get("checkpoints", []) if c.get("encoding") != "full"}
    rows = {r["node_id"][:8]: r for r in s.get("nodes", [])}
    fetcher_lines = {n.name: re.findall(r"fetched steps (\S+) in ([\d.]+) s: (\d+) requests, (\d+) new conn",
                                        lab.log(f"worker-{n.name}")) for n in nodes}
    lab.check_delay_lines()  # a dead delay line fails open: the run would have lost that site's latency
    lab.close()  # the sniffers flush and stop
    out = {"trainer_steps": s.get("step"), "wall_s": round(wall, 1),
           "bytes_by_source": s.get("checkpoint_bytes_by_source"), "nodes": {}}
    for n, d in zip(nodes, delays_ms):
        r = analyse(read_sniff(sniffs[n.name]), 2 * d / 1e3, deltas or None)
        row = rows.get(ids[n.name] or "", {})
        base = steady[0].get(ids[n.name] or "", 0) if steady else None
        r.update(one_way_ms=d, accepted=row.get("accepted"), policy_step=row.get("policy_step"),
                 fetcher_log_syncs=len(fetcher_lines[n.name]),
                 accepted_steady=(row.get("accepted") or 0) - base if base is not None else None,
                 steady_from_step=steady[1] if steady else None)
        out["nodes"][str(int(d))] = r
    return out


# -- N nodes: time until every node holds a step ------------------------------------------------------
UPLINK_MBIT = {"home": 20.0, "public": 200.0, "dc": 1000.0}
DOWNLINK_MBIT = {"home": 100.0, "public": 200.0, "dc": 1000.0}


def swarm_sites(n: int) -> list[tuple[str, object, str]]:
    """The issue's mix, deterministic: of every 10 nodes 6 at home behind NAT (20-100 ms one way, 20 up / 100
    down), 3 on public fibre (5-20 ms, 200/200), 1 in a datacenter (1 ms, 1 Gbit/s). (name, profile, kind)."""
    from tests.wan.lab import Profile, home, public

    pattern = "hphhphdhph"
    kinds = [pattern[i % 10] for i in range(n)]
    homes, pubs = kinds.count("h"), kinds.count("p")
    out, hi, pi = [], 0, 0
    for i, k in enumerate(kinds):
        if k == "h":
            d = 20.0 + 80.0 * hi / max(1, homes - 1)
            hi += 1
            out.append((f"h{i}", home(round(d)), "home"))
        elif k == "p":
            d = 5.0 + 15.0 * pi / max(1, pubs - 1)
            pi += 1
            out.append((f"p{i}", public(round(d)), "public"))
        else:
            out.append((f"d{i}", Profile("public", 1.0, "1gbit", "1gbit"), "dc"))
    return out


def run_swarm(root: Path, n: int, steps: int, workdir: Path, *, origin_mbit: float, timeout_s: float = 420.0,
              extra: tuple[str, ...] = (), tail_s: float = 60.0) -> dict:
    """N nodes of the issue's mix follow the real coordinator for `steps` steps (the origin's upload capped at
    `origin_mbit`). The bench polls every node's checkpoint directory (first sight of each step, every 0.1 s:
    not the code under test) and times each step from its publication until every node holds it (or a later
    step), against a lower bound: what the origin's and the nodes' uplinks could move at best, plus the
    farthest node's round trip. With JSON logs, the steps published before every node's engine was up are left
    out of the medians (`steps_counted` says how many are in)."""
    import threading

    from tests.wan.lab import Lab

    cap = int(origin_mbit * 1e6 / 8)
    common = ["--config", str(root / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", *extra]
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    sites = swarm_sites(n)
    seen: dict[str, dict[int, float]] = {name: {} for name, _, _ in sites}
    load, stop = [], threading.Event()
    cpu: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds so far by process), every ~1 s
    next_cpu = [0.0]

    def poll():
        while not stop.is_set():
            t = time.time()
            if t >= next_cpu[0] and len(cpu) < 10_000:
                cpu.append((t, _cpu_by_process(workdir, seen)))
                next_cpu[0] = t + 1.0
            for name in seen:
                try:
                    for e in os.listdir(workdir / name / "checkpoints"):
                        if e.isdigit():
                            seen[name].setdefault(int(e), t)
                except OSError:
                    pass
            if len(load) < 100_000:
                load.append(float(Path("/proc/loadavg").read_text().split()[0]))
            stop.wait(0.1)

    with Lab() as lab:
        dc, nodes, url, coord = start_run(
            lab, root, [(a, b) for a, b, _ in sites], workdir,
            [*common, f"--set=run.max_steps={steps}", f"--set=distribution.origin_upload_limit={cap}"],
            [*common, "--set=p2p.stats_log_s=2"])
        th = threading.Thread(target=poll, daemon=True)
        th.start()
        t_start, st = time.monotonic(), {}
        while time.monotonic() - t_start < timeout_s:
            st = lab_status(lab, dc, url) or st
            if st.get("step", 0) >= steps:
                break
            if coord.poll() is not None:
                raise RuntimeError("the coordinator exited:\n" + lab.log("coordinator")[-3000:])
            time.sleep(1)
        wall = time.monotonic() - t_start
        # The last steps reach the nodes (the trainer has stopped, so this changes no earlier step's time; with
        # a fixed 5 s the slowest homes' last 2-3 steps used to count as missed), then their p2p totals are
        # logged (every 2 s).
        t_tail = time.monotonic()
        while time.monotonic() - t_tail < tail_s and min((max(s, default=0) for s in seen.values()), default=0) < steps:
            time.sleep(0.5)
        tail = time.monotonic() - t_tail
        time.sleep(3)
        st = lab_status(lab, dc, url) or st
        rss = _rss_mb(lab)
        logs = {nd.name: lab.log(f"worker-{nd.name}") for nd in nodes}
        for name, text in logs.items():  # kept beside the run (the lab's own log folder goes with it)
            (workdir / f"{name}.log").write_text(text)
        lab.check_delay_lines()
        stop.set()
        th.join(5)
    ids = {}
    for name, text in logs.items():
        m = re.search(r"joined run \S+ as ([0-9a-f]{8})", text)
        ids[name] = m.group(1) if m else None
    rows = {r["node_id"][:8]: r for r in st.get("nodes", [])}
    per_node = {}
    for name, prof, kind in sites:
        served = re.findall(r"p2p totals: served (\d+) bytes, fetched (\d+) bytes \((\w+)\)", logs[name])
        row = rows.get(ids[name] or "", {})
        per_node[name] = {"kind": kind, "one_way_ms": prof.one_way_ms, "rtt_ms": 2 * prof.one_way_ms,
                          "natted": kind == "home", "served_bytes": int(served[-1][0]) if served else 0,
                          "reach": served[-1][2] if served else None, "accepted": row.get("accepted"),
                          "steps_seen": len(seen[name])}
    ups = [UPLINK_MBIT[k] * 1e6 / 8 for _, _, k in sites]
    downs = [DOWNLINK_MBIT[k] * 1e6 / 8 for _, _, k in sites]
    max_rtt = max(2 * p.one_way_ms for _, p, _ in sites) / 1e3
    # When every node's engine was up ("now generating", JSON logs only): a step published before it reached nodes
    # that were still loading torch and the model, all on this box's 2 cores (7-8 s for a home at N = 6 on
    # 2026-11-28, while the trainer stepped every ~0.7 s with the public nodes' rollouts): that measures the
    # lab's start-up, not the distribution, and is left out of the medians (kept in per_step, `startup`).
    engine_up = [min(ev["engine"].values(), default=None) for ev in map(_node_events, logs.values())]
    all_up = max(engine_up) if engine_up and None not in engine_up else None
    steps_out = []
    for rec in st.get("step_log", []):
        s_, pub = rec["step"], rec["published_ms"] / 1e3
        if s_ < 1:
            continue
        times = []
        for name in seen:
            later = [t for k, t in seen[name].items() if k >= s_]
            times.append(min(later) if later else None)
        size = rec["compressed_bytes"]
        lb = max(size / cap, max(size / d for d in downs), n * size / (cap + sum(ups))) + max_rtt
        t_all = None if None in times else max(times) - pub
        steps_out.append({"step": s_, "encoding": rec["encoding"], "bytes": size, "t_all_s": _r(t_all),
                          "t_median_s": _r(statistics.median(t - pub for t in times if t is not None)) if any(
                              t is not None for t in times) else None,
                          "lower_bound_s": round(lb, 3), "vs_bound": _r(t_all / lb if t_all is not None else None),
                          "nodes_missing": times.count(None), "startup": all_up is not None and pub < all_up})

    def med(enc, key):
        xs = [x[key] for x in steps_out if x[key] is not None and (x["encoding"] == "full") == (enc == "full")
              and not x["startup"]]
        return _r(statistics.median(xs)) if xs else None

    counted = [rec["published_ms"] / 1e3 for rec in st.get("step_log", []) if rec["step"] >= 1
               and (all_up is None or rec["published_ms"] / 1e3 >= all_up)]
    cpu_use = _cpu_window(cpu, counted, {name: kind for name, _, kind in sites})
    by_kind = {}
    for k in ("home", "public", "dc"):
        xs = [v["served_bytes"] for v in per_node.values() if v["kind"] == k]
        if xs:
            by_kind[k] = {"nodes": len(xs), "served_bytes": sum(xs), "served_per_node": int(sum(xs) / len(xs))}
    bsrc = st.get("checkpoint_bytes_by_source") or {}
    # phases (bench/wan.py --loopback's) when the run's logs are JSON lines (--set server.log_format=json); the
    # namespaces share the host's clock
    phases = breakdown = None
    if "server.log_format=json" in " ".join(extra):
        phases = step_phases(st, [logs[nd.name] for nd in nodes])[0]
        deltas = {x["step"] for x in steps_out if x["encoding"] != "full"}
        breakdown = shard_breakdown(logs, {name: DOWNLINK_MBIT[k] for name, _, k in sites},
                                    {name: 2 * p.one_way_ms / 1e3 for name, p, _ in sites}, deltas,
                                    {name: k for name, _, k in sites})
    return {"n": n, "steps": steps, "trainer_steps": st.get("step"), "wall_s": round(wall, 1), "tail_s": round(tail, 1),
            "phases_s": phases, "shard_breakdown": breakdown,
            "origin_mbit": origin_mbit, "bytes_by_source": bsrc, "origin_bytes": st.get("bytes_served"),
            "served_by_kind": by_kind, "natted_served_bytes": by_kind.get("home", {}).get("served_bytes", 0),
            "full": {"t_all_s": med("full", "t_all_s"), "lower_bound_s": med("full", "lower_bound_s"),
                     "vs_bound": med("full", "vs_bound")},
            "delta": {"t_all_s": med("delta", "t_all_s"), "lower_bound_s": med("delta", "lower_bound_s"),
                      "vs_bound": med("delta", "vs_bound"), "t_median_s": med("delta", "t_median_s")},
            "steps_missed": sum(1 for x in steps_out if x["nodes_missing"]),
            "steps_counted": sum(1 for x in steps_out if not x["startup"]),
            "load_avg_max": max(load, default=None), "rss_mb": rss, "cpu": cpu_use, "per_step": steps_out,
            "nodes": per_node}


def _cpu_by_process(workdir: Path, names) -> dict[str, float]:
    """CPU seconds (user + system, every thread) so far of each process of a --scale run, read from /proc: each
    node by its name (its storage dir under `workdir`), "coordinator" (the API process), "engine" (the
    coordinator's engine process and its trainer ranks), "delay" (every delay line: the lab's network), "other"
    processes of this run. Not the code under test: the kernel's own accounting."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    storage = {f"--set=worker.storage_dir={workdir / n}": n for n in names}  # a whole argument: h2 is not h23
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cmd = " ".join(args)
        if "delay_line.py" in cmd:
            role = "delay"
        elif str(workdir) not in cmd:
            continue
        elif "coordinator" in args:
            role = "coordinator"
        elif "node.coordinator.engine" in args or "node.trainer" in cmd:
            role = "engine"
        else:
            role = next((storage[a] for a in args if a in storage), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_window(cpu: list, published: list[float], kinds: dict[str, str]) -> dict | None:
    """Where the box's CPU went over the counted steps (from the first counted step's publication to the last's):
    cores used by each role, and each node's CPU seconds per step (median by kind), beside the box's cores."""
    if len(published) < 2 or len(cpu) < 2:
        return None
    t0, t1 = published[0], published[-1]
    a = min(cpu, key=lambda x: abs(x[0] - t0))
    b = min(cpu, key=lambda x: abs(x[0] - t1))
    span, steps = b[0] - a[0], len(published) - 1
    if span <= 0:
        return None
    used = {k: b[1].get(k, 0.0) - a[1].get(k, 0.0) for k in b[1]}
    roles = {"nodes": sum(v for k, v in used.items() if k in kinds),
             **{k: v for k, v in used.items() if k not in kinds}}
    per_step = {kind: _r(statistics.median(used.get(n, 0.0) / steps for n, k in kinds.items() if k == kind))
                for kind in sorted(set(kinds.values()))}
    return {"window_s": round(span, 1), "steps": steps, "box_cores": os.cpu_count(),
            "cores": {k: round(v / span, 3) for k, v in sorted(roles.items(), key=lambda x: -x[1])},
            "cores_total": round(sum(used.values()) / span, 3),
            "node_cpu_s_per_step": per_step,
            "cpu_s_per_step": {k: round(v / steps, 3) for k, v in roles.items()}}


# -- loopback: where a step's seconds go between publication and "held" ----------------------------------
def run_loopback(root: Path, n: int, steps: int, workdir: Path, *, timeout_s: float = 420.0,
                 extra: tuple[str, ...] = ()) -> dict:
    """The real CLI coordinator and `n` real `prime-node join` processes on 127.0.0.1 (the demo's config,
    p2p on unless `extra` says otherwise, JSON logs), `steps` trainer steps; no lab, no root. Each step's time
    from its publication (the ledger's published_ms) until each node holds it is cut into phases from the
    processes' own log lines: announced (the coordinator's gossip reached the node: "step N announced"), sync
    start (the fetch that brought the step began: "fetched steps A..B in X s" minus X), held (its payload
    committed: "holding step N"), engine (the engine generates with it: "now generating with step N"; a node
    that skipped the step to a newer one has none)."""
    import urllib.request

    common = ["--config", str(root / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", "--set=server.log_format=json", *extra]
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    procs: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def spawn(name: str, args: list[str]) -> subprocess.Popen:
        with open(workdir / f"{name}.log", "w") as f:  # the child keeps its own copy of the descriptor
            p = subprocess.Popen(cli(root, *args), cwd=root, stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        procs.append((name, p))
        return p

    ready = workdir / "coordinator.ready"
    t_start = time.monotonic()
    try:
        coord = spawn("coordinator", ["coordinator", *common, f"--set=run.max_steps={steps}",
                                      f"--set=storage.dir={workdir / 'coord'}", "--set=p2p.listen_host=127.0.0.1",
                                      "--ready-file", str(ready)])
        while not ready.is_file():
            if coord.poll() is not None or time.monotonic() - t_start > 120:
                raise RuntimeError("the coordinator did not start:\n" + (workdir / "coordinator.log").read_text()[-3000:])
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        url = info["url"]
        for i in range(n):
            spawn(f"w{i}", ["join", "--coordinator", url, "--coordinator-key", info["key"], *common,
                            f"--set=worker.storage_dir={workdir / f'w{i}'}", "--set=worker.heartbeat_seconds=1",
                            "--set=p2p.listen_host=127.0.0.1"])
        st: dict = {}
        while time.monotonic() - t_start < timeout_s:
            try:
                st = json.loads(urllib.request.urlopen(url + "/v1/status", timeout=5).read())
            except OSError:
                pass
            if st.get("step", 0) >= steps:
                break
            if coord.poll() is not None:
                raise RuntimeError("the coordinator exited:\n" + (workdir / "coordinator.log").read_text()[-3000:])
            time.sleep(1)
        wall = time.monotonic() - t_start
        time.sleep(4)  # the last step reaches the nodes
        rss = {name: _pid_rss_mb(p.pid) for name, p in procs}
    finally:
        for _, p in reversed(procs):  # only the processes started here, by pid
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    logs = [(workdir / f"w{i}.log").read_text(errors="replace") for i in range(n)]
    summary, per_step, pushed, t_all = step_phases(st, logs)
    return {"n": n, "steps": steps, "trainer_steps": st.get("step"), "wall_s": round(wall, 1),
            "phases_s": summary, "announcements_seen": pushed,
            "delta_t_all_s": {"median": _r(statistics.median(t_all)) if t_all else None, "p90": _r(_pct(t_all, 0.9))},
            "rss_mb": rss, "per_step": per_step}


def step_phases(st: dict, logs: list[str]) -> tuple[dict, list, int, list]:
    """From the coordinator's status (its step_log) and each worker's JSON log: the phases of every delta step
    on every node (median, p90), each step's time to all nodes and to the median node, the announcements seen."""
    n = len(logs)
    events = [_node_events(text) for text in logs]
    published = {r["step"]: (r["published_ms"] / 1e3, r["encoding"], r["compressed_bytes"])
                 for r in st.get("step_log", []) if r["step"] >= 1}
    phases: dict[str, list[float]] = {k: [] for k in PHASES}
    per_step = []
    for s_, (pub, enc, size) in sorted(published.items()):
        held_all = []
        for ev in events:
            held = ev["held"].get(s_)
            held_all.append(held)
            if held is None or enc == "full":
                continue
            start = next((t0 for t0, a, b in ev["syncs"] if a <= s_ <= b), None)
            ann = ev["announced"].get(s_)
            row = {"announced": ann - pub if ann is not None else None,
                   "sync_start": start - pub if start is not None else None,
                   "fetch": held - start if start is not None else None,
                   "held": held - pub,
                   "engine": ev["engine"][s_] - held if s_ in ev["engine"] else None}
            for k, v in row.items():
                if v is not None:
                    phases[k].append(v)
        got = [h for h in held_all if h is not None]
        per_step.append({"step": s_, "encoding": enc, "bytes": size,
                         "t_all_s": _r(max(got) - pub) if len(got) == n else None,
                         "t_median_s": _r(statistics.median(got) - pub) if got else None,
                         "nodes_missing": n - len(got)})
    summary = {k: {"median": _r(statistics.median(v)) if v else None, "p90": _r(_pct(v, 0.9)), "n": len(v)}
               for k, v in phases.items()}
    pushed = sum(len(ev["announced"]) for ev in events)
    t_all = [x["t_all_s"] for x in per_step if x["t_all_s"] is not None and x["encoding"] != "full"]
    return summary, per_step, pushed, t_all


PHASES = ("announced", "sync_start", "fetch", "held", "engine")


def _pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _node_events(log_text: str) -> dict:
    """A worker's JSON log lines as times: announced/held/engine by step, and each sync as (start, first, last)."""
    ev: dict = {"announced": {}, "held": {}, "engine": {}, "syncs": []}
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        msg, ts = rec.get("msg", ""), rec.get("ts", 0.0)
        if m := re.match(r"step (\d+) announced", msg):
            ev["announced"].setdefault(int(m.group(1)), ts)
        elif m := re.match(r"holding step (\d+)", msg):
            ev["held"].setdefault(int(m.group(1)), ts)
        elif m := re.match(r"now generating with step (\d+)", msg):
            ev["engine"].setdefault(int(m.group(1)), ts)
        elif m := re.match(r"fetched steps (\d+)(?:\.\.(\d+))? in ([\d.]+) s", msg):
            a = int(m.group(1))
            ev["syncs"].append((ts - float(m.group(3)), a, int(m.group(2) or a)))
    return ev


_SHARDS_LINE = re.compile(r"shards of step (\d+) in ([\d.]+) s: (.*)")
_TRY = re.compile(r"(coordinator|relay|peer) (ok|defer|err|bad) ([\d.]+)(?: (\d+)KB)?(?: \[([^\]]*)\])?")


def shard_breakdown(logs: dict[str, str], down_mbit: dict[str, float], rtt_s: dict[str, float],
                    deltas: set[int], kinds: dict[str, str] | None = None) -> dict:
    """Where a delta shard's seconds go, from the fetcher's per-step line ("shards of step N in X s: ...", one
    entry per shard: each request's source kind, outcome, seconds, bytes, and the waits between). Per shard
    fetched: `wait` (unpicked: for a free slot, then for a deferral to run out or a peer to announce it),
    `deferred` (the requests answered "not now": the origin's 429 or every holding peer busy), `failed`
    (errors, e.g. a hinted holder that did not hold it yet), `ok` (the request that brought it) cut into
    `transfer` (its bytes at the node's downlink) and `rtt` (the rest: round trips, queueing, the sender's
    CPU). Also per step: `before` (sync start to the first shard request: listing and manifests), `download`,
    `commit` (rebuild until "holding step"). `logs`: node name -> its JSON log; `kinds`: node name -> home,
    public or dc (a peer-served shard is grouped by its server's kind)."""
    kinds = kinds or {}
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    peers = {}  # the last 6 characters of a node's peer id -> its name
    for name, text in logs.items():
        if m := re.search(r"p2p node (\S+) listening", text):
            peers[m.group(1)[-6:]] = name
    for name, text in logs.items():
        recs = [r for r in (_json(x) for x in text.splitlines() if x.startswith("{")) if r]
        syncs = [(r["ts"] - float(m.group(3)), int(m.group(1)), int(m.group(2) or m.group(1)))
                 for r in recs if (m := re.match(r"fetched steps (\d+)(?:\.\.(\d+))? in ([\d.]+) s", r["msg"]))]
        held = {int(m.group(1)): r["ts"] for r in recs if (m := re.match(r"holding step (\d+)", r["msg"]))}
        for r in recs:
            m = _SHARDS_LINE.match(r["msg"])
            if not m or int(m.group(1)) not in deltas:
                continue
            step, dl = int(m.group(1)), float(m.group(2))
            start = next((t0 for t0, a, b in syncs if a <= step <= b), None)
            steps.append({"node": name, "step": step, "download": dl,
                          "before": r["ts"] - dl - start if start is not None else None,
                          "commit": held[step] - r["ts"] if step in held else None})
            for entry in m.group(3).split(" | "):
                idx, _, rest = entry.partition(" ")
                row: dict[str, Any] = {"node": name, "step": step, "shard": int(idx), "wait": 0.0, "waits": 0, "deferred": 0.0,
                       "deferrals": 0, "failed": 0.0, "failures": 0, "ok": None, "source": None, "bytes": 0}
                for w in re.findall(r"wait ([\d.]+)", rest):
                    row["wait"] += float(w)
                    row["waits"] += 1
                for kind, outcome, sec, kb, via in _TRY.findall(rest):
                    if outcome == "ok":
                        row.update(ok=float(sec), source=kind, bytes=int(kb or 0) * 1000)
                        who = [t.split("/")[0] for t in via.split(",") if "=ok/" in t]
                        if who:  # which node served it: "peer:<its kind>"
                            row["from"] = peers.get(who[0], "?")
                            row["source"] = f"peer:{kinds.get(row['from'], '?')}"
                    elif outcome == "defer":
                        row["deferred"] += float(sec)
                        row["deferrals"] += 1
                    else:
                        row["failed"] += float(sec)
                        row["failures"] += 1
                if row["ok"] is None:
                    continue
                row["transfer"] = row["bytes"] * 8 / (down_mbit[name] * 1e6)
                row["rtt"] = max(0.0, row["ok"] - row["transfer"])
                row["node_rtt_s"] = rtt_s[name]
                row["total"] = row["wait"] + row["deferred"] + row["failed"] + row["ok"]
                rows.append(row)
    keys = ("total", "wait", "deferred", "failed", "ok", "transfer", "rtt")

    def summary(rs: list[dict]) -> dict:
        out: dict = {"shards": len(rs)}
        for k in keys:
            xs = [x[k] for x in rs]
            out[k] = {"median": _r(statistics.median(xs)) if xs else None, "mean": _r(statistics.mean(xs)) if xs else None,
                      "sum": _r(sum(xs))}
        out["deferrals"] = sum(x["deferrals"] for x in rs)
        out["failures"] = sum(x["failures"] for x in rs)
        out["rtts_in_ok"] = _r(statistics.median(x["rtt"] / x["node_rtt_s"] for x in rs)) if rs else None
        return out

    by = {"all": summary(rows)}
    for src in sorted({x["source"] for x in rows}):
        by[src] = summary([x for x in rows if x["source"] == src])
    by["deferred_first"] = summary([x for x in rows if x["deferrals"]])
    for k in sorted(set(kinds.values())):
        by[f"to {k}"] = summary([x for x in rows if kinds.get(x["node"]) == k])
    # each node-step's slowest shard: what the step waited for
    slowest: dict[tuple, dict] = {}
    for x in rows:
        key = (x["node"], x["step"])
        if key not in slowest or x["total"] > slowest[key]["total"]:
            slowest[key] = x
    by["slowest of a step"] = summary(list(slowest.values()))
    per_step = {}
    for k in ("before", "download", "commit"):
        xs = [x[k] for x in steps if x[k] is not None]
        per_step[k] = {"median": _r(statistics.median(xs)) if xs else None, "p90": _r(_pct(xs, 0.9))}
    return {"by_source": by, "step_parts": per_step, "node_steps": len(steps)}


def _json(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("msg"), str) else None


def print_breakdown(b: dict) -> None:
    """The table of `shard_breakdown`: seconds per delta shard (mean / median) by the source that served it."""
    print(f"delta shards: where a shard's seconds go (mean/median s), {b['node_steps']} node-steps; step parts "
          + ", ".join(f"{k} {_f(v['median'])}/{_f(v['p90'])}" for k, v in b["step_parts"].items()) + " (median/p90)")
    print(f"{'shards':18} {'shards':>6} {'defers':>6} {'fails':>5} " + " ".join(
        f"{k:>11}" for k in ("total", "wait", "deferred", "failed", "ok", "transfer", "rtt")) + f" {'RTTs in ok':>10}")
    for src, v in b["by_source"].items():
        cells = " ".join(f"{_f(v[k]['mean']):>5}/{_f(v[k]['median']):<5}" for k in
                         ("total", "wait", "deferred", "failed", "ok", "transfer", "rtt"))
        print(f"{src:18} {v['shards']:>6} {v['deferrals']:>6} {v['failures']:>5} {cells} {_f(v['rtts_in_ok']):>10}")


def _pid_rss_mb(pid: int) -> float | None:
    try:
        m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return round(int(m.group(1)) / 1024) if m else None


def print_loopback(rows: list[dict]) -> None:
    print(f"{'N':>3} {'label':12} " + " ".join(f"{k + ' med/p90':>20}" for k in PHASES) + f" {'t_all med':>9}")
    for r in rows:
        cells = " ".join(f"{_f(r['phases_s'][k]['median']):>9}/{_f(r['phases_s'][k]['p90']):<10}" for k in PHASES)
        print(f"{r['n']:>3} {r.get('label', ''):12} {cells} {_f(r['delta_t_all_s']['median']):>9}")


def _rss_mb(lab) -> dict:
    """Resident memory of the run's processes (MB): the coordinator and the sum over the workers."""
    out = {"coordinator": 0.0, "workers": 0.0}
    for ns in list(lab._namespaces):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            m = re.search(r"VmRSS:\s+(\d+) kB", status)
            if not m:
                continue
            if b"\0join\0" in cmd:  # (a worker's command line names --coordinator too)
                out["workers"] += int(m.group(1)) / 1024
            elif b"\0coordinator\0" in cmd:
                out["coordinator"] += int(m.group(1)) / 1024
    return {k: round(v) for k, v in out.items()}


def _r(x):
    return None if x is None else round(x, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    sn = sub.add_parser("sniff")
    sn.add_argument("--iface", required=True)
    sn.add_argument("--peer", required=True)
    sn.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=None, help="a checkout of the old code to compare against")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--delays", default="10,50,100", help="one-way delays of the home nodes, ms")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_wan"))
    ap.add_argument("--no-p2p", action="store_true",
                    help="p2p.enabled=false: only the origin, no super-seeding deferrals (the fetcher's own round trips)")
    ap.add_argument("--key", default=None, help="the key of wan.json to write (default: no_p2p or p2p)")
    ap.add_argument("--scale", default=None, help="N values (e.g. 6,12,24): time until every node holds a step; with "
                    "--set server.log_format=json also each delta's phases and where its shards' seconds go")
    ap.add_argument("--origin-mbit", type=float, default=20.0, help="--scale: the origin's upload cap, Mbit/s")
    ap.add_argument("--loopback", default=None,
                    help="N values (e.g. 1,6): no lab, no root; where a step's time goes from publication to held")
    ap.add_argument("--forwarded", action="store_true",
                    help="the defaults at home with both ports forwarded, beside two NATed homes (docs/OPERATIONS.md)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="--loopback, --scale: a config override for the coordinator and every node (e.g. p2p.http=true)")
    args = ap.parse_args()
    if args.cmd == "sniff":
        sniff(args.iface, args.peer, args.out)
        return
    if args.loopback:
        extra = (*(("--set=p2p.enabled=false",) if args.no_p2p else ()), *(f"--set={x}" for x in args.sets))
        rows = []
        for n in args.loopback.split(","):
            r = run_loopback(REPO, int(n), args.steps, args.workdir / f"loop{n}", extra=extra)
            r["label"] = args.key or "loopback"
            rows.append(r)
        print_loopback(rows)
        res = REPO / "bench" / "results" / "wan_loopback.json"
        old = json.loads(res.read_text()) if res.is_file() else {}
        old[args.key or "loopback"] = {"steps": args.steps, "rows": rows}
        res.write_text(json.dumps(old, indent=1) + "\n")
        print(f"wrote {res.relative_to(REPO)}")
        return
    sys.path.insert(0, str(REPO))
    from tests.wan.lab import unavailable

    if why := unavailable():
        sys.exit(f"bench/wan.py: {why}")
    res = REPO / "bench" / "results" / "wan.json"
    extra = (*(("--set=p2p.enabled=false",) if args.no_p2p else ()), *(f"--set={x}" for x in args.sets))
    if args.forwarded:
        r = run_forwarded(args.steps, args.workdir / "forwarded", extra)
        old = json.loads(res.read_text()) if res.is_file() else {}
        old[args.key or "forwarded"] = r
        res.write_text(json.dumps(old, indent=1) + "\n")
        print(f"wrote {res.relative_to(REPO)}")
        return
    if args.scale:
        rows = [run_swarm(REPO, int(n), args.steps, args.workdir / f"n{n}", origin_mbit=args.origin_mbit, extra=extra)
                for n in args.scale.split(",")]
        print_scale(rows)
        for r in rows:
            if r.get("shard_breakdown"):
                print_breakdown(r["shard_breakdown"])
        old = json.loads(res.read_text()) if res.is_file() else {}
        prev = {r["n"]: r for r in old.get(args.key or "scale", {}).get("rows", [])}
        prev.update({r["n"]: r for r in rows})
        old[args.key or "scale"] = {"steps": args.steps, "origin_mbit": args.origin_mbit,
                                    "rows": [prev[k] for k in sorted(prev)]}
        res.write_text(json.dumps(old, indent=1) + "\n")
        plot(old)
        print(f"wrote {res.relative_to(REPO)} and docs/wan.png")
        return
    delays = [float(x) for x in args.delays.split(",")]
    runs = {}
    if args.base is not None:
        runs["before"] = run_loop(args.base.resolve(), delays, args.steps, args.workdir / "before", extra=extra)
    runs["after"] = run_loop(REPO, delays, args.steps, args.workdir / "after", extra=extra)
    print(f"{'code':7} {'RTT ms':>6} {'steps':>5} {'req/step':>8} {'conn/step':>9} {'delta s':>7} "
          f"{'delta RTTs':>10} {'RTTs+xfer':>9} {'waves':>5} {'all s/step':>10} {'accepted':>8}")
    for name, run in runs.items():
        for d, r in run["nodes"].items():
            print(f"{name:7} {r['rtt_ms']:>6} {r['steps_fetched']:>5} {r['requests_per_step']:>8} "
                  f"{r['connects_per_step']:>9} {_f(r['delta_s_per_step']):>7} {_f(r['delta_rtts']):>10} "
                  f"{_f(r['delta_rtts_beyond_transfer']):>9} {_f(r.get('delta_waves')):>5} {_f(r['all_s_per_step']):>10} "
                  f"{str(r['accepted']):>8}")
        print(f"{name:7} trainer steps {run['trainer_steps']} in {run['wall_s']} s; bytes by source "
              f"{run['bytes_by_source']}")
    old = json.loads(res.read_text()) if res.is_file() else {}
    old[args.key or ("no_p2p" if args.no_p2p else "p2p")] = {"delays_ms": delays, "steps": args.steps, "runs": runs}
    res.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {res.relative_to(REPO)}")


def run_forwarded(steps: int, workdir: Path, extra: tuple[str, ...], timeout_s: float = 240.0) -> dict:
    """docs/OPERATIONS.md's "at home with forwarded ports", tried: a home whose router forwards both of the node's
    ports (libp2p 4001, HTTP 4002) beside two NATed homes with the same uplink and round trip (25 ms one way).
    Every node sets p2p.listen_port=4001 and p2p.http_port=4002 and nothing else of p2p (the defaults: p2p.http
    on); only the first home's router forwards them. What the join's dial-back told each node (its log line),
    the bytes each served, and each delta's seconds from publication to held (the coordinator's and the node's
    JSON log lines)."""
    from tests.wan.lab import Lab, home, json_lines

    sites: list[tuple[str, object]] = [("fwd", home(25.0, forward=(4001, 4002))), ("home1", home(25.0)),
                                       ("home2", home(25.0))]
    common = ["--config", str(REPO / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", "--set=server.log_format=json", *extra]
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    with Lab() as lab:
        dc, nodes, url, coord = start_run(
            lab, REPO, sites, workdir, [*common, f"--set=run.max_steps={steps}"],
            [*common, "--set=p2p.listen_port=4001", "--set=p2p.http_port=4002", "--set=p2p.stats_log_s=1"])
        t0, st = time.monotonic(), dict[str, Any]()
        while time.monotonic() - t0 < timeout_s:
            st = lab_status(lab, dc, url) or st
            rows = st.get("nodes", [])
            if st.get("step", 0) >= steps and len(rows) == len(nodes) and {r.get("policy_step") for r in rows} == {steps}:
                break
            if coord.poll() is not None:  # type: ignore[attr-defined]  # a Popen
                raise RuntimeError("the coordinator exited:\n" + lab.log("coordinator")[-3000:])
            time.sleep(1)
        time.sleep(2.5)  # the last "p2p totals" lines
        lab.check_delay_lines()
        published = {int(m.group(1)): r["ts"] for r in json_lines(lab.log("coordinator"))
                     if (m := re.match(r"step (\d+) published", r["msg"]))}
        out: dict = {"steps": steps, "trainer_steps": st.get("step"),
                     "by_source": st.get("checkpoint_bytes_by_source"), "nodes": {}}
        for nd in nodes:
            rows = json_lines(lab.log(f"worker-{nd.name}"))
            said = next((r["msg"] for r in rows if "reachable at" in r["msg"]), None)
            held = {int(m.group(1)): r["ts"] for r in rows if (m := re.match(r"holding step (\d+)", r["msg"]))}
            lags = [held[k] - published[k] for k in held if k in published and k >= 1]
            tot = [m for r in rows if (m := re.match(r"p2p totals: served (\d+) bytes, fetched (\d+) bytes", r["msg"]))]
            out["nodes"][nd.name] = {"dialback": said[:300] if said else None,
                                     "served": int(tot[-1].group(1)) if tot else 0,
                                     "fetched": int(tot[-1].group(2)) if tot else 0,
                                     "steps_held": len(lags), "held_median_s": _r(statistics.median(lags)) if lags else None}
    for name, row in out["nodes"].items():
        print(f"{name:6} served {row['served']:>9} fetched {row['fetched']:>9} steps held {row['steps_held']} "
              f"publish->held median {_f(row['held_median_s'])} s\n       {row['dialback']}")
    print(f"bytes by source {out['by_source']}")
    return out


def print_scale(rows: list[dict]) -> None:
    print(f"{'N':>3} {'full s':>7} {'bound':>6} {'x':>5} {'delta s':>7} {'bound':>6} {'x':>5} {'origin MB':>9} "
          f"{'peer MB':>8} {'NATed served MB':>15} {'public/node MB':>14} {'home/node MB':>12} {'missed':>6} "
          f"{'counted':>7} {'load':>5} {'RSS MB':>7}")
    for r in rows:
        k = r["served_by_kind"]
        print(f"{r['n']:>3} {_f(r['full']['t_all_s']):>7} {_f(r['full']['lower_bound_s']):>6} "
              f"{_f(r['full']['vs_bound']):>5} {_f(r['delta']['t_all_s']):>7} {_f(r['delta']['lower_bound_s']):>6} "
              f"{_f(r['delta']['vs_bound']):>5} {(r['origin_bytes'] or 0) / 1e6:>9.1f} "
              f"{(r['bytes_by_source'].get('peer') or 0) / 1e6:>8.1f} {r['natted_served_bytes'] / 1e6:>15.1f} "
              f"{k.get('public', {}).get('served_per_node', 0) / 1e6:>14.2f} "
              f"{k.get('home', {}).get('served_per_node', 0) / 1e6:>12.2f} {r['steps_missed']:>6} "
              f"{r.get('steps_counted', '-'):>7} {_f(r['load_avg_max']):>5} "
              f"{r['rss_mb']['workers'] + r['rss_mb']['coordinator']:>7}")
    for r in rows:
        if c := r.get("cpu"):
            print(f"N = {r['n']}: {c['cores_total']:.2f} of {c['box_cores']} cores over {c['steps']} counted steps "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in c['cores'].items())}); a node's CPU-s per step "
                  f"{c['node_cpu_s_per_step']}")


def plot(doc: dict) -> None:
    """docs/wan.png: time until every node holds a step against N (measured and lower bound), and the fair
    split of work (accepted rollouts by round trip) where wan.json has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.get("scale", {}).get("rows", [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    ns = [r["n"] for r in rows]
    for enc, color in (("full", "#4c8bf5"), ("delta", "#f5a24c")):
        a.plot(ns, [r[enc]["t_all_s"] for r in rows], "o-", color=color, label=f"{enc}: measured")
        a.plot(ns, [r[enc]["lower_bound_s"] for r in rows], "x--", color=color, label=f"{enc}: lower bound")
    a.set_xlabel("nodes (60 % home behind NAT)")
    a.set_ylabel("s until every node holds the step")
    a.set_title("time to all nodes (median step)")
    a.set_ylim(bottom=0)
    a.legend(fontsize=7)
    fair = doc.get("fair_share", {}).get("runs", {})
    for i, (name, run) in enumerate(fair.items()):
        ds = list(run["nodes"])
        b.bar([x + 0.4 * i for x in range(len(ds))],
              [run["nodes"][d].get("accepted_steady") or run["nodes"][d]["accepted"] or 0 for d in ds], width=0.4,
              label=name)
        b.set_xticks([x + 0.2 for x in range(len(ds))], [f"{run['nodes'][d]['rtt_ms']} ms" for d in ds])
    b.set_xlabel("node's round trip to the coordinator")
    b.set_ylabel("accepted rollouts (once all generate)")
    b.set_title("work by round trip, same compute (p2p off)")
    if fair:
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "wan.png")
    plt.close(fig)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
