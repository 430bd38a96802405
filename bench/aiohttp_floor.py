"""The HTTP floor under the coordinator's per-request CPU: a bare aiohttp server (one POST route that reads a small
body and answers 204, as a /v1/work with no work does, without the coordinator's signature check, validation,
ledger or middlewares) on this machine, on asyncio's own event loop and on uvloop, side by side in one run.

A client process holds --conns keep-alive connections and sends --rate requests/s in all (a fixed rate, as the
load bench's nodes do, not as fast as possible) for --seconds; the server's CPU comes from /proc/PID/stat.
What it answers: how much of the coordinator's ~1 ms per request (bench/load.py) is aiohttp + asyncio
themselves, i.e. the part no trimming of the coordinator's own code removes.

    .venv/bin/python bench/aiohttp_floor.py [--rate 500] [--seconds 15] [--loops asyncio,uvloop]
uvloop is not a dependency of the project: with --uvloop-path DIR (a `pip install --target DIR uvloop`) it is
imported from there. Writes bench/results/aiohttp_floor.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = b'{"policy_step": 0}'


def serve(port: int, loop_kind: str) -> None:
    from aiohttp import web

    async def work(request):
        await request.read()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/v1/work", work)
    if loop_kind == "uvloop":
        import uvloop

        uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def client(port: int, conns: int, rate: float, seconds: float) -> tuple[int, list[float]]:
    """`conns` connections, each sending in turn at rate/conns per second; returns (answers, latencies)."""
    lat: list[float] = []
    end = time.monotonic() + seconds
    head = (f"POST /v1/work HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY

    async def one(i: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        period = conns / rate
        nxt = time.monotonic() + period * i / conns
        while nxt < end:
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            t0 = time.perf_counter()
            w.write(head)
            line = await r.readuntil(b"\r\n\r\n")
            assert line.startswith(b"HTTP/1.1 204"), line[:40]
            lat.append(time.perf_counter() - t0)
            nxt += period
        w.close()

    await asyncio.gather(*(one(i) for i in range(conns)))
    return len(lat), lat


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def run(loop_kind: str, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.uvloop_path, str(REPO)]))}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--loop-kind", loop_kind], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "server did not start in 30 s"
                time.sleep(0.1)
        asyncio.run(client(port, args.conns, args.rate, 2.0))  # warm-up
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        n, lat = asyncio.run(client(port, args.conns, args.rate, args.seconds))
        c1, t1 = cpu_s(proc.pid), time.monotonic()
    finally:
        proc.terminate()
        proc.wait(30)
    lat.sort()
    return {"loop": loop_kind, "requests": n, "requests_per_s": round(n / (t1 - t0), 1),
            "server_cpu_s": round(c1 - c0, 2), "server_cpu_ms_per_request": round(1000 * (c1 - c0) / max(1, n), 3),
            "p50_ms": round(1000 * lat[len(lat) // 2], 2), "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=500.0, help="requests/s in all")
    ap.add_argument("--conns", type=int, default=200, help="keep-alive connections")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--loops", default="asyncio,uvloop")
    ap.add_argument("--uvloop-path", default="", help="a directory holding uvloop (pip install --target)")
    ap.add_argument("--out", default=str(OUT / "aiohttp_floor.json"))
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--loop-kind", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.loop_kind)
        return
    load0 = os.getloadavg()
    loops = [k.strip() for k in args.loops.split(",") if k.strip()]
    if "uvloop" in loops:
        sys.path.insert(0, args.uvloop_path) if args.uvloop_path else None
        try:
            import uvloop  # noqa: F401
        except ImportError:  # `make bench` runs this without it: the asyncio row alone
            print("uvloop is not importable (--uvloop-path DIR): its row is left out")
            loops.remove("uvloop")
    rows = [run(k, args) for k in loops]
    print(f"{'loop':<8} {'req/s':>8} {'server CPU ms/request':>22} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['loop']:<8} {r['requests_per_s']:>8.1f} {r['server_cpu_ms_per_request']:>22.3f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    doc = {"benchmark": "aiohttp_floor", "rows": rows, "rate": args.rate, "conns": args.conns,
           "seconds": args.seconds, "machine": f"{os.cpu_count()} cores",
           "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
