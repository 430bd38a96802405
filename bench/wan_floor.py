"""The WAN lab's own floor for a delta shard's request: a bare aiohttp server and client, no prime-node code.

    .venv/bin/python bench/wan_floor.py [--rounds 8] [--gap 2.5] [--busy 0,3]   (as root: the lab)
Prints a table and writes bench/results/wan_floor.json.

bench/wan.py --scale cuts a delta shard's seconds in the lab into waits, deferrals and "ok" (the request that
brought it), and "ok" from a public node measured 0.6-0.75 s for ~140 KB at a 50-240 ms round trip: 6-7 of the
fetching node's round trips. This asks what the lab itself charges for that request. A public site (5 ms one
way, 200/200 Mbit/s) runs a bare aiohttp server answering GET /shard with `--size` bytes; a home site behind
NAT (20 or 100 ms one way, 20 up / 100 down) fetches it the way the worker's fetcher does: kept-alive
connections, `--parallel` requests at once (a delta's shards), one round every `--gap` s (a trainer step), so
that each connection idles between steps as the real ones do. Measured per request: seconds, and seconds over
the pair's round trip (2 x (delay home + delay public)). `--busy N` runs N busy-looping processes beside it
(the lab's nodes and trainer load the box's 2 cores), and with `--cubic` the sockets use cubic instead of the
kernel's default congestion control.

Rows: the first round (new connections: TCP's handshake and slow start from the initial window) and the later
rounds (kept alive, after `--gap` s idle).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PORT = 18080


def serve(host: str, size: int) -> None:
    from aiohttp import web

    body = bytes(size)

    async def shard(request):
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/shard", shard)
    web.run_app(app, host=host, port=PORT, print=None)


def connector(cubic: bool, **kwargs):
    """An aiohttp TCPConnector whose sockets use cubic (`cubic`) or the kernel's default congestion control."""
    import socket

    import aiohttp

    class Connector(aiohttp.TCPConnector):
        async def _wrap_create_connection(self, *a, **kw):  # pick the congestion control per socket
            tr, proto = await super()._wrap_create_connection(*a, **kw)
            if cubic:
                tr.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
            return tr, proto

    return Connector(**kwargs)


async def client(url: str, rounds: int, parallel: int, gap: float, cubic: bool) -> list[dict]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(connector=connector(cubic, limit_per_host=parallel, keepalive_timeout=60)) as s:
        async def one(r: int) -> None:
            t = time.perf_counter()
            async with s.get(url) as resp:
                n = len(await resp.read())
            out.append({"round": r, "s": time.perf_counter() - t, "bytes": n})

        for r in range(rounds):
            t0 = time.perf_counter()
            await asyncio.gather(*(one(r) for _ in range(parallel)))
            await asyncio.sleep(max(0.0, gap - (time.perf_counter() - t0)))
    return out


def busy() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gap", type=float, default=2.5)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--size", type=int, default=140_000)
    ap.add_argument("--homes", default="20,100", help="one-way delays of the homes, ms")
    ap.add_argument("--busy", default="0,3", help="busy processes beside it, one value per sitting")
    ap.add_argument("--cubic", action="store_true")
    ap.add_argument("--client", nargs=5, help=argparse.SUPPRESS)  # url rounds parallel gap cubic (in the lab)
    args = ap.parse_args()
    if args.client:
        url, rounds, parallel, gap, cubic = args.client
        print(json.dumps(asyncio.run(client(url, int(rounds), int(parallel), float(gap), cubic == "1"))))
        return

    from tests.wan.lab import Lab, home, public

    pub_ms = 5.0
    rows = []
    for n_busy in [int(x) for x in args.busy.split(",")]:
        burners = [multiprocessing.Process(target=busy, daemon=True) for _ in range(n_busy)]
        for b in burners:
            b.start()
        try:
            with Lab() as lab:
                pub = lab.add("pub", public(pub_ms))
                homes = [lab.add(f"home{d}", home(float(d))) for d in args.homes.split(",")]
                lab.spawn(pub, "server", [sys.executable, "-c",
                                          f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); "
                                          f"import wan_floor; wan_floor.serve({pub.addr!r}, {args.size})"])
                time.sleep(2.0)
                for h in homes:
                    rtt = 2 * (h.profile.one_way_ms + pub_ms) / 1000
                    p = lab.run(h, [sys.executable, str(Path(__file__).resolve()), "--client",
                                    f"http://{pub.addr}:{PORT}/shard", str(args.rounds), str(args.parallel),
                                    str(args.gap), "1" if args.cubic else "0"], timeout=300)
                    if p.returncode != 0:
                        raise SystemExit(f"client failed: {p.stderr[-2000:]}")
                    reqs = json.loads(p.stdout)
                    assert all(r["bytes"] == args.size for r in reqs)
                    for label, sel in (("first round (new connections)", [r for r in reqs if r["round"] == 0]),
                                       ("later rounds (kept alive)", [r for r in reqs if r["round"] > 0])):
                        secs = sorted(r["s"] for r in sel)
                        rows.append({"busy": n_busy, "home_ms": h.profile.one_way_ms, "rtt_s": rtt, "rows": label,
                                     "n": len(secs), "median_s": statistics.median(secs), "max_s": secs[-1],
                                     "median_rtts": statistics.median(secs) / rtt})
        finally:
            for b in burners:
                b.terminate()

    print(f"{args.size} B per request, {args.parallel} at once, a round every {args.gap} s, "
          f"public 5 ms one way, {'cubic' if args.cubic else 'default congestion control'}")
    print(f"{'busy':>4} {'home ms':>7} {'RTT s':>6}  {'requests':<30} {'n':>3} {'median s':>8} {'max s':>6} {'RTTs':>5}")
    for r in rows:
        print(f"{r['busy']:>4} {r['home_ms']:>7.0f} {r['rtt_s']:>6.3f}  {r['rows']:<30} {r['n']:>3} "
              f"{r['median_s']:>8.3f} {r['max_s']:>6.3f} {r['median_rtts']:>5.1f}")
    out = REPO / "bench/results/wan_floor.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "size": args.size, "parallel": args.parallel, "gap_s": args.gap, "cubic": args.cubic,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
