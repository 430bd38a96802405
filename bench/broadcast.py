"""Broadcast benchmark: time until all N nodes hold a new checkpoint under an origin upload cap,
for origin-only HTTP, one HTTP relay, the libp2p swarm ("swarm": shards over libp2p streams, the default;
"swarm-http": `p2p.http = true`, shards between nodes over HTTP and the origin naming first holders), and
INTELLECT-2's shardcast (N = 2, 4, 8, 16).

Real parts throughout: the coordinator publishes a signed full checkpoint and serves it with its
upload cap; each node is the worker's real Fetcher (parallel, verified, rarest-first) with, for the
swarm, its own libp2p host (TCP + Noise + yamux, gossipsub announcements) serving what it holds.
Each node is its own process (as deployed: one node per machine; generation is not part of a
broadcast), all on 127.0.0.1.

shardcast (bench/shardcast_mode.py) runs its own origin (in this process, same cap), one middle node
and N clients on the same checkpoint bytes.

    python bench/broadcast.py [--nodes 2 4 8 16] [--modes origin,relay,swarm,swarm-http,shardcast] [--cap 500000]
                              [--events DIR]
Each row also says when the origin finished its last shard and when the last node had its last one
(`origin_done_s`, `shards_done_s`: the gap is the swarm's tail).
Writes bench/results/broadcast.json ({"rows": [...]}, keeping other (mode, nodes) rows) and docs/broadcast.png.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from node.config import load_config  # noqa: E402
from node.coordinator.app import start_server  # noqa: E402
from node.coordinator.service import Coordinator  # noqa: E402
from node.relay import Relay  # noqa: E402
from node.checkpoint_dir import CheckpointDir  # noqa: E402
from node.worker.client import CoordinatorClient  # noqa: E402
from node.worker.fetcher import Fetcher, FetchError  # noqa: E402
from node.worker.peers import HaveAnnouncer, PeerSource  # noqa: E402
from node.worker.sources import HttpSource, ShardDeferred  # noqa: E402
from protocol.identity import Identity  # noqa: E402

MODEL = ["model.tiny_hidden_size=192", "model.tiny_layers=4", "distribution.shard_size=131072"]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _failure_kind(message: str) -> str:
    """A short reason from a source error's text (a swarm error joins each tried peer's)."""
    for kind in ("no peer holds", "no address we may dial", "could not be dialled", "no stream within", "timed out",
                 "connection lost", "stream failed", "busy", "cannot open", "not found", "answered"):
        if kind in message:
            return kind
    return "other"


def _count_outcomes(sources: list, events: list, samples: list | None = None) -> dict[str, float]:
    """Each source's shard requests by outcome ("peer ok", "coordinator deferred", "peer failed", ...), to
    see why a node went to the origin: wraps the sources' `shard` in place. `events` gets one
    (start, end, source kind, outcome, shard index) per request, times from time.monotonic()."""
    counts: dict[str, float] = {}  # "peer ok": requests, "peer ok s": their seconds summed

    def wrap(src) -> None:
        inner = src.shard

        async def shard(*a, **kw):
            t0 = time.monotonic()
            try:
                data = await inner(*a, **kw)
            except ShardDeferred:
                outcome = "deferred"
                raise
            except Exception as e:
                outcome = "failed"
                why = f"{src.kind} failed: {_failure_kind(str(e))}"
                if samples is not None and len(samples) < 5:  # the errors' own words, for the round's JSON
                    samples.append(f"{why}: {type(e).__name__}: {str(e)[:300]}")
                counts[why] = counts.get(why, 0) + 1
                raise
            else:
                outcome = "ok"
                return data
            finally:
                key = f"{src.kind} {outcome}"
                counts[key] = counts.get(key, 0) + 1
                counts[key + " s"] = round(counts.get(key + " s", 0) + time.monotonic() - t0, 2)
                events.append((t0, time.monotonic(), src.kind, outcome, a[1]))

        src.shard = shard

    for src in sources:
        wrap(src)
    return counts


async def run_node(args) -> None:
    """One fetch-only node in its own process (one node per machine, as deployed): set up, print
    "ready", wait for "go" on stdin, fetch the newest checkpoint, print the result as JSON."""
    logging.basicConfig(level=os.environ.get("BENCH_NODE_LOG", "ERROR"))  # e.g. WARNING: the p2p layer's drops
    store = CheckpointDir(Path(args.dir), unmerged_adapters=args.unmerged)  # --unmerged: lora_serving = "adapter"
    done: dict[str, float] = {}
    stop = asyncio.Event()
    identity = Identity.generate()
    async with aiohttp.ClientSession() as session:
        sources: list = []
        p2p = announcer = None
        if args.mode.startswith("swarm"):  # a joined node: super-seeding counts only signed requests of joined nodes
            from node.p2p import P2PNode
            from node.p2p.config import P2PConfig
            from node.p2p.shard_store import CheckpointShards
            from protocol.signing import sign_request

            from protocol import messages as M

            sources.append(HttpSource(args.origin, "coordinator", session, swarm=True,
                                      signer=lambda m, path: sign_request(identity, m, path, b"", run_id=args.run_id)))
            # a worker's host, on 127.0.0.1; swarm-http: with p2p.http = true
            # every node is on 127.0.0.1: peers' loopback addresses must be dialable (as configs/local.toml says for
            # the demo). Without it a node could fetch only from peers already connected to it, and dialled none
            # that announced a shard ("not connected and announced no address we may dial"): with step 0 seeded,
            # bench/lora.py's 16-node rounds got 0 bytes from peers.
            cfg = P2PConfig(listen_host="127.0.0.1", http=args.mode == "swarm-http", bootstrap=args.bootstrap,
                            allow_private_addrs=True)
            p2p = P2PNode(identity, cfg, run_id=args.run_id, coordinator_key=args.key,
                          shard_source=CheckpointShards(store.ckpt_dir))
            await p2p.start()
            # joined as a worker joins (node/worker/node.py): with its listen ports, so the coordinator dials them
            # back, and then announcing what it reached; the origin names a first holder (X-Prime-Holder) only at an
            # address its dial-back reached (before, the bench joined without ports and no hint was ever given)
            spec = await CoordinatorClient(args.origin, identity, session).join(
                M.NodeInfo(listen_ports=M.ListenPorts(**p2p.listen_ports())))
            if spec.reachability is not None:
                p2p.apply_reachability(spec.reachability.observed_ip, spec.reachability.libp2p,
                                       spec.reachability.http)
            sources[0].shard_addr = lambda: p2p.origin_shard_addrs
            sources.append(PeerSource(p2p))
            announcer = HaveAnnouncer(p2p, interval=0.05)
        elif args.mode == "relay":
            sources.append(HttpSource(args.relay, "relay", session))
        else:
            sources.append(HttpSource(args.origin, "coordinator", session))
        events: list = []
        failures: list[str] = []
        outcomes = _count_outcomes(sources, events, failures)

        def on_shards(step: int, h: str, indices: list[int]) -> None:
            # as the worker's (node/worker/node.py _on_shards): the peer table learns the step's signed manifest from
            # the fetcher too, not only from the coordinator's gossip (a hint or `have` for a step it does not know
            # is not kept), and the shards are announced
            assert p2p is not None and announcer is not None
            p2p.note_manifest(step, h)
            announcer.add(step, h, indices)

        f = Fetcher(store, sources, args.key, keep=3, on_new_step=lambda s, p: done.setdefault("t", time.monotonic()),
                    on_shards=on_shards if announcer else None)
        if p2p:
            p2p.add_listener(lambda event: f.announce_change())
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        cpu_go = _cpu_seconds()
        bg = asyncio.create_task(announcer.run(stop)) if announcer else None
        t0 = time.monotonic()
        while "t" not in done:  # a relay lists the step only once it has mirrored all of it
            try:
                if await f.sync_once() is None:
                    await asyncio.sleep(0.05)
            except FetchError:  # e.g. the relay is still starting
                await asyncio.sleep(0.05)
        print(json.dumps({"seconds": done["t"] - t0, "outcomes": outcomes,
                          "events": [(round(a - t0, 3), round(b - t0, 3), *rest) for a, b, *rest in events],
                          "failures": failures,
                          **{k: f.bytes_by_kind[k] for k in ("coordinator", "relay", "peer")}}), flush=True)
        # keep serving peers until told to stop; then say how much CPU this process used in the round
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(json.dumps({"round_cpu_seconds": _cpu_seconds() - cpu_go,
                          "p2p": p2p.stats.snapshot() if p2p else {}}), flush=True)
        stop.set()
        if bg:
            await bg
        if p2p:
            await p2p.stop()


async def one_round(mode: str, n: int, coord, url: str, work: Path, events_file: Path | None = None, *,
                    seed: Callable[[Path], None] | None = None, at_go: Callable[[], Awaitable[Any]] | None = None,
                    step: int = 0, unmerged: bool = False) -> dict:
    """One broadcast of `step` to n nodes. bench/lora.py: `seed(node_dir)` fills each node's store before it starts
    (e.g. with step 0), `at_go()` runs once the clock started (e.g. publishes `step`); --unmerged nodes hold an
    adapter step unmerged (worker.lora_serving = "adapter")."""
    key = coord.identity.public_hex
    relay = relay_task = None
    relay_url = ""
    if mode == "relay":  # the origin serves the relay; nodes fetch from the relay only
        with socket.socket() as sock:  # the relay starts with the clock; nodes need its address now
            sock.bind(("127.0.0.1", 0))
            relay_port = sock.getsockname()[1]
        relay_url = f"http://127.0.0.1:{relay_port}"
        relay = Relay(url, work / "relay", upstream_key=key)
    procs = []
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for i in range(n):
        cmd = [sys.executable, __file__, "--node", "--mode", mode, "--dir", str(work / f"n{i}"), "--origin", url,
               "--key", key, "--run-id", coord.cfg.run.run_id, "--relay", relay_url or "-"] + (["--unmerged"] if unmerged else [])
        if seed is not None:
            seed(work / f"n{i}")
        for b in coord.p2p_bootstrap():
            cmd += ["--bootstrap", b]
        work.mkdir(parents=True, exist_ok=True)
        procs.append(await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE,
                                                          stdout=asyncio.subprocess.PIPE,
                                                          stderr=open(work / f"n{i}.log", "w")))
    for p in procs:
        line = await asyncio.wait_for(p.stdout.readline(), 120)
        assert line.strip() == b"ready", line
    if mode.startswith("swarm"):
        await asyncio.sleep(2.0)  # let gossipsub meshes form before the clock starts
    t0 = time.monotonic()
    if mode == "relay":
        relay_task = asyncio.create_task(relay.run("127.0.0.1", relay_port))
    for p in procs:
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    if at_go is not None:
        await at_go()
    results = []
    for i, p in enumerate(procs):
        line = await asyncio.wait_for(p.stdout.readline(), 600)
        if not line:
            raise RuntimeError(f"node {i} died:\n" + (work / f"n{i}.log").read_text()[-3000:])
        results.append(json.loads(line))
    total = time.monotonic() - t0
    if events_file is not None:
        events_file.write_text(json.dumps({"mode": mode, "nodes": n, "seconds": total,
                                           "events_by_node": [r["events"] for r in results]}))
    # when the origin sent its last shard, and when the last node had its last one (each from that node's "go")
    ok = [e for r in results for e in r["events"] if e[3] == "ok"]
    origin_done = max((e[1] for e in ok if e[2] == "coordinator"), default=None)
    outcomes: dict[str, float] = {}
    failures = sorted({f for r in results for f in r.get("failures", [])})[:10]
    for r in results:
        for k, v in r.get("outcomes", {}).items():
            outcomes[k] = round(outcomes.get(k, 0) + v, 2)
    for p in procs:
        p.stdin.write(b"stop\n")
        await p.stdin.drain()
    # CPU used from "go" to "stop" (the whole process's, start-up included, is node_cpu_seconds below)
    round_cpu, p2p_counts = 0.0, {}
    for p in procs:
        end = json.loads(await asyncio.wait_for(p.stdout.readline(), 60))
        round_cpu += end["round_cpu_seconds"]
        # why peers turned shard requests and gossip away, and how much gossip arrived
        for group in ("requests_refused", "streams_aborted", "announcements_dropped", "announcements_received"):
            for k, v in (end.get("p2p", {}).get(group) or {}).items():
                if isinstance(v, (int, float)):
                    p2p_counts[f"{group} {k}"] = p2p_counts.get(f"{group} {k}", 0) + v
    await asyncio.gather(*(p.wait() for p in procs))
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    node_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    if relay is not None:
        relay.stop_event.set()
        await relay_task
    payload = coord.checkpoints.payload_path(step).read_bytes()
    for i in range(n):
        if unmerged and step:  # the node holds the rebuilt adapter, verified against its manifest's hashes
            assert CheckpointDir(work / f"n{i}", unmerged_adapters=True).weights_path(step).is_file()
        else:
            assert (work / f"n{i}" / "payloads" / f"{step}.safetensors").read_bytes() == payload, \
                "a node got a wrong model"
    return {"mode": mode, "nodes": n, "seconds": round(total, 2), "node_cpu_seconds": round(node_cpu, 1),
            "origin_done_s": origin_done and round(origin_done, 2), "shards_done_s": round(max(e[1] for e in ok), 2),
            "round_cpu_seconds": round(round_cpu, 1), "p2p_counts": dict(sorted(p2p_counts.items())),
            "shard_requests": dict(sorted(outcomes.items())), "failure_samples": failures,
            "bytes_from_origin": sum(r["coordinator"] for r in results) + (relay.fetcher.bytes_by_kind["coordinator"] if relay else 0),
            "bytes_from_relay": sum(r["relay"] for r in results), "bytes_from_peers": sum(r["peer"] for r in results)}


async def start_origin(tmp: Path, cap: int):
    cfg = load_config(REPO / "configs/local.toml", [f"storage.dir={tmp}/coord", *MODEL, "run.max_steps=0",
                                                   f"distribution.origin_upload_limit={cap}"])
    coord = Coordinator(cfg, Identity.generate())
    runner, port = await start_server(coord, "127.0.0.1", 0)
    return coord, runner, f"http://127.0.0.1:{port}"


async def main_async(sizes: list[int], cap: int, modes: list[str], events_dir: Path | None = None) -> dict:
    """A fresh coordinator per round, so no round sees another round's peers in its gossip."""
    logging.basicConfig(level=logging.ERROR)
    rows = []
    compressed = ideal = None
    for n in sizes:
        for mode in modes:
            tmp = Path(tempfile.mkdtemp(prefix="prime-broadcast-"))
            coord, runner, url = await start_origin(tmp, cap)
            try:
                if compressed is None:
                    compressed = coord.checkpoints.manifest(0).compressed_size
                    ideal = compressed / cap
                    print(f"checkpoint: {compressed / 1e6:.2f} MB compressed, origin cap {cap / 1e6:.2f} MB/s "
                          f"-> one copy takes {ideal:.2f} s", flush=True)
                if mode == "shardcast":  # shardcast's own origin (same cap), middle node and clients
                    from shardcast_mode import shardcast_round

                    m = coord.checkpoints.manifest(0)
                    shards = [coord.checkpoints.shard_path(0, i) for i in range(m.num_shards)]
                    r = await shardcast_round(n, shards, cap, tmp / "shardcast")
                else:
                    r = await one_round(mode, n, coord, url, tmp / "nodes",
                                        events_dir / f"{mode}-{n}.json" if events_dir else None)
            finally:
                await runner.cleanup()
                await coord.stop()
                shutil.rmtree(tmp, ignore_errors=True)
            r["x_one_copy"] = round(r["seconds"] / ideal, 2)
            r["one_copy_seconds"] = round(ideal, 3)
            r["origin_bytes"] = r["bytes_from_origin"]
            rows.append(r)
            print(f"  N={n:<3} {mode:<7} {r['seconds']:7.2f} s  ({r['x_one_copy']:.2f}x one copy)  "
                  f"origin {r['bytes_from_origin'] / 1e6:.1f} MB, relay {r['bytes_from_relay'] / 1e6:.1f} MB, "
                  f"peers {r['bytes_from_peers'] / 1e6:.1f} MB, node CPU {r['node_cpu_seconds']:.0f} s "
                  f"({r.get('round_cpu_seconds', float('nan')):.0f} s in the round)"
                  + (f", a peer fetch took {q['peer ok s'] / q['peer ok']:.3f} s on average"
                     if (q := r.get("shard_requests") or {}).get("peer ok") else ""), flush=True)
    return {"benchmark": "broadcast", "compressed_bytes": compressed, "origin_upload_limit": cap,
            "one_copy_seconds": round(ideal, 3), "rows": rows, "machine": f"{os.cpu_count()} cores"}


def plot(doc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for mode, color in (("origin", "#d9534f"), ("relay", "#f0ad4e"), ("swarm", "#5cb85c"),
                        ("swarm-http", "#2e6b2e"), ("shardcast", "#5bc0de")):
        rows = sorted((r for r in doc["rows"] if r["mode"] == mode), key=lambda r: r["nodes"])
        ax.plot([r["nodes"] for r in rows], [r["seconds"] for r in rows], marker="o", label=mode, color=color)
    ax.axhline(1.5 * doc["one_copy_seconds"], color="gray", ls="--", lw=1, label="1.5 x one copy at the cap")
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds until all hold the checkpoint")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "broadcast.png")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", "--sizes", dest="sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--modes", default="origin,relay,swarm",
                    help="any of origin,relay,swarm,swarm-http,shardcast (comma-separated; swarm-http: p2p.http = true; "
                         "shardcast: pip install shardcast==0.3.2)")
    ap.add_argument("--cap", type=int, default=500_000, help="origin upload cap, bytes/s")
    ap.add_argument("--events", type=Path, metavar="DIR",
                    help="write every node's shard requests (start s, end s, source, outcome, shard) to DIR/<mode>-<N>.json")
    ap.add_argument("--node", action="store_true", help=argparse.SUPPRESS)  # child process: one node
    for a in ("--mode", "--dir", "--origin", "--key", "--run-id", "--relay"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--unmerged", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        asyncio.run(run_node(args))
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"origin", "relay", "swarm", "swarm-http", "shardcast"}
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from origin, relay, swarm, swarm-http, shardcast")
    if "shardcast" in modes and importlib.util.find_spec("shardcast") is None:
        ap.error("mode shardcast needs INTELLECT-2's shardcast: pip install shardcast==0.3.2 (and wget on PATH)")
    if args.events:
        args.events.mkdir(parents=True, exist_ok=True)
    doc = asyncio.run(main_async(args.sizes, args.cap, modes, args.events))
    out = REPO / "bench" / "results" / "broadcast.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # rows of earlier runs stay for the (mode, nodes) pairs this run did not measure
    fresh = {(r["mode"], r["nodes"]) for r in doc["rows"]}
    try:
        old = json.loads(out.read_text())
        kept = [r for r in old.get("rows", old.get("results", [])) if (r["mode"], r["nodes"]) not in fresh
                and r.get("one_copy_seconds", old.get("one_copy_seconds")) is not None]
        for r in kept:
            r.setdefault("one_copy_seconds", old.get("one_copy_seconds"))
            r.setdefault("origin_bytes", r.get("bytes_from_origin"))
    except (OSError, ValueError, KeyError):
        kept = []
    doc["rows"] = sorted(kept + doc["rows"], key=lambda r: (r["nodes"], r["mode"]))
    out.write_text(json.dumps(doc, indent=2))
    plot(doc)
    print(f"\n{'N':>3} {'mode':>7} {'seconds':>8} {'x one copy':>11} {'origin MB':>10}")
    for r in doc["rows"]:
        print(f"{r['nodes']:>3} {r['mode']:>7} {r['seconds']:>8.2f} {r['x_one_copy']:>10.2f}x "
              f"{r['origin_bytes'] / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
