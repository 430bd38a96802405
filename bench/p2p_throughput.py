"""Peer shard transfers, libp2p streams against the HTTP data plane (`p2p.http`), between two real P2PNodes.

A peer shard over libp2p took 0.64 s against 0.02 s over `p2p.http` in the loopback swarm (docs/BENCHMARKS.md,
"Where a delta's seconds go"), and NATed homes can serve only over libp2p. This measures the transfer alone: one
server process (a P2PNode serving a shard directory) and one client process (a P2PNode that fetches with
`fetch_shard`, the fetcher's call) on 127.0.0.1, one fetch at a time, for each shard size. Both planes are the
project's own classes end to end: plane "libp2p" is the default config; plane "http" turns `p2p.http` on at both
ends, and the client learns the server's HTTP address from its signed `have` (as gossip would hand it over).

Per (code, plane, size): seconds per shard (median and p90 of --reps fetches), MB/s (size / median), and the CPU
of both processes per fetch (getrusage / /proc, the timed fetches only). A 1 KiB shard gives the per-request
latency (what a fetch costs before its bytes). Besides, for libp2p, how many yamux DATA frames and how many
stream reads a shard took on the client (counted by wrapping py-libp2p's methods in the client process only).

--gil-busy adds a pure-Python busy thread to both processes, as a worker generating while it serves has: every
wake-up of the trio thread (libp2p) or of the asyncio loop (HTTP) then waits for the GIL.

--baseline REV runs the same cases against the code of REV (a detached git worktree in the temp dir, this venv,
this bench file) in the same sitting, alternating code by round, and prints the ratios.

    .venv/bin/python bench/p2p_throughput.py [--sizes 1,64,256,1024,4096,8192] [--reps 15] [--baseline REV]
        [--planes libp2p,http] [--gil-busy] [--key NAME]     # writes bench/results/p2p_throughput.json ({"runs": {key: ...}})
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("BENCH_CODE_TREE"):  # a child measuring another checkout's code (--baseline)
    sys.path.insert(0, os.environ["BENCH_CODE_TREE"])
else:
    sys.path.insert(0, str(REPO))
RESULT = REPO / "bench" / "results" / "p2p_throughput.json"
RUN = "p2p-throughput-bench"
STEP = 3
KIB = 1024


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_shards(root: Path, sizes_kib: list[int]) -> str:
    """Step STEP with shard i of sizes_kib[i] KiB (random bytes: compressed shards do not compress further)."""
    import hashlib

    from node.p2p.shard_store import manifest_hash
    from protocol.signing import canonical_json

    (root / str(STEP) / "shards").mkdir(parents=True)
    entries = []
    for i, kib in enumerate(sizes_kib):
        z = os.urandom(kib * KIB)
        (root / str(STEP) / "shards" / f"{i:05d}.zst").write_bytes(z)
        entries.append({"index": i, "zsize": len(z), "sha256": hashlib.sha256(z).hexdigest()})
    manifest = {"format": "prime-node/checkpoint/v1", "run_id": RUN, "step": STEP, "shards": entries}
    (root / str(STEP) / "manifest.json").write_bytes(canonical_json(manifest))
    return manifest_hash(manifest)


def config(http: bool, **kw):
    from node.p2p.config import P2PConfig

    return P2PConfig(listen_host="127.0.0.1", allow_private_addrs=True, http=http, **kw)


# --- server process: print where to fetch, count CPU between "go" and "stop" -------------------------
async def serve(root: Path, http: bool, mhash: str, n_shards: int) -> None:
    from node.p2p.announce import encode_have_announcement
    from node.p2p.host import P2PNode
    from protocol.identity import Identity

    node = P2PNode(Identity.generate(), config(http), run_id=RUN, shard_root=root)
    await node.start()
    try:
        have = encode_have_announcement(node.identity, run_id=RUN, step=STEP, manifest_hash=mhash,
                                        indices=list(range(n_shards)), addrs=node.announce_addrs)
        print(json.dumps({"addrs": node.listen_addrs, "peer": node.peer_id, "node_id": node.node_id,
                          "have": have.hex()}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # "go"
        c0 = cpu_s()
        await loop.run_in_executor(None, sys.stdin.readline)  # "stop"
        print(json.dumps({"cpu_seconds": cpu_s() - c0}), flush=True)
    finally:
        await node.stop()


# --- client process ------------------------------------------------------------------------------------
class FrameCount:
    """Yamux DATA frames received and stream reads made on the client, by wrapping py-libp2p's methods (this
    process only; the server is not touched)."""

    def __init__(self) -> None:
        self.frames = self.reads = 0
        try:
            from libp2p.stream_muxer.yamux import yamux
        except ImportError:
            return
        counter = self
        orig_read = yamux.YamuxStream.read

        async def read(self, n=-1):
            counter.reads += 1
            return await orig_read(self, n)

        yamux.YamuxStream.read = read
        orig_frame = getattr(yamux.Yamux, "_read_data_body", None)  # one call per DATA frame with a body
        self.frames_counted = orig_frame is not None
        if orig_frame is not None:
            name = orig_frame.__name__

            async def frame(self, *a, **k):
                counter.frames += 1
                return await orig_frame(self, *a, **k)

            setattr(yamux.Yamux, name, frame)


async def client(where: dict, http: bool, mhash: str, sizes_kib: list[int], reps: int) -> dict:
    from node.p2p.announce import decode_announcement
    from node.p2p.host import P2PNode
    from protocol.identity import Identity

    counts = FrameCount()
    out: dict = {}
    async with P2PNode(Identity.generate(), config(http, listen=False), run_id=RUN) as node:
        [peer] = await node.connect(where["addrs"])
        node.table.note_manifest(STEP, mhash)
        ann = decode_announcement(bytes.fromhex(where["have"]), run_id=RUN, coordinator_key=None,
                                  origin_node_id=where["node_id"], max_age_s=600)
        assert node.table.record_have(peer, ann)

        async def get(i: int) -> bytes:
            return await node.fetch_shard(peer, STEP, i, max_bytes=1 << 26, manifest_hash=mhash)

        for i in range(len(sizes_kib)):  # warm: connected, HTTP keep-alive open, files in the page cache
            assert len(await get(i)) == sizes_kib[i] * KIB
        print("ready", flush=True)
        sys.stdin.readline()  # the server counts from here
        for i, kib in enumerate(sizes_kib):
            times = []
            f0, r0 = counts.frames, counts.reads
            c0 = cpu_s()
            for _ in range(reps):
                t = time.perf_counter()
                data = await get(i)
                times.append(time.perf_counter() - t)
                assert len(data) == kib * KIB
            out[str(kib)] = {"times": times, "client_cpu_seconds": cpu_s() - c0,
                             "frames_per_shard": (counts.frames - f0) / reps if counts.frames_counted else None,
                             "reads_per_shard": (counts.reads - r0) / reps}
        print(json.dumps(out), flush=True)
    return out


def busy_python_thread() -> None:
    """A thread that keeps the GIL busy, as a worker's generation thread does (node/worker/node.py runs
    backend.generate in asyncio.to_thread; a transformers decode loop is Python between torch ops). The libp2p
    trio thread and the asyncio loop then wait for the GIL at every wake-up (up to sys.getswitchinterval())."""
    import threading

    def spin() -> None:
        x = 0
        while True:
            for i in range(1000):
                x += i

    threading.Thread(target=spin, name="busy-generation-stand-in", daemon=True).start()


def child(argv: list[str]) -> None:
    role, plane = argv[0], argv[1]
    if os.environ.get("P2P_BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["P2P_BENCH_SWITCH_INTERVAL"]))
    if os.environ.get("P2P_BENCH_GIL_BUSY") == "1":
        busy_python_thread()
    if role == "server":
        asyncio.run(serve(Path(argv[2]), plane == "http", argv[3], int(argv[4])))
    else:
        asyncio.run(client(json.loads(argv[2]), plane == "http", argv[3], json.loads(argv[4]), int(argv[5])))


def one_case(tree: Path | None, plane: str, root: Path, mhash: str, sizes: list[int], reps: int) -> dict:
    """One server and one client process running `tree`'s node package (None: this checkout)."""
    env = dict(os.environ, BENCH_CODE_TREE=str(tree)) if tree else dict(os.environ)
    env.pop("PYTHONPATH", None)
    me = [sys.executable, __file__, "--child"]
    server = subprocess.Popen([*me, "server", plane, str(root), mhash, str(len(sizes))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"{plane} server failed:\n{server.stderr.read()[-3000:]}")
        client_p = subprocess.Popen([*me, "client", plane, line.strip(), mhash, json.dumps(sizes), str(reps)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env)
        ready = client_p.stdout.readline().strip()
        if ready != "ready":
            raise SystemExit(f"{plane} client failed:\n{client_p.stderr.read()[-3000:]}")
        server.stdin.write("go\n")
        server.stdin.flush()
        time.sleep(0.2)  # the server reads "go" before the first timed request
        out, err = client_p.communicate("go\n", timeout=900)
        if client_p.returncode != 0:
            raise SystemExit(f"{plane} client failed:\n{err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        server.stdin.write("stop\n")
        server.stdin.flush()
        result["server_cpu_seconds"] = json.loads(server.stdout.readline())["cpu_seconds"]
        return result
    finally:
        try:
            server.stdin.close()
        except OSError:
            pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def baseline_tree(ref: str) -> Path:
    """A detached git worktree of `ref` in the temp dir (as bench/load.py makes one)."""
    path = Path(tempfile.mkdtemp(prefix="prime-p2p-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, check=True,
                   capture_output=True, text=True)
    return path


def remove_tree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)


def git_state(cwd: Path = REPO) -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "node"], cwd=cwd, capture_output=True,
                           text=True).stdout.strip()
    return rev + ("+dirty" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,64,256,1024,4096,8192", help="shard sizes, KiB (comma-separated)")
    ap.add_argument("--reps", type=int, default=15, help="fetches per size (one at a time)")
    ap.add_argument("--planes", default="libp2p,http")
    ap.add_argument("--rounds", type=int, default=2, help="each (code, plane) is run this many times, alternating")
    ap.add_argument("--baseline", metavar="REV", help="also measure this commit's code, side by side")
    ap.add_argument("--key", default="latest", help="name of this run in the JSON file")
    ap.add_argument("--gil-busy", action="store_true",
                    help="a pure-Python busy thread in both processes (a worker generating while it serves/fetches)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.gil_busy:
        os.environ["P2P_BENCH_GIL_BUSY"] = "1"  # the children inherit it
    planes = args.planes.split(",")
    codes: list[tuple[str, Path | None]] = []
    base_tree = None
    if args.baseline:
        base_tree = baseline_tree(args.baseline)
        codes.append((f"baseline {git_state(base_tree)}", base_tree))
    codes.append((f"this {git_state()}", None))
    merged: dict[tuple[str, str], dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-p2p-throughput-") as tmp:
            root = Path(tmp) / "shards"
            mhash = write_shards(root, sizes)
            for rnd in range(args.rounds):
                order = codes if rnd % 2 == 0 else codes[::-1]
                for code, tree in order:
                    for plane in planes:
                        r = one_case(tree, plane, root, mhash, sizes, args.reps)
                        m = merged.setdefault((code, plane), {str(k): {"times": [], "cpu": 0.0, "frames": [],
                                                                       "reads": []} for k in sizes})
                        total_fetches = args.reps * len(sizes)
                        for k in sizes:
                            x = r[str(k)]
                            m[str(k)]["times"] += x["times"]
                            # the server's CPU is per case; split it over sizes by their share of client CPU
                            m[str(k)]["cpu"] += x["client_cpu_seconds"]
                            m[str(k)]["frames"].append(x["frames_per_shard"])
                            m[str(k)]["reads"].append(x["reads_per_shard"])
                        m.setdefault("_server_cpu", 0.0)
                        m["_server_cpu"] += r["server_cpu_seconds"]
                        m.setdefault("_client_cpu", 0.0)
                        m["_client_cpu"] += sum(r[str(k)]["client_cpu_seconds"] for k in sizes)
                        print(f"  round {rnd + 1}: {code} {plane} done ({total_fetches} fetches)", flush=True)
    finally:
        if base_tree is not None:
            remove_tree(base_tree)
    rows = []
    for (code, plane), m in merged.items():
        for k in sizes:
            x = m[str(k)]
            t = sorted(x["times"])
            med = statistics.median(t)
            p90 = t[min(len(t) - 1, int(0.9 * len(t)))]
            client_cpu = x["cpu"]
            server_cpu = m["_server_cpu"] * (client_cpu / m["_client_cpu"]) if m["_client_cpu"] else 0.0
            frames = [f for f in x["frames"] if f is not None]
            rows.append({"code": code, "plane": plane, "kib": k, "fetches": len(t), "median_s": med, "p90_s": p90,
                         "mb_s": k * KIB / 1e6 / med, "client_cpu_ms_per_fetch": 1000 * client_cpu / len(t),
                         "server_cpu_ms_per_fetch_est": 1000 * server_cpu / len(t),
                         "frames_per_shard": statistics.mean(frames) if frames and plane == "libp2p" else None,
                         "reads_per_shard": statistics.mean(x["reads"]) if plane == "libp2p" else None})
    print(f"\n{'code':<22} {'plane':<7} {'KiB':>5} {'median s':>9} {'p90 s':>8} {'MB/s':>7} {'cli CPU ms':>10} "
          f"{'srv CPU ms':>10} {'frames':>7} {'reads':>6}")
    for r in rows:
        fr = f"{r['frames_per_shard']:.1f}" if r["frames_per_shard"] is not None else "-"
        rd = f"{r['reads_per_shard']:.1f}" if r["reads_per_shard"] is not None else "-"
        print(f"{r['code'][:22]:<22} {r['plane']:<7} {r['kib']:5d} {r['median_s']:9.4f} {r['p90_s']:8.4f} "
              f"{r['mb_s']:7.1f} {r['client_cpu_ms_per_fetch']:10.2f} {r['server_cpu_ms_per_fetch_est']:10.2f} "
              f"{fr:>7} {rd:>6}")
    ratios = []
    for r in rows:  # libp2p / http on the same code; this / baseline on the same plane
        if r["plane"] == "libp2p":
            h = next((x for x in rows if x["code"] == r["code"] and x["plane"] == "http" and x["kib"] == r["kib"]), None)
            if h:
                r["libp2p_vs_http"] = r["median_s"] / h["median_s"]
        if args.baseline and r["code"].startswith("this"):
            b = next((x for x in rows if x["code"].startswith("baseline") and x["plane"] == r["plane"]
                      and x["kib"] == r["kib"]), None)
            if b:
                r["vs_baseline"] = r["median_s"] / b["median_s"]
                ratios.append((r["plane"], r["kib"], b["median_s"], r["median_s"]))
    if ratios:
        print(f"\n{'plane':<7} {'KiB':>5} {'baseline s':>10} {'this s':>8} {'this/baseline':>13}")
        for plane, k, b, t in ratios:
            print(f"{plane:<7} {k:5d} {b:10.4f} {t:8.4f} {t / b:13.2f}")
    for r in rows:
        if "libp2p_vs_http" in r:
            print(f"{r['code'][:22]:<22} {r['kib']:5d} KiB: libp2p {r['libp2p_vs_http']:.1f}x HTTP's time")
    runs = json.loads(RESULT.read_text())["runs"] if RESULT.exists() else {}
    runs[args.key] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": f"{os.cpu_count()} cores",
                      "load": os.getloadavg(), "reps": args.reps, "rounds": args.rounds, "gil_busy": args.gil_busy,
                      "baseline": args.baseline, "rows": rows}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"benchmark": "p2p_throughput", "runs": runs}, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)} [{args.key}]")


if __name__ == "__main__":
    main()
