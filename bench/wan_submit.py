"""A submission's upload from a home in the WAN lab: the JSON body as it was against the zstd body the node now sends.

    .venv/bin/python bench/wan_submit.py [--rounds 4] [--homes 10,50,100] [--warm-gap 8] [--cubic]   (as root)
Prints a table and writes bench/results/wan_submit.json (`--out` elsewhere).

A worker uploads each assignment's rollouts in one signed POST /v1/submit. Real SmolLM2 rollouts weighed 37.5 bytes
a completion token as JSON and weigh 17.5 as the worker sends them now (logprobs in 9 digits, zstd;
bench/submit_bytes.py), so the sizes here are those two for a
submission of 8 prompts x 16 samples: at a mean completion of 300 tokens (1.44 / 0.78 MB), and at the 512-token
cap (2.46 / 1.32 MB). What an upload costs is a matter of bytes and round trips only, so the bodies are random
bytes and the server is a bare aiohttp sink: the datacenter site (0 ms one way) reads the body and answers 200; a
home behind its own NAT router (20 Mbit/s up, 100 down) posts it over a fresh connection, as the node's client
does after more than 4 s idle (node/aio.py), raw and zstd-sized alternately, `--rounds` times each. Measured per
upload: seconds from the request to the answer; zstd's own CPU (~12 ms to compress 1.3 MB on the node, ~3 ms to
decompress on the coordinator, bench/submit_bytes.py) is not in it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PORT = 18081
RAW_B_PER_TOKEN, ZSTD_B_PER_TOKEN = 37.5, 17.5  # bench/results/submit_bytes.json: JSON as it was, as sent now
ROLLOUTS = 8 * 16
UPLINK_BYTES_S = 20e6 / 8


def serve(host: str) -> None:
    from aiohttp import web

    async def submit(request):
        n = len(await request.read())
        return web.json_response({"bytes": n})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/submit", submit)
    web.run_app(app, host=host, port=PORT, print=None)


async def client(url: str, sizes: list[int], rounds: int, warm_gap: float, cubic: bool) -> list[dict]:
    """Each size `rounds` times over a fresh connection (as after the client's 4 s keep-alive) and, with `warm_gap`,
    as often over one connection kept alive that long since its last upload (what a longer keep-alive would give);
    `cubic`: the sockets use cubic (most desktop kernels' default) instead of this kernel's default."""
    import aiohttp

    from wan_floor import connector  # bench/wan_floor.py: the congestion control per socket

    out = []
    async with aiohttp.ClientSession(connector=connector(cubic, keepalive_timeout=600, limit=1)) as warm:
        for r in range(rounds):
            for size in sizes:
                body = os.urandom(size)
                for mode in ["fresh"] + (["warm"] if warm_gap > 0 else []):
                    fresh = mode == "fresh"  # a new connection, or the kept one (`warm` outlives this block)
                    async with aiohttp.ClientSession(connector=connector(cubic)) if fresh else nullcontext(warm) as s:
                        t = time.perf_counter()
                        async with s.post(url, data=body) as resp:
                            got = (await resp.json())["bytes"]
                        out.append({"round": r, "size": size, "mode": mode, "s": time.perf_counter() - t,
                                    "ok": got == size})
                    await asyncio.sleep(warm_gap if mode == "warm" else 0.5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--homes", default="10,50,100", help="one-way delays of the homes, ms")
    ap.add_argument("--warm-gap", type=float, default=0.0,
                    help="also upload over one kept-alive connection idle this many seconds (0: fresh only)")
    ap.add_argument("--out", default=str(REPO / "bench/results/wan_submit.json"))
    ap.add_argument("--cubic", action="store_true", help="the uploads use cubic, not the kernel's default (BBR here)")
    ap.add_argument("--client", nargs=5, help=argparse.SUPPRESS)  # url sizes(json) rounds warm_gap cubic (in the lab)
    args = ap.parse_args()
    if args.client:
        url, sizes, rounds, warm_gap, cubic = args.client
        print(json.dumps(asyncio.run(client(url, json.loads(sizes), int(rounds), float(warm_gap), cubic == "1"))))
        return

    from tests.wan.lab import DATACENTER, Lab, home

    cases = {f"{tokens} tokens": (int(ROLLOUTS * tokens * RAW_B_PER_TOKEN), int(ROLLOUTS * tokens * ZSTD_B_PER_TOKEN))
             for tokens in (300, 512)}
    sizes = [n for pair in cases.values() for n in pair]
    rows = []
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        homes = [lab.add(f"home{d}", home(float(d))) for d in args.homes.split(",")]
        lab.spawn(dc, "sink", [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); "
                                                     f"import wan_submit; wan_submit.serve({dc.addr!r})"])
        time.sleep(2.0)
        for h in homes:
            p = lab.run(h, [sys.executable, str(Path(__file__).resolve()), "--client",
                            f"http://{dc.addr}:{PORT}/v1/submit", json.dumps(sizes), str(args.rounds),
                            str(args.warm_gap), "1" if args.cubic else "0"], timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"client failed: {p.stderr[-2000:]}")
            ups = json.loads(p.stdout)
            assert all(u["ok"] for u in ups)
            rtt = 2 * (h.profile.one_way_ms + dc.profile.one_way_ms) / 1000
            for mode in sorted({u["mode"] for u in ups}):
                for case, (raw, z) in cases.items():
                    med = {n: statistics.median(u["s"] for u in ups if u["size"] == n and u["mode"] == mode)
                           for n in (raw, z)}
                    rows.append({"home_ms": h.profile.one_way_ms, "rtt_s": rtt, "mode": mode, "case": case,
                                 "raw_bytes": raw, "zstd_bytes": z, "raw_s": med[raw], "zstd_s": med[z],
                                 "ratio": med[z] / med[raw], "raw_floor_s": raw / UPLINK_BYTES_S,
                                 "zstd_floor_s": z / UPLINK_BYTES_S, "n": args.rounds})

    print(f"8 x 16 rollouts, {RAW_B_PER_TOKEN} / {ZSTD_B_PER_TOKEN} bytes a token (JSON / zstd), 20 Mbit/s up, "
          f"median of {args.rounds}, {'cubic' if args.cubic else 'the default congestion control'}")
    print(f"{'home ms':>7} {'RTT s':>6} {'connection':<10} {'completions':<12} {'JSON MB':>7} {'s':>6} {'zstd MB':>7} "
          f"{'s':>6} {'zstd/JSON':>9} {'floor s (bytes / uplink)':>25}")
    for r in rows:
        print(f"{r['home_ms']:>7.0f} {r['rtt_s']:>6.3f} {r['mode']:<10} {r['case']:<12} {r['raw_bytes'] / 1e6:>7.2f} "
              f"{r['raw_s']:>6.2f} {r['zstd_bytes'] / 1e6:>7.2f} {r['zstd_s']:>6.2f} {r['ratio']:>9.2f} "
              f"{r['raw_floor_s']:>12.2f} / {r['zstd_floor_s']:.2f}")
    out = Path(args.out)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.write_text(json.dumps({"command": " ".join(sys.argv), "date": date, "cubic": args.cubic, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
