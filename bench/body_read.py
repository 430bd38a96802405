"""How long a busy aiohttp server takes to read a submission-sized request body, by aiohttp's `read_bufsize`.

    .venv/bin/python bench/body_read.py [--reps 21] [--busy 0,5,20] [--sizes 65536,524288]
Prints a table and writes bench/results/body_read.json.

The coordinator's `/v1/submit` answers waited up to 460 ms just reading a 1.4 MB body while the event loop served
1,000 nodes (docs/BENCHMARKS.md, "The intake's CPU cut"). aiohttp stops reading a socket once twice `read_bufsize`
(64 KiB by default) is buffered and resumes only after the handler has taken it, so each ~128 KiB of body waits for
a turn of the loop. Here a bare aiohttp server reads 1.4 MB bodies with the project's bounded read
(node/aio.py `read_bounded`) while `--busy` tasks keep its loop busy (each runs 1 ms of Python and yields, as
other requests' handlers do); the client is another process. Each buffer size is run twice, alternated.
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

BODY_BYTES = 1_400_000  # a gpu-example submission (8 prompts x 16 samples x <= 512 tokens)


def client(port: int, reps: int, q) -> None:
    import aiohttp

    async def go() -> list[tuple[float, float]]:
        body, out = b"x" * BODY_BYTES, []
        async with aiohttp.ClientSession() as c:
            for _ in range(reps):
                t = time.perf_counter()
                async with c.post(f"http://127.0.0.1:{port}/", data=body) as resp:
                    read_s = float(await resp.text())
                out.append((time.perf_counter() - t, read_s))
                await asyncio.sleep(0.05)
        return out

    q.put(asyncio.run(go()))


async def one(bufsize: int, busy: int, reps: int) -> dict:
    from aiohttp import web

    from node.aio import read_bounded

    async def handler(request):
        t = time.perf_counter()
        body = await read_bounded(request.content, 8 << 20)
        assert body is not None and len(body) == BODY_BYTES
        return web.Response(text=f"{time.perf_counter() - t:.6f}")

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, read_bufsize=bufsize)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    stop = False

    async def hog() -> None:
        while not stop:
            t = time.perf_counter()
            while time.perf_counter() - t < 0.001:
                pass
            await asyncio.sleep(0)

    hogs = [asyncio.create_task(hog()) for _ in range(busy)]
    q: multiprocessing.Queue = multiprocessing.Queue()
    p = multiprocessing.Process(target=client, args=(runner.addresses[0][1], reps, q))
    p.start()
    while q.empty():
        await asyncio.sleep(0.01)
    out = q.get()
    p.join()
    stop = True
    await asyncio.gather(*hogs)
    await runner.cleanup()
    total, read = sorted(x[0] for x in out), sorted(x[1] for x in out)
    p90 = int(0.9 * (len(out) - 1))
    return {"read_bufsize": bufsize, "busy": busy, "n": len(out), "total_median_ms": statistics.median(total) * 1e3,
            "total_p90_ms": total[p90] * 1e3, "read_median_ms": statistics.median(read) * 1e3,
            "read_p90_ms": read[p90] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--busy", default="0,5,20")
    ap.add_argument("--sizes", default="65536,524288", help="read_bufsize values (aiohttp's default first)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    for busy in [int(x) for x in args.busy.split(",")]:
        for _ in range(2):
            for size in sizes:
                rows.append(asyncio.run(one(size, busy, args.reps)))
    print(f"{BODY_BYTES:,} B bodies, {args.reps} each; busy = tasks running 1 ms of Python each turn of the loop")
    print(f"{'busy':>4} {'read_bufsize':>12} {'read median':>11} {'read p90':>9} {'total median':>12} {'total p90':>9}  ratio")
    base: dict[int, list[float]] = {}
    for r in rows:
        if r["read_bufsize"] == sizes[0]:
            base.setdefault(r["busy"], []).append(r["read_median_ms"])
    for r in rows:
        ref = statistics.mean(base[r["busy"]])
        print(f"{r['busy']:>4} {r['read_bufsize']:>12} {r['read_median_ms']:>9.1f}ms {r['read_p90_ms']:>7.1f}ms "
              f"{r['total_median_ms']:>10.1f}ms {r['total_p90_ms']:>7.1f}ms  {r['read_median_ms'] / ref:.2f}x")
    out = REPO / "bench/results/body_read.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "body_bytes": BODY_BYTES, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
