"""What moving shard bytes between two nodes costs in CPU: libp2p (`/prime-node/shard/1.0.0`: TCP + Noise +
yamux, the swarm's data plane) against HTTP (aiohttp, the same `file_response` the coordinator and relays
serve shards with, keep-alive connections), side by side in one run.

One server process and one client process per case, on 127.0.0.1; the client fetches `--fetches` shards of
a given size (1 or 4 in flight) from the same compressed shard files. Reported: wall time, median fetch
latency, and the CPU of both processes (from getrusage, the transfer only), as CPU-seconds per GB moved
and CPU-milliseconds per fetch. bench/broadcast.py's N = 16 swarm round needs ~59 MB moved between nodes
within 1.5x one copy (11 s, i.e. 22 CPU-s on the 2 cores): this says what the bytes alone cost.

    .venv/bin/python bench/transport_cost.py [--sizes 16 128 1024] [--fetches 200]
    # writes bench/results/transport_cost.json ({"rows": [...]})
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULT = REPO / "bench" / "results" / "transport_cost.json"
RUN = "transport-bench"
SHARDS = 24


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_shards(root: Path, raw_size: int) -> tuple[str, list[int]]:
    """A step directory as the p2p shard store reads it (manifest + zstd shards), bf16-like bytes."""
    import numpy as np

    from node.p2p.shard_store import manifest_hash
    from protocol.signing import canonical_json

    rng = np.random.default_rng(0)
    (root / "3" / "shards").mkdir(parents=True)
    entries = []
    for i in range(SHARDS):
        raw = (rng.standard_normal(raw_size // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16
        z = zstandard.ZstdCompressor(level=1).compress(raw.astype(np.uint16).tobytes())
        (root / "3" / "shards" / f"{i:05d}.zst").write_bytes(z)
        entries.append({"index": i, "zsize": len(z), "sha256": hashlib.sha256(z).hexdigest()})
    manifest = {"format": "prime-node/checkpoint/v1", "run_id": RUN, "step": 3, "shards": entries}
    (root / "3" / "manifest.json").write_bytes(canonical_json(manifest))
    return manifest_hash(manifest), [e["zsize"] for e in entries]


# --- servers (one process each; print where to connect, then the CPU used when told to stop) -------
async def serve_libp2p(root: Path) -> None:
    from node.p2p.config import P2PConfig
    from node.p2p.host import P2PNode
    from protocol.identity import Identity

    node = P2PNode(Identity.generate(), P2PConfig(listen_host="127.0.0.1", max_concurrent_streams=8,
                                                  max_streams_per_peer=8), run_id=RUN, shard_root=root)
    await node.start()
    try:
        await report_until_stopped(json.dumps(node.listen_addrs))
    finally:
        await node.stop()


async def serve_http(root: Path) -> None:
    from aiohttp import web

    from node.http import file_response
    from node.rate_limit import AsyncRateLimiter

    throttle = AsyncRateLimiter(0)

    async def shard(request: web.Request) -> web.StreamResponse:
        index = int(request.match_info["index"])
        return await file_response(request, root / "3" / "shards" / f"{index:05d}.zst", throttle)

    app = web.Application()
    app.router.add_get("/shards/{index}", shard)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        await report_until_stopped(json.dumps(f"http://127.0.0.1:{port}"))
    finally:
        await runner.cleanup()


async def report_until_stopped(where: str) -> None:
    print(where, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go": the client is connected
    c0 = cpu_s()
    await loop.run_in_executor(None, sys.stdin.readline)  # "stop"
    print(json.dumps({"cpu_seconds": cpu_s() - c0}), flush=True)


# --- clients ---------------------------------------------------------------------------------------
async def fetch_all(get, n: int, in_flight: int) -> dict:
    sem = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            await get(i % SHARDS)
            latencies.append(time.perf_counter() - t)

    await get(0)  # connected and warmed (libp2p: dialled, Noise, yamux; HTTP: one keep-alive connection)
    print("connected", flush=True)
    sys.stdin.readline()  # the server has started counting
    c0, t0 = cpu_s(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    latencies.sort()
    return {"wall_seconds": time.perf_counter() - t0, "client_cpu_seconds": cpu_s() - c0,
            "median_fetch_ms": 1000 * latencies[len(latencies) // 2]}


async def client_libp2p(where: str, manifest_hash: str, n: int, in_flight: int) -> dict:
    from node.p2p.config import P2PConfig
    from node.p2p.host import P2PNode
    from protocol.identity import Identity

    async with P2PNode(Identity.generate(), P2PConfig(listen=False), run_id=RUN) as node:
        [peer] = await node.connect(json.loads(where))
        return await fetch_all(lambda i: node.fetch_shard(peer, 3, i, max_bytes=1 << 26, manifest_hash=manifest_hash),
                               n, in_flight)


async def client_http(where: str, manifest_hash: str, n: int, in_flight: int) -> dict:
    import aiohttp

    base = json.loads(where)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight)) as session:
        async def get(i: int) -> bytes:
            async with session.get(f"{base}/shards/{i}") as resp:
                assert resp.status == 200, resp.status
                return await resp.read()

        return await fetch_all(get, n, in_flight)


def child(role: str, transport: str, argv: list[str]) -> None:
    if role == "server":
        asyncio.run((serve_libp2p if transport == "libp2p" else serve_http)(Path(argv[0])))
    else:
        fn = client_libp2p if transport == "libp2p" else client_http
        print(json.dumps(asyncio.run(fn(argv[0], argv[1], int(argv[2]), int(argv[3])))), flush=True)


def one_case(transport: str, root: Path, manifest_hash: str, n: int, in_flight: int) -> dict:
    me = [sys.executable, __file__, "--child"]
    server = subprocess.Popen([*me, "server", transport, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        where = server.stdout.readline().strip()
        client = subprocess.Popen([*me, "client", transport, where, manifest_hash, str(n), str(in_flight)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "connected", client.stderr.read()[-2000:]
        server.stdin.write("go\n")
        server.stdin.flush()
        time.sleep(0.2)  # the server reads "go" before the first counted request
        out, err = client.communicate("go\n", timeout=600)
        if client.returncode != 0:
            raise SystemExit(f"{transport} client failed:\n{err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        server.stdin.write("stop\n")
        server.stdin.flush()
        result["server_cpu_seconds"] = json.loads(server.stdout.readline())["cpu_seconds"]
        return result
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 1024], help="raw shard sizes, KiB")
    ap.add_argument("--fetches", type=int, default=200)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2:])
        return
    rows = []
    print(f"{'transport':<9} {'shard KiB':>9} {'in flight':>9} {'MB/s':>7} {'median ms':>9} {'CPU-s/GB':>9} "
          f"{'CPU ms/fetch':>12}")
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        for kib in args.sizes:
            root = Path(tmp) / str(kib)
            h, zsizes = write_shards(root, kib * 1024)
            n = args.fetches if kib <= 256 else max(20, args.fetches // 4)
            moved = sum(zsizes[i % SHARDS] for i in range(n))
            for in_flight in (1, 4):
                for transport in ("libp2p", "http"):  # side by side, same files, same machine state
                    r = one_case(transport, root, h, n, in_flight)
                    cpu = r["client_cpu_seconds"] + r["server_cpu_seconds"]
                    row = {"transport": transport, "shard_kib_raw": kib, "shard_bytes": round(moved / n),
                           "fetches": n, "in_flight": in_flight, "bytes": moved, **r,
                           "mb_s": moved / 1e6 / r["wall_seconds"], "cpu_s_per_gb": cpu / (moved / 1e9),
                           "cpu_ms_per_fetch": 1000 * cpu / n}
                    rows.append(row)
                    print(f"{transport:<9} {moved / n / 1024:9.0f} {in_flight:9d} {row['mb_s']:7.1f} "
                          f"{r['median_fetch_ms']:9.1f} {row['cpu_s_per_gb']:9.0f} {row['cpu_ms_per_fetch']:12.2f}",
                          flush=True)
            shutil.rmtree(root, ignore_errors=True)
    for r in rows:  # libp2p's cost as a multiple of HTTP's, same case
        peer = next(x for x in rows if x["transport"] == "http" and x["shard_kib_raw"] == r["shard_kib_raw"]
                    and x["in_flight"] == r["in_flight"])
        r["cpu_vs_http"] = r["cpu_s_per_gb"] / peer["cpu_s_per_gb"]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"benchmark": "transport_cost", "machine": f"{os.cpu_count()} cores",
                                  "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
