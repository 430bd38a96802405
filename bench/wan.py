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
  the node opened to the coordinator's HTTP port (any request, heartbeats included) per step fetched.
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
    connects = requests = listings = 0
    steps: set[int] = set()
    last = None  # the last manifest or shard request: (time, local port, step, what)
    for t, way, lport, rport, syn, size, line in packets:
        if rport != PORT:
            continue
        if way == "out":
            if syn:
                connects += 1
            m = _GET.match(line.encode("latin-1")) if line else None
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
             extra: tuple[str, ...] = ()) -> dict:
    """The real loop from the checkout at `root`: coordinator in the datacenter, a home node per one-way delay,
    `steps` trainer steps. Returns per-node numbers keyed by delay."""
    sys.path.insert(0, str(REPO))
    from tests.wan.lab import DATACENTER, Lab, home

    common = ["--config", str(root / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", *extra]
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: no steps held from an earlier one
    workdir.mkdir(parents=True)
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        nodes = [lab.add(f"home{int(d)}", home(d)) for d in delays_ms]
        sniffs = {}
        for n in nodes:
            sniffs[n.name] = workdir / f"{n.name}.sniff"
            lab.spawn(n, f"sniff-{n.name}", [sys.executable, str(Path(__file__).resolve()), "sniff", "--iface", "e0",
                                             "--peer", dc.addr, "--out", str(sniffs[n.name])])
        ready = workdir / "coordinator.ready"
        ready.unlink(missing_ok=True)
        coord = lab.spawn(dc, "coordinator", cli(
            root, "coordinator", *common, f"--set=server.host={dc.addr}", f"--set=server.port={PORT}",
            f"--set=storage.dir={workdir / 'coord'}", f"--set=run.max_steps={steps}",
            f"--set=p2p.listen_host={dc.addr}", "--ready-file", str(ready)), cwd=root)
        t0 = time.monotonic()
        while not ready.is_file():
            if coord.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError("the coordinator did not start:\n" + lab.log("coordinator")[-3000:])
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        url = info["url"]
        for n in nodes:
            lab.spawn(n, f"worker-{n.name}", cli(
                root, "join", "--coordinator", url, "--coordinator-key", info["key"], *common,
                f"--set=worker.storage_dir={workdir / n.name}", "--set=worker.heartbeat_seconds=1",
                "--set=p2p.listen_host=0.0.0.0"), cwd=root)

        def status() -> dict:
            out = lab.run(dc, [sys.executable, "-c", STATUS, url])
            return json.loads(out.stdout) if out.returncode == 0 else {}

        deadline, s, t_start = time.monotonic() + timeout_s, {}, time.monotonic()
        while time.monotonic() < deadline:
            s = status()
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
        deltas = {c["step"] for c in s.get("checkpoints", []) if c.get("encoding") != "full"}
        rows = {r["node_id"][:8]: r for r in s.get("nodes", [])}
        fetcher_lines = {n.name: re.findall(r"fetched steps (\S+) in ([\d.]+) s: (\d+) requests, (\d+) new conn",
                                            lab.log(f"worker-{n.name}")) for n in nodes}
        lab.close()  # the sniffers flush and stop
        out = {"trainer_steps": s.get("step"), "wall_s": round(wall, 1),
               "bytes_by_source": s.get("checkpoint_bytes_by_source"), "nodes": {}}
        for n, d in zip(nodes, delays_ms):
            r = analyse(read_sniff(sniffs[n.name]), 2 * d / 1e3, deltas or None)
            row = rows.get(ids[n.name] or "", {})
            r.update(one_way_ms=d, accepted=row.get("accepted"), policy_step=row.get("policy_step"),
                     fetcher_log_syncs=len(fetcher_lines[n.name]))
            out["nodes"][str(int(d))] = r
        return out


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
    args = ap.parse_args()
    if args.cmd == "sniff":
        sniff(args.iface, args.peer, args.out)
        return
    sys.path.insert(0, str(REPO))
    from tests.wan.lab import unavailable

    if why := unavailable():
        sys.exit(f"bench/wan.py: {why}")
    delays = [float(x) for x in args.delays.split(",")]
    runs = {}
    extra = ("--set=p2p.enabled=false",) if args.no_p2p else ()
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
    res = REPO / "bench" / "results" / "wan.json"
    old = json.loads(res.read_text()) if res.is_file() else {}
    old["no_p2p" if args.no_p2p else "p2p"] = {"delays_ms": delays, "steps": args.steps, "runs": runs}
    res.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {res.relative_to(REPO)}")


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
