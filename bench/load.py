"""Coordinator under load: N simulated nodes against a real coordinator process on 127.0.0.1.

Each simulated node does what a worker does on the wire, signed (run-bound v2, docs/PROTOCOL.md, "Signed requests"):
GET /v1/status and join once (as the worker's client does); a heartbeat every --heartbeat seconds (its phase drawn at random, so the N heartbeats
are spread over the period and not synchronised); and the work cycle: POST /v1/work, "generate"
for a time drawn per assignment from --gen (no model runs), then POST /v1/submit with one rollout
per sample of the assignment. A 204 (no work now) means wait --idle seconds (drawn) and ask again;
a 429 means back off (doubling, with jitter); a 409 stale_policy means "fetch a newer checkpoint":
the node reads GET /v1/checkpoints and uses the newest step. Nodes learn new steps from their
heartbeat answers (current_step), as a node without p2p gossip would between fetcher polls.

Submissions have the size the run dictates: the assignment's group size and prompts, completions of
1..max_tokens tokens (uniform; about one in ten ends by length) with one float32 logprob per token,
and one activation commitment per rollout of exactly the wire size a real one has for that length
and the model's hidden size (verify/commitment.py: per 32-token chunk u16 p, u8 k, k u16
coefficients; decodable, random content). They are structurally valid but not model output, so the
coordinator runs with verification.fraction=0; everything else (signature, replay store, rate
limits, pydantic, structural checks, rewards, SQLite ledger, the training thread that trains the
tiny model on the accepted groups) is the real thing.

Run shapes (--shape, each run at every N): "gpu-example" is configs/gpu-example.toml's run shape (G = 16,
8 prompts per assignment, max_tokens 512, batches of 64 prompts: a submission is ~1.3 MB); "local" is
configs/local.toml's own (G = 8, 2 prompts, max_tokens 8) with batches sized so that the k + 1 open
batches hold one assignment per node. The coordinator's storage is a fresh temp dir (--tmp-root
/dev/shm puts it on tmpfs, which takes the disk's fsync out of the picture); once a second the bench
also times one SQLite commit with the ledger's settings next to it, to show what the disk cost then.

The nodes live in --procs client processes, each one asyncio loop with its share of the nodes and
one HTTP connection pool per node (as separate machines would have). Joins are spread over the first
heartbeat period; then --warmup seconds; then the measured window of --seconds. Only requests that
start inside the window are counted. Coordinator CPU seconds come from /proc/PID/stat over the window,
its RSS from /proc/PID/status (VmRSS sampled every 0.25 s in the window, VmHWM for the whole life).
Latency is measured by the client (send to full answer read); each client process also records its
own event-loop lag, so a client that could not keep up shows up as such.

    .venv/bin/python bench/load.py [--nodes 100,1000] [--seconds 60] [--shape gpu-example,local] [--procs 4]
        [--trainer train,idle] [--baseline GIT_REF] [--layout one-process,engine-process] [--py-spy PATH]
--trainer idle gives the run a batch nobody fills (the training thread only waits: the process's CPU is the
API's); --baseline runs that commit's coordinator (a git worktree in the temp dir, this venv; in the layouts of
--baseline-layout, one-process by default) before the working tree's at every point and prints the ratios; --py-spy
profiles each window (where the CPU goes, by category and endpoint; --py-spy-wall: wall time, idle included);
--asyncio-debug lists the callbacks that held the coordinator's event loop over 100 ms. Each summary row counts the
window's answers slower than the target by the second they were asked in (a stall shows as a few busy seconds). Each summary row also has the event loop thread's CPU apart and CPU ms per request.
--layout runs the working tree's coordinator in one process, with server.engine_process = true (training in
its own process, node/coordinator/engine.py), or both, one after the other at every point, and prints them
side by side; the API process's CPU is `coordinator_cpu_*`, the engine's `engine_cpu_s`.
Writes bench/results/load.json ({"rows": [...]}: one row per (shape, N, endpoint), one summary row per
(shape, N) with the coordinator's CPU and RSS, and whether the target was met: p99 < 200 ms on every
endpoint and 0 errors). Expected answers: 2xx (204 included), 429 (counted apart) and 409 stale_policy;
anything else is an error.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "results"

from node.aio import CLIENT_KEEPALIVE_S  # noqa: E402  (the nodes' client keep-alive, as a worker's)

ENDPOINTS = ["/v1/status", "/v1/join", "/v1/heartbeat", "/v1/work", "/v1/submit", "/v1/checkpoints"]
# Requests made once per node, when it starts (spread over the first heartbeat period, before the window).
BEFORE_WINDOW = {"/v1/status": "once per node before joining, as the worker's client does (before the window)",
                 "/v1/join": "once per node, spread over the first heartbeat period (before the window)"}
TARGET_P99_MS = 200.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The coordinator is configs/local.toml (tiny model, reverse-text task, k = 2) with a run shape:
# "gpu-example" is the shape of configs/gpu-example.toml, the repo's example of a real run (a submission
# is 128 rollouts of up to 512 tokens); "local" is local.toml's own demo shape (16 rollouts of up to 8
# tokens), with the batch sized so that the async window can hold one assignment per node.
SHAPES = {
    "gpu-example": {"group_size": 16, "prompts_per_assignment": 8, "batch_prompts": "64", "max_tokens": 512},
    "local": {"group_size": 8, "prompts_per_assignment": 2, "batch_prompts": "auto", "max_tokens": 8},
}
def batch_prompts(args, n: int) -> int:
    """'auto': the k + 1 open batches hold one assignment per node."""
    if args.batch_prompts == "auto":
        from node.config import load_config

        k = load_config(REPO / "configs/local.toml", args.set).run.async_level
        return max(8, math.ceil(n * args.prompts_per_assignment / (k + 1)))
    return int(args.batch_prompts)


# --trainer idle: a batch no run fills, so the training thread only waits and the coordinator's CPU is the API's
IDLE_BATCH_PROMPTS = 1_000_000


def coordinator_overrides(args, storage: Path, n: int, trainer: str = "train",
                          layout: str = "one-process") -> list[str]:
    return [
        f"storage.dir={storage}",
        f"server.engine_process={'true' if layout == 'engine-process' else 'false'}",  # named in both: whatever the default
        "verification.fraction=0",  # the rollouts are not model output
        "admission.pow_bits=0",
        "admission.joins_per_address_per_minute=1000000",  # every simulated node is 127.0.0.1
        f"server.rate_limit_per_second={args.rate_limit}",  # per node: a node here averages < 1 request/s
        f"server.rate_limit_burst={args.rate_burst}",
        f"run.group_size={args.group_size}",
        f"run.prompts_per_assignment={args.prompts_per_assignment}",
        f"run.batch_prompts={IDLE_BATCH_PROMPTS if trainer == 'idle' else batch_prompts(args, n)}",
        f"sampling.max_tokens={args.max_tokens}",
        *args.set,
    ]


# --- client side -----------------------------------------------------------------------------------
def commitment_of_size(n_tokens: int, hidden: int, rng: random.Random) -> str:
    """A decodable commitment with the exact wire size of a real one for n tokens (random coefficients)."""
    from verify.commitment import FIELD_MAX, chunk_bounds, points_per_chunk

    chunks = []
    for s, e in chunk_bounds(n_tokens):
        k = points_per_chunk((e - s) * hidden)
        chunks.append(struct.pack("<HB", FIELD_MAX, k)
                      + struct.pack(f"<{k}H", *(rng.randrange(FIELD_MAX) for _ in range(k))))
    return base64.b64encode(struct.pack("<BH", 1, len(chunks)) + b"".join(chunks)).decode("ascii")


def rollout_fragment(max_tokens: int, vocab: int, eos: int, hidden: int, rng: random.Random,
                     nine_digits: bool = False) -> str:
    """The JSON fields of one rollout after prompt_id/sample_index, pre-serialised; `nine_digits`: logprobs as the
    worker writes them since it compresses (protocol.messages.wire_logprobs), else as 17-digit Python floats."""
    import numpy as np

    if rng.random() < 0.1:  # ran into max_tokens
        ids, reason = [rng.randrange(5, vocab) for _ in range(max_tokens)], "length"
    else:
        n = rng.randint(1, max_tokens - 1)
        ids, reason = [rng.randrange(5, vocab) for _ in range(n)] + [eos], "stop"
    body = ids if reason == "length" else ids[:-1]  # EOS only as the last token of a "stop" rollout
    ids = [t if t != eos else (eos + 1) % vocab for t in body] + ids[len(body):]
    # float32 logprobs as a sampler reports them (.tolist() of a float32 tensor)
    lps = np.float32(-3.0) * np.array([rng.random() for _ in ids], dtype=np.float32)
    from protocol.messages import wire_logprobs

    logprobs = wire_logprobs([float(x) for x in lps]) if nine_digits else [float(x) for x in lps]
    return (f'"completion_ids":{json.dumps(ids)},"logprobs":{json.dumps(logprobs)},'
            f'"finish_reason":"{reason}","commitment":"{commitment_of_size(len(ids), hidden, rng)}"')


class Recorder:
    def __init__(self):
        self.rows: list[tuple] = []  # (endpoint, status, error code, latency s, started wall s, body bytes)

    def add(self, *row) -> None:
        self.rows.append(row)


class SimNode:
    def __init__(self, ctx: "Client", index: int):
        from protocol.identity import Identity

        self.c, self.index = ctx, index
        self.identity = Identity.generate()
        self.rng = random.Random(ctx.seed * 1_000_003 + index)
        self.session = None
        self.held = 0  # policy step "held" (the node would have fetched it)
        self.known = 0  # newest step the node has heard of
        self.state = "starting"
        self.tokens = 0
        self.retry_ms = 0  # the last answer's X-Prime-Retry-After-Ms (POST /v1/work's 204), 0 if none

    async def call(self, endpoint: str, payload, *, signed: bool = True, method: str = "POST"):
        import aiohttp
        from node.http import COMPRESS_MIN_BYTES, compress_body
        from protocol.signing import sign_request

        c = self.c
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode() if payload is not None else b""
        headers = {}
        compress = signed and c.args["compress"] and len(body) >= COMPRESS_MIN_BYTES  # CoordinatorClient._signed
        if compress:
            body = await asyncio.to_thread(compress_body, body)
        if signed:
            headers = sign_request(self.identity, method, endpoint, body, run_id=c.run_id)
            headers["Content-Type"] = "application/json"
            if compress:
                headers["Content-Encoding"] = "zstd"
        wall, t0 = time.time(), time.perf_counter()
        code, data = "", None
        try:
            async with self.session.request(method, c.base + endpoint, data=body if signed else None,
                                            headers=headers) as r:
                raw = await r.read()
                status = r.status
                retry = r.headers.get("X-Prime-Retry-After-Ms", "")
                self.retry_ms = int(retry) if retry.isascii() and retry.isdigit() else 0
            if raw:
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = None
            if status >= 400 and isinstance(data, dict):
                code = str(data.get("error", ""))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            status, code = -1, type(e).__name__
        c.rec.add(endpoint, status, code, time.perf_counter() - t0, wall, len(body))
        return status, data, code

    async def run(self, start_at: float) -> None:
        import aiohttp

        c = self.c
        await asyncio.sleep(max(0.0, start_at - time.time()))
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4, keepalive_timeout=CLIENT_KEEPALIVE_S),
                                             timeout=aiohttp.ClientTimeout(total=120))
        try:
            await self.call("/v1/status", None, signed=False, method="GET")  # what a worker reads before joining
            backoff = 1.0
            while not c.stopping():  # join (a 429 would mean the join limit: back off and retry)
                st, spec, _ = await self.call("/v1/join", {"node": {"backend": "sim", "device": "none"}})
                if st == 200:
                    break
                await self.sleep(backoff * (0.5 + self.rng.random()))
                backoff = min(backoff * 2, 30)
            else:
                return
            self.held = self.known = int(spec["current_step"])
            c.learn_spec(spec)
            await asyncio.gather(self.heartbeats(), self.work())
        finally:
            await self.session.close()

    async def sleep(self, seconds: float) -> None:
        """Sleep, cut short when the run ends."""
        try:
            await asyncio.wait_for(self.c.stop_event.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def heartbeats(self) -> None:
        c = self.c
        await self.sleep(self.rng.random() * c.args["heartbeat"])  # this node's phase in the period
        next_at = time.monotonic()
        while not c.stopping():
            hb = {"policy_step": self.held, "tokens_per_second": round(self.rng.uniform(500, 5000), 3),
                  "state": self.state, "steps_held": list(range(max(0, self.held - 2), self.held + 1)),
                  "bytes_by_source": {"coordinator": 1000 * self.held}}
            st, data, _ = await self.call("/v1/heartbeat", hb)
            if st == 200:
                self.known = c.saw_step(self.known, int(data["current_step"]))
            period = c.args["heartbeat"]
            if c.args["idle_mode"] == "paced" and st == 200 and self.retry_ms:  # the coordinator paces heartbeats too
                period = max(period, self.retry_ms / 1000)
            next_at += period
            await self.sleep(max(0.0, next_at - time.monotonic()))

    async def refresh_step(self) -> None:
        st, data, _ = await self.call("/v1/checkpoints", None, signed=False, method="GET")
        if st == 200:
            self.known = self.c.saw_step(self.known, int(data["newest"]))

    async def work(self) -> None:
        c = self.c
        a = c.args
        backoff = 1.0
        while not c.stopping():
            if self.known > self.held:
                self.held = self.known  # "fetched" the newer checkpoint
            if a["checkpoint_poll"] > 0 and time.monotonic() - getattr(self, "_polled", 0) > a["checkpoint_poll"]:
                self._polled = time.monotonic()
                await self.refresh_step()
                continue
            self.state = "idle"
            st, w, code = await self.call("/v1/work", {"policy_step": self.held})
            if st == 200:
                backoff = 1.0
                await self.generate_and_submit(w)
            elif st == 204:
                backoff = 1.0
                if a["idle_mode"] == "paced" and self.retry_ms:
                    await self.idle_paced(self.retry_ms)
                else:
                    await self.sleep(self.rng.uniform(*a["idle"]))
            elif st == 409 and code == "stale_policy":
                self.state = "fetching"
                await self.refresh_step()
                if self.known <= self.held:
                    await self.sleep(self.rng.uniform(*a["idle"]))
            else:  # 429 rate limit (or anything unexpected): back off
                await self.sleep(backoff * (0.5 + self.rng.random()))
                backoff = min(backoff * 2, 30)

    async def idle_paced(self, retry_ms: int) -> None:
        """What node/worker/node.py does after a 204: wait the coordinator's X-Prime-Retry-After-Ms (±25 %), or
        until a new step is held. A simulated node "holds" a step as soon as any node of its client process has
        heard of it (a real one fetches it, woken by a peer's announcement or its own poll)."""
        c = self.c
        if c.newest <= self.held:
            try:
                await asyncio.wait_for(c.new_step.wait(), timeout=retry_ms / 1000 * (0.75 + 0.5 * self.rng.random()))
            except asyncio.TimeoutError:
                pass
        self.known = max(self.known, c.newest)

    async def generate_and_submit(self, w: dict) -> None:
        c = self.c
        self.state = "generating"
        step = self.held
        await self.sleep(self.rng.uniform(*c.args["gen"]))
        if c.stopping():
            return  # abandoned, as a stopping worker does; the deadline re-issues the prompts
        parts = []
        for p in w["prompts"]:
            pid = json.dumps(p["prompt_id"])
            for j in range(len(p["seeds"])):
                parts.append(f'{{"prompt_id":{pid},"sample_index":{j},{c.fragment(self.rng)}}}')
        body = (f'{{"assignment_id":{json.dumps(w["assignment_id"])},"policy_step":{step},"rollouts":['
                + ",".join(parts) + "]}").encode()
        backoff = 1.0
        for _ in range(6):
            st, res, code = await self.call("/v1/submit", body)
            if st == 200:
                c.accepted += len(res["accepted"])
                c.rejected.update(r["reason"] for r in res["rejected"])
                return
            if st != 429 and st != -1:
                return  # 409 stale/expired: the work is lost, as for a real worker
            await self.sleep(backoff * (0.5 + self.rng.random()))
            backoff *= 2


class Client:
    """One client process: an asyncio loop with its share of the nodes."""

    def __init__(self, args: dict):
        self.args = args
        self.base, self.run_id, self.seed = args["base"], args["run_id"], args["seed"]
        self.rec = Recorder()
        self.stop_event: asyncio.Event | None = None
        self.end_at = 0.0
        self.spec = None
        self.pool: list[str] = []
        self.accepted = 0
        self.rejected: Counter = Counter()
        self.lags: list[float] = []
        self.newest = 0  # the newest step any node of this process has heard of
        self.new_step = asyncio.Event()  # set (and replaced) when it moves: idle paced nodes wake

    def saw_step(self, known: int, step: int) -> int:
        """A node heard of `step`: its new `known`; wakes this process's paced idle nodes if it is news."""
        if step > self.newest:
            self.newest = step
            self.new_step.set()
            self.new_step = asyncio.Event()
        return max(known, step)

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def learn_spec(self, spec: dict) -> None:
        cfg = spec["model_config_json"]
        a = self.args
        assert (int(cfg["vocab_size"]), int(spec["eos_token_id"]), int(cfg["hidden_size"])) == (a["vocab"], a["eos"], a["hidden"])

    def build_pool(self) -> None:
        """Pre-serialised rollouts, built before the run starts: building 128 rollouts of up to 512 tokens
        per submission from scratch would make the clients, not the coordinator, the bottleneck."""
        a = self.args
        rng = random.Random(self.seed)
        # the worker of the coordinator's tree: 9-digit logprobs where it takes zstd (both came in one change)
        self.pool = [rollout_fragment(a["max_tokens"], a["vocab"], a["eos"], a["hidden"], rng, a["compress"])
                     for _ in range(a["pool"])]

    def fragment(self, rng: random.Random) -> str:
        return self.pool[rng.randrange(len(self.pool))]

    async def lag_monitor(self) -> None:
        while not self.stopping():
            t = time.perf_counter()
            await asyncio.sleep(0.05)
            self.lags.append((time.time(), time.perf_counter() - t - 0.05))

    async def main(self, t0: float) -> None:
        self.stop_event = asyncio.Event()
        a = self.args
        asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + (a["end_at"] - time.time()), self.stop_event.set)
        nodes = [SimNode(self, i) for i in a["indices"]]
        starts = {i: t0 + random.Random(a["seed"] + i).random() * a["ramp"] for i in a["indices"]}
        mon = asyncio.create_task(self.lag_monitor())
        await asyncio.gather(*(n.run(starts[n.index]) for n in nodes))
        await mon


def client_process(args: dict, conn) -> None:
    c = Client(args)
    c.build_pool()
    conn.send("ready")
    t0, args["end_at"] = conn.recv()
    cpu0 = os.times()
    asyncio.run(c.main(t0))
    cpu1 = os.times()
    conn.send({"rows": c.rec.rows, "accepted": c.accepted, "rejected": dict(c.rejected), "lags": c.lags,
               "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)})
    conn.close()


# --- the coordinator process -------------------------------------------------------------------------
def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of a process, or of one of its threads (the main thread, tid == pid, runs the event loop)."""
    stat = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def proc_mem_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


def machine_busy_s() -> float:
    """All CPU time spent on this machine (every process), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / CLK_TCK


class DiskProbe:
    """Once a second, one committed one-row UPDATE in a SQLite file next to the coordinator's ledger, with the
    ledger's settings (WAL, synchronous=FULL): what a commit cost on this disk during the window."""

    def __init__(self, path: Path):
        import sqlite3

        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE t(k INTEGER PRIMARY KEY, v INTEGER)")
        self.db.execute("INSERT INTO t VALUES(1, 0)")
        self.ms: list[float] = []

    def commit(self) -> None:
        t = time.perf_counter()
        self.db.execute("UPDATE t SET v = v + 1 WHERE k = 1")
        self.ms.append(1000 * (time.perf_counter() - t))

    def summary(self) -> dict:
        self.db.close()
        ms = sorted(self.ms)
        return {"samples": len(ms), "p50": round(pct(ms, 0.5), 2), "p99": round(pct(ms, 0.99), 2),
                "max": round(ms[-1], 2) if ms else None}


# --py-spy: where the coordinator's CPU goes in the window, by category. A sample is put in the category of its
# innermost frame that matches (so "ledger" is SQLite work reached from anywhere, and "aiohttp" is HTTP
# parsing and writing that no more specific frame claims). Endpoints: the app.py handler on the stack.
PROFILE_CATEGORIES = [
    ("signature (Ed25519)", ("verify_bytes",)),
    ("body sha256", ("sha256_hex",)),
    ("commitment decode", ("parse_commitment",)),
    ("pydantic validation", ("model_validate",)),
    ("JSON parse", ("strict_json_loads",)),
    ("response JSON", ("model_dump_json", "json_response", "_json (node/coordinator/app.py")),
    ("status build", ("build_status",)),
    ("ledger (SQLite)", ("node/coordinator/ledger.py",)),
    ("prometheus", ("prometheus_client",)),
    ("logging", ("logging/",)),
    ("intake (triage, rewards)", ("node/coordinator/intake.py",)),
    ("scheduler", ("node/coordinator/scheduler.py",)),
    ("rate limits, body budget", ("node/rate_limit.py", "BodyBudget")),
    ("training", ("node/coordinator/training.py", "node/trainer/", "torch/")),
    ("aiohttp (HTTP)", ("aiohttp/",)),
    ("asyncio", ("asyncio/", "selectors.py")),
]
HANDLERS = ("join", "heartbeat", "work", "submit", "status", "metrics")


def start_py_spy(args, pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    if not args.py_spy:
        return None
    # --nonblocking: the process is not paused per sample (blocking sampling at 100+ Hz slowed it visibly);
    # --gil: only samples whose thread holds the GIL, i.e. Python at work (a thread in a lock or epoll wait is
    # not CPU); C code that drops the GIL (SQLite's page I/O, hashing of large bodies) is under-counted.
    # --py-spy-wall: every sample, GIL or not, idle included (--idle): where the loop thread spends its wall time,
    # e.g. blocked in a SQLite call (a lock, an fsync) rather than waiting in epoll
    which = ["--idle"] if args.py_spy_wall else ["--gil"]
    return subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", str(args.py_spy_rate), "--nonblocking", *which, "--threads", "--format", "raw",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finish_py_spy(spy: subprocess.Popen | None, path: Path, args, name: str) -> dict | None:
    if spy is None:
        return None
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
    if not path.exists():
        return {"error": "py-spy wrote nothing (ptrace not permitted?)"}
    shutil.copy(path, OUT / f"load_profile_{name}.txt")
    return summarise_profile(path.read_text())


def summarise_profile(collapsed: str) -> dict:
    """py-spy's collapsed stacks -> % of samples by thread, by category (loop thread apart) and by endpoint."""
    import re

    by_thread: Counter = Counter()
    by_cat: Counter = Counter()
    by_ep: Counter = Counter()
    by_ep_cat: Counter = Counter()  # endpoint x category, any thread: the per-endpoint breakdown
    total = 0
    handler = re.compile(rf"^(?:build_app\.<locals>\.)?({'|'.join(HANDLERS)}) \(node/coordinator/app\.py")
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        thread = ("loop" if "MainThread" in frames[0] else
                  "training" if any("node/coordinator/training.py" in f for f in frames) else
                  "to_thread" if any("concurrent/futures/thread.py" in f for f in frames) else "other threads")
        by_thread[thread] += n
        cat = next((c for f in reversed(frames) for c, keys in PROFILE_CATEGORIES if any(k in f for k in keys)), "other")
        by_cat[f"{thread}: {cat}"] += n
        ep = next((m[1] for f in frames if (m := handler.match(f))), None)
        if ep is None and any("checkpoint_routes.py" in f for f in frames):
            ep = "checkpoints"
        by_ep[f"{thread}: {ep or '-'}"] += n
        by_ep_cat[f"{ep or '-'}: {cat}"] += n

    def pct_of(c: Counter) -> dict:
        return {k: round(100 * v / max(1, total), 1) for k, v in c.most_common()}
    return {"samples": total, "by_thread_pct": pct_of(by_thread), "by_category_pct": pct_of(by_cat),
            "by_endpoint_pct": pct_of(by_ep), "by_endpoint_category_samples": dict(by_ep_cat.most_common())}


def print_profile(p: dict, top: int = 14) -> None:
    print(f"{'':<19}profile ({p['samples']} GIL-holding samples): threads " +
          ", ".join(f"{k} {v}%" for k, v in p["by_thread_pct"].items()))
    print(f"{'':<19}  categories: " + ", ".join(f"{k} {v}%" for k, v in list(p["by_category_pct"].items())[:top]))
    print(f"{'':<19}  endpoints: " + ", ".join(f"{k} {v}%" for k, v in list(p["by_endpoint_pct"].items())[:8]))


def baseline_tree(ref: str) -> Path:
    """A detached git worktree of `ref` under the temp dir (removed by remove_tree), whose coordinator the bench runs
    with this venv, side by side with the working tree's."""
    path = Path(tempfile.mkdtemp(prefix="prime-load-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, check=True,
                   capture_output=True, text=True)
    got = subprocess.run([sys.executable, "-c", "import node; print(node.__file__)"], cwd=path,
                         env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True, check=True)
    if not Path(got.stdout.strip()).resolve().is_relative_to(path.resolve()):
        raise RuntimeError(f"the baseline's python imports node from {got.stdout.strip()}, not from {path}")
    return path


def remove_tree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def start_coordinator(args, work: Path, n: int, tree: Path = REPO, trainer: str = "train",
                      layout: str = "one-process") -> tuple[subprocess.Popen, str]:
    """`tree`: the source tree whose coordinator runs (a git worktree of --baseline, or this one), with this venv."""
    ready = work / "ready.json"
    cmd = [sys.executable, "-m", "node.cli", "coordinator", "--config", str(tree / "configs/local.toml"),
           *[f"--set={o}" for o in coordinator_overrides(args, work / "coord", n, trainer, layout)],
           "--ready-file", str(ready)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    if args.gc_log:  # bench/gc_probe/sitecustomize.py logs each garbage-collector pass over 2 ms to the work dir
        env["PYTHONPATH"] += os.pathsep + str(REPO / "bench" / "gc_probe")
        env["BENCH_GC_LOG_DIR"] = str(work)
    if args.asyncio_debug:  # asyncio logs each callback that holds the loop over 100 ms (with its source)
        env["PYTHONASYNCIODEBUG"] = "1"
    proc = subprocess.Popen(cmd, cwd=tree, env=env,
                            stdout=open(work / "coord.log", "w"), stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError("coordinator exited:\n" + (work / "coord.log").read_text()[-3000:])
        if time.monotonic() - t0 > 300:
            proc.kill()
            raise RuntimeError("coordinator did not start in 300 s")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def expected(endpoint: str, status: int, code: str) -> bool:
    """2xx (204 included), 429 and 409 stale_policy are answers an honest node must expect. Anything else
    is an error, 409 expired included: the coordinator answered so late that the node's work was lost."""
    if 200 <= status < 300 or status == 429:
        return True
    return status == 409 and code == "stale_policy"


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (the engine process of server.engine_process), from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += proc_cpu_s(p)
        except OSError:  # ended
            pass
    return total


def gc_summary(path: Path, w0: float, w1: float) -> dict:
    """--gc-log: the API process's garbage-collector passes over 2 ms that ended inside the window (each holds the
    GIL throughout: no request is served meanwhile), by generation, and by the second of the window they ended in."""
    passes = []
    if path.exists():
        for line in path.read_text().splitlines():
            t, gen, ms, _thread = line.split(" ", 3)
            if w0 <= float(t) < w1:
                passes.append((float(t), gen, float(ms)))
    by_gen: dict[str, dict] = {}
    for _, gen, ms in passes:
        g = by_gen.setdefault(gen, {"passes": 0, "total_ms": 0.0, "max_ms": 0.0})
        g["passes"] += 1
        g["total_ms"] = round(g["total_ms"] + ms, 1)
        g["max_ms"] = max(g["max_ms"], ms)
    return {"passes_over_2ms": len(passes), "total_ms": round(sum(p[2] for p in passes), 1),
            "max_ms": max((p[2] for p in passes), default=0.0), "by_generation": by_gen,
            "over_50ms_by_second": dict(Counter(int(t - w0) for t, _, ms in passes if ms > 50))}


def run_one(n: int, args, tree: Path = REPO, trainer: str = "train", label: str = "current",
            layout: str = "one-process", idle_mode: str = "drawn") -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix=f"prime-load-{n}-", dir=args.tmp_root))
    proc, base = start_coordinator(args, work, n, tree, trainer, layout)
    model = json.loads((work / "coord" / "model" / "config.json").read_text())
    pid = proc.pid
    try:
        for attempt in range(5):  # the run id, as a worker learns it
            try:
                status = get(base + "/v1/status")
                run_id = status["run_id"]
                # as the worker's client: a submission goes zstd-compressed where the coordinator takes it
                compress = "zstd" in status.get("body_encodings", [])
                break
            except OSError as e:
                print(f"  GET /v1/status failed ({e}); retrying", flush=True)
                time.sleep(2)
        else:
            raise RuntimeError("GET /v1/status keeps failing:\n" + (work / "coord.log").read_text()[-3000:])
        procs = min(args.procs, n)
        t_ready = time.time()
        ramp, warmup, seconds = args.heartbeat, args.warmup, args.seconds
        conns, children = [], []
        ctx = mp.get_context("spawn")
        for p in range(procs):
            cargs = {"base": base, "run_id": run_id, "compress": compress, "seed": 1000 * p + n,
                     "indices": list(range(p, n, procs)),
                     "heartbeat": args.heartbeat, "gen": args.gen, "idle": args.idle, "ramp": ramp,
                     "idle_mode": idle_mode,
                     "max_tokens": args.max_tokens, "pool": args.pool, "vocab": int(model["vocab_size"]),
                     "eos": int(model["eos_token_id"]), "hidden": int(model["hidden_size"]),
                     "checkpoint_poll": args.checkpoint_poll, "end_at": 0.0}
            children.append((cargs, *ctx.Pipe()))
        live = []
        for cargs, parent, child in children:
            pr = ctx.Process(target=client_process, args=(cargs, child), daemon=True)
            pr.start()
            live.append(pr)
            conns.append(parent)
        for c in conns:  # every client has imported its modules and built its rollouts
            assert c.recv() == "ready"
        t0 = time.time() + 1.0
        w0, w1 = t0 + ramp + warmup, t0 + ramp + warmup + seconds
        for c in conns:
            c.send((t0, w1))
        print(f"N={n}: coordinator pid {pid} at {base}; {procs} client processes, joins over {ramp:.0f} s, warm-up {warmup:.0f} s, "
              f"measuring {seconds:.0f} s…", flush=True)
        time.sleep(max(0.0, w0 - time.time()))
        # --py-spy-seconds: only the window's first seconds (where the first batches' intake lands)
        spy_s = w1 - time.time() if not args.py_spy_seconds else min(args.py_spy_seconds, w1 - time.time())
        spy = start_py_spy(args, pid, spy_s, work / "profile.txt")
        engine = child_pids(pid)  # the engine process (and a trainer's other ranks, if any): empty in one process
        cpu_a, loop_a, busy_a, wall_a = proc_cpu_s(pid), proc_cpu_s(pid, pid), machine_busy_s(), time.time()
        engine_a = tree_cpu_s(engine)
        rss_peak, probe, next_probe = 0, DiskProbe(work / "probe.sqlite"), 0.0
        while time.time() < w1:
            rss_peak = max(rss_peak, proc_mem_kib(pid)["VmRSS"])
            if time.time() >= next_probe:
                probe.commit()
                next_probe = time.time() + 1.0
            time.sleep(0.25)
        cpu_b, loop_b, busy_b, wall_b = proc_cpu_s(pid), proc_cpu_s(pid, pid), machine_busy_s(), time.time()
        engine_b = tree_cpu_s(engine)
        mem = proc_mem_kib(pid)
        profile = finish_py_spy(spy, work / "profile.txt", args, f"{label}_{trainer}_{args.shape_name}_{n}")
        results = [c.recv() for c in conns]
        for pr in live:
            pr.join(30)
        status = get(base + "/v1/status")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_text = (work / "coord.log").read_text()
        # (w1 is unset when the run failed before its window: the exception goes on, nothing to summarise)
        gc_passes = gc_summary(work / f"gc_{pid}.log", w0, w1) if args.gc_log and "w1" in locals() else None
        log_tail = log_text[-4000:]
        # asyncio debug: "Executing <Handle ...> took 0.512 seconds" for each callback that blocked the loop
        stalls = [ln for ln in log_text.splitlines() if re.search(r"Executing .* took [0-9.]+ seconds", ln)]
        if args.keep_work:
            print(f"  kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = summarise(n, args, results, status, w0, w1, t0, dict(
        cpu=cpu_b - cpu_a, loop_cpu=loop_b - loop_a, engine_cpu=engine_b - engine_a, wall=wall_b - wall_a, disk_commit_ms=probe.summary(), machine_busy=busy_b - busy_a, rss_peak_kib=rss_peak,
        hwm_kib=mem["VmHWM"], log_errors=[ln for ln in log_tail.splitlines() if " ERROR " in ln][-5:]))
    for r in rows:
        r["code"], r["trainer"], r["layout"], r["idle_mode"] = label, trainer, layout, idle_mode
    if profile is not None:
        rows[-1]["profile"] = profile
    if gc_passes is not None:
        rows[-1]["gc_in_window"] = gc_passes
    if args.asyncio_debug:
        took = sorted((float(re.search(r"took ([0-9.]+) seconds", ln)[1]) for ln in stalls), reverse=True)
        rows[-1]["loop_stalls_over_100ms"] = {"count_whole_run": len(took), "longest_s": took[:10],
                                              "examples": [ln[-400:] for ln in stalls[:8]]}
    return rows


def summarise(n, args, results, status, w0, w1, t0, coord) -> list[dict]:
    rows_all = [r for res in results for r in res["rows"]]
    seconds = w1 - w0
    by_ep: dict[str, list] = defaultdict(list)
    for ep, st, code, lat, wall, size in rows_all:
        if ep in BEFORE_WINDOW or w0 <= wall < w1:  # joins all happen before the window
            by_ep[ep].append((st, code, lat, size))
    out = []
    window_all = []
    errors_total = limited_total = 0
    for ep in ENDPOINTS:
        rs = by_ep.get(ep, [])
        if not rs:
            continue
        lats = sorted(r[2] * 1000 for r in rs)
        statuses = Counter(f"{st}" + (f" {code}" if code else "") for st, code, _, _ in rs)
        errors = sum(1 for st, code, _, _ in rs if not expected(ep, st, code))
        limited = sum(1 for st, _, _, _ in rs if st == 429)
        span = (max(r[4] for r in rows_all if r[0] == ep) - t0 if ep in BEFORE_WINDOW else seconds) or 1.0
        row = {"nodes": n, "endpoint": ep, "requests": len(rs), "requests_per_s": round(len(rs) / span, 2),
               "p50_ms": round(pct(lats, 0.50), 1), "p99_ms": round(pct(lats, 0.99), 1), "max_ms": round(lats[-1], 1),
               "errors": errors, "rate_limited_429": limited, "statuses": dict(statuses),
               "mean_body_bytes": int(sum(r[3] for r in rs) / len(rs))}
        if ep in BEFORE_WINDOW:
            row["note"] = BEFORE_WINDOW[ep]
        else:
            window_all.extend(lats)
            errors_total += errors
            limited_total += limited
        out.append(row)
    # When the slow answers (> the target) were asked, by second of the window: a few seconds with many of them is
    # a stall (the loop blocked, the CPU taken), slow answers spread evenly is a queue
    slow_by_s = Counter(int(wall - w0) for ep, st, code, lat, wall, size in rows_all
                        if ep not in BEFORE_WINDOW and w0 <= wall < w1 and lat * 1000 > TARGET_P99_MS)
    window_all.sort()
    lags = sorted(lag * 1000 for res in results for (t, lag) in res["lags"] if w0 <= t < w1)
    client_cpu = sum(res["cpu_s"] for res in results)
    total_window = (w1 - t0)  # clients ran from t0 to w1
    rejected = Counter()
    for res in results:
        rejected.update(res["rejected"])
    p99_by_ep = {r["endpoint"]: r["p99_ms"] for r in out if r["endpoint"] not in BEFORE_WINDOW}
    summary = {
        "nodes": n, "endpoint": "summary", "seconds": round(seconds, 1), "window_start_unix": round(w0, 3), "requests": len(window_all),
        "requests_per_s": round(len(window_all) / seconds, 1),
        "p50_ms": round(pct(window_all, 0.5), 1), "p99_ms": round(pct(window_all, 0.99), 1),
        "max_ms": round(window_all[-1], 1) if window_all else None,
        "errors": errors_total, "rate_limited_429": limited_total,
        "heartbeats_sent_of_due": f"{len(by_ep.get('/v1/heartbeat', []))} of {int(n * seconds / args.heartbeat)}",
        "coordinator_cpu_s": round(coord["cpu"], 2),
        "coordinator_cpu_ms_per_request": round(1000 * coord["cpu"] / max(1, len(window_all)), 3), "coordinator_cpu_cores": round(coord["cpu"] / coord["wall"], 3),
        # the event loop's thread alone (HTTP, signatures, validation, the ledger's reads and small writes): with
        # the trainer idle the process's CPU is the API's; training, it also holds the trainer thread's
        # server.engine_process: the engine's CPU (training, publishing), not in the API process's above
        "engine_cpu_s": round(coord["engine_cpu"], 2),
        "loop_cpu_s": round(coord["loop_cpu"], 2), "loop_cpu_cores": round(coord["loop_cpu"] / coord["wall"], 3),
        "loop_cpu_ms_per_request": round(1000 * coord["loop_cpu"] / max(1, len(window_all)), 3),
        "requests_per_cpu_s": round(len(window_all) / max(coord["cpu"], 1e-9), 1),
        "requests_per_node_per_s": round(len(window_all) / seconds / n, 4),
        "coordinator_peak_rss_mib": round(coord["rss_peak_kib"] / 1024, 1),
        "coordinator_vmhwm_mib": round(coord["hwm_kib"] / 1024, 1),
        "batch_prompts": batch_prompts(args, n), "group_size": args.group_size,
        "prompts_per_assignment": args.prompts_per_assignment, "max_tokens": args.max_tokens,
        "clients": len(results), "client_cpu_s_whole_run": round(client_cpu, 1),
        "client_cpu_cores_whole_run": round(client_cpu / total_window, 3),
        "client_loop_lag_p99_ms": round(pct(lags, 0.99), 1), "client_loop_lag_max_ms": round(lags[-1], 1) if lags else None,
        "machine_cpu_cores_busy": round(coord["machine_busy"] / coord["wall"], 3),
        "machine_cores": os.cpu_count(),
        "steps_trained_total": status["step"],
        "rollouts_accepted_total": sum(res["accepted"] for res in results),
        "rollouts_rejected_total": dict(rejected),
        "target": f"p99 < {TARGET_P99_MS:.0f} ms on every endpoint and 0 errors",
        "target_met": bool(errors_total == 0 and all(v < TARGET_P99_MS for v in p99_by_ep.values())),
        "disk_commit_ms_during_window": coord["disk_commit_ms"],
        "coordinator_log_errors": coord["log_errors"],
        "slow_requests_by_window_second": dict(sorted(slow_by_s.items())),
    }
    # other jobs on the machine: busy CPU that was neither the coordinator nor (roughly) the clients
    summary["other_cpu_cores_estimate"] = round(max(0.0, summary["machine_cpu_cores_busy"] - summary["coordinator_cpu_cores"]
                                                    - coord["engine_cpu"] / coord["wall"]
                                                    - summary["client_cpu_cores_whole_run"]), 2)
    out.append(summary)
    return out


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'shape':<12} {'N':>5} {'endpoint':<16} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>7} {'429':>6}")
    for r in rows:
        if r["endpoint"] == "summary":
            print(f"{'':<19}[{r.get('code', 'current')}, {r.get('layout', 'one-process')}, idle {r.get('idle_mode', 'drawn')}, trainer "
                  f"{r.get('trainer', 'train')}, engine {r.get('engine_cpu_s', 0.0):.1f} CPU s] loop thread "
                  f"{r['loop_cpu_cores']:.2f} cores, {r['loop_cpu_ms_per_request']:.3f} ms/request; process "
                  f"{r['coordinator_cpu_ms_per_request']:.3f} ms/request = {r['requests_per_cpu_s']:.0f} requests per "
                  f"CPU-second; {r['requests_per_node_per_s']:.3f} requests/s per node")
            print(f"{r.get('shape', ''):<12} {r['nodes']:>5} {'all (window)':<16} {r['requests_per_s']:>8.1f} {r['p50_ms']:>8.1f} "
                  f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} {r['errors']:>7} {r['rate_limited_429']:>6}")
            print(f"{'':<19}coordinator: {r['coordinator_cpu_s']:.1f} CPU s in {r['seconds']:.0f} s "
                  f"({r['coordinator_cpu_cores']:.2f} cores), peak RSS {r['coordinator_peak_rss_mib']:.0f} MiB "
                  f"(VmHWM {r['coordinator_vmhwm_mib']:.0f} MiB); steps trained {r['steps_trained_total']}, "
                  f"rollouts accepted {r['rollouts_accepted_total']}; clients {r['client_cpu_cores_whole_run']:.2f} "
                  f"cores, loop lag p99 {r['client_loop_lag_p99_ms']:.0f} ms; other jobs ~{r['other_cpu_cores_estimate']:.2f} "
                  f"cores; heartbeats sent {r['heartbeats_sent_of_due']} due; one SQLite commit on this disk p50/p99 "
                  f"{r['disk_commit_ms_during_window']['p50']}/{r['disk_commit_ms_during_window']['p99']} ms; "
                  f"target met: {r['target_met']}")
            if r.get("profile") and "samples" in r["profile"]:
                print_profile(r["profile"])
        else:
            print(f"{r.get('shape', ''):<12} {r['nodes']:>5} {r['endpoint']:<16} {r['requests_per_s']:>8.2f} {r['p50_ms']:>8.1f} "
                  f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} {r['errors']:>7} {r['rate_limited_429']:>6}")


def print_comparison(rows: list[dict]) -> None:
    """Baseline and current side by side per (shape, trainer, N): CPU per request and latency, with ratios."""
    def key(r: dict) -> tuple:
        return r["shape"], r["trainer"], r["nodes"], r["endpoint"], r.get("layout", "one-process")
    base = {key(r): r for r in rows if r.get("code") == "baseline"}
    print(f"\n{'shape':<12} {'trainer':<7} {'N':>5} {'endpoint':<16} {'p50 base/now ms':>17} {'p99 base/now ms':>19} "
          f"{'p99 now/base':>12}")
    for r in rows:
        b = base.get(key(r))
        if r.get("code") != "current" or b is None:
            continue
        if r["endpoint"] == "summary":
            print(f"{r['shape']:<12} {r['trainer']:<7} {r['nodes']:>5} {'all (window)':<16} "
                  f"{b['p50_ms']:>8.1f}/{r['p50_ms']:<8.1f} {b['p99_ms']:>9.1f}/{r['p99_ms']:<9.1f} "
                  f"{r['p99_ms'] / max(b['p99_ms'], 1e-9):>12.2f}")
            print(f"{'':<27}CPU ms/request {b['coordinator_cpu_ms_per_request']:.3f} -> "
                  f"{r['coordinator_cpu_ms_per_request']:.3f} "
                  f"({r['coordinator_cpu_ms_per_request'] / max(b['coordinator_cpu_ms_per_request'], 1e-9):.2f}x); "
                  f"loop thread {b['loop_cpu_ms_per_request']:.3f} -> {r['loop_cpu_ms_per_request']:.3f} "
                  f"({r['loop_cpu_ms_per_request'] / max(b['loop_cpu_ms_per_request'], 1e-9):.2f}x); requests per "
                  f"CPU-second {b['requests_per_cpu_s']:.0f} -> {r['requests_per_cpu_s']:.0f}; "
                  f"req/s {b['requests_per_s']:.1f} -> {r['requests_per_s']:.1f}")
        else:
            print(f"{r['shape']:<12} {r['trainer']:<7} {r['nodes']:>5} {r['endpoint']:<16} "
                  f"{b['p50_ms']:>8.1f}/{r['p50_ms']:<8.1f} {b['p99_ms']:>9.1f}/{r['p99_ms']:<9.1f} "
                  f"{r['p99_ms'] / max(b['p99_ms'], 1e-9):>12.2f}")


def print_layouts(rows: list[dict]) -> None:
    """The working tree's coordinator in one process and with its engine process, side by side per (shape,
    trainer, N): latency by endpoint, with the ratio, and the API process's CPU per request."""
    def key(r: dict) -> tuple:
        return r["shape"], r["trainer"], r["nodes"], r["endpoint"]
    one = {key(r): r for r in rows if r.get("code") == "current" and r.get("layout") == "one-process"}
    print(f"\n{'shape':<12} {'trainer':<7} {'N':>5} {'endpoint':<16} {'p50 one/engine ms':>19} "
          f"{'p99 one/engine ms':>21} {'p99 engine/one':>14}")
    for r in rows:
        b = one.get(key(r))
        if r.get("code") != "current" or r.get("layout") != "engine-process" or b is None:
            continue
        name = "all (window)" if r["endpoint"] == "summary" else r["endpoint"]
        print(f"{r['shape']:<12} {r['trainer']:<7} {r['nodes']:>5} {name:<16} "
              f"{b['p50_ms']:>9.1f}/{r['p50_ms']:<9.1f} {b['p99_ms']:>10.1f}/{r['p99_ms']:<10.1f} "
              f"{r['p99_ms'] / max(b['p99_ms'], 1e-9):>14.2f}")
        if r["endpoint"] == "summary":
            print(f"{'':<27}API process CPU ms/request {b['coordinator_cpu_ms_per_request']:.3f} -> "
                  f"{r['coordinator_cpu_ms_per_request']:.3f}; engine {r['engine_cpu_s']:.1f} CPU s; req/s "
                  f"{b['requests_per_s']:.1f} -> {r['requests_per_s']:.1f}; steps {b['steps_trained_total']} -> "
                  f"{r['steps_trained_total']}")


def git_state() -> dict:
    """The commit measured, and the files other engineers had changed in the tree at the time."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": [ln[3:] for ln in git("status", "--porcelain").splitlines() if ln[3:].startswith(("node/", "protocol/", "verify/"))]}


def span(text: str) -> tuple[float, float]:
    a, _, b = text.partition("-")
    return float(a), float(b or a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="100,1000", help="comma-separated node counts (one run each)")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per N")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds between the last join and the window")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--heartbeat", type=float, default=10.0, help="heartbeat period per node (s)")
    ap.add_argument("--gen", type=span, default=(5.0, 20.0), help="generation time per assignment, drawn (s)")
    ap.add_argument("--idle", type=span, default=(1.0, 3.0), help="wait after a 204 before asking again, drawn (s)")
    ap.add_argument("--idle-mode", default="drawn",
                    help="comma-separated, each run at every point: 'drawn' (wait --idle after a 204) and/or 'paced' "
                         "(wait the 204's X-Prime-Retry-After-Ms, or until a new step, and heartbeat no more often "
                         "than the heartbeat answer's, as node/worker/node.py does)")
    ap.add_argument("--checkpoint-poll", type=float, default=0.0,
                    help="also GET /v1/checkpoints every S seconds per node (0: only after a 409 stale_policy)")
    ap.add_argument("--shape", default="gpu-example,local",
                    help=f"comma-separated run shapes, each run at every N: {', '.join(SHAPES)}")
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--prompts-per-assignment", type=int)
    ap.add_argument("--batch-prompts", help="prompts per training batch, or 'auto'")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--rate-limit", type=float, default=2.0, help="server.rate_limit_per_second (per node)")
    ap.add_argument("--rate-burst", type=int, default=20, help="server.rate_limit_burst (per node)")
    ap.add_argument("--pool", type=int, default=512, help="pre-built rollouts per client process")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more coordinator overrides")
    ap.add_argument("--out", default=str(OUT / "load.json"))
    ap.add_argument("--tmp-root", default=None,
                    help="where the coordinator's storage goes (default: the system temp dir; /dev/shm takes the "
                         "disk's fsync out of the picture)")
    ap.add_argument("--keep-work", action="store_true", help="keep the coordinator's storage and log")
    ap.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    ap.add_argument("--trainer", default="train",
                    help="comma-separated: 'train' (the run's batches: the CPU trainer steps in the coordinator "
                         "process) and/or 'idle' (a batch no run fills: the process's CPU is the API's)")
    ap.add_argument("--baseline", metavar="GIT_REF",
                    help="also run the coordinator of this commit (a git worktree in the temp dir, this venv) before "
                         "the working tree's at every point, and print the ratios")
    ap.add_argument("--layout", default="one-process",
                    help="comma-separated: 'one-process' and/or 'engine-process' (server.engine_process = true: "
                         "training in its own process); each is run at every point, the working tree's only")
    ap.add_argument("--baseline-layout", default="one-process",
                    help="comma-separated: the layouts the --baseline commit is run in (each also in --layout)")
    ap.add_argument("--py-spy", metavar="PATH", help="py-spy binary: profile the coordinator during each window "
                                                      "(bench/results/load_profile_*.txt and a summary in the JSON)")
    ap.add_argument("--asyncio-debug", action="store_true",
                    help="run the coordinator with PYTHONASYNCIODEBUG=1 and list the callbacks that held its event "
                         "loop over 100 ms (debug mode costs CPU: not for the CPU figures)")
    ap.add_argument("--py-spy-wall", action="store_true",
                    help="with --py-spy: sample wall time (every thread, idle included) instead of GIL-holding CPU")
    ap.add_argument("--py-spy-rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--gc-log", action="store_true",
                    help="log the API process's garbage-collector passes over 2 ms (bench/gc_probe) and summarise "
                         "those in the window")
    ap.add_argument("--py-spy-seconds", type=float, default=0.0,
                    help="with --py-spy: profile only the window's first this many seconds (0: all of it)")
    args = ap.parse_args()
    trainers = [x.strip() for x in args.trainer.split(",") if x.strip()]
    if bad := [x for x in trainers if x not in ("train", "idle")]:
        ap.error(f"unknown --trainer {bad}")
    idle_modes = [x.strip() for x in args.idle_mode.split(",") if x.strip()]
    if bad := [x for x in idle_modes if x not in ("drawn", "paced")]:
        ap.error(f"unknown --idle-mode {bad}")
    layouts = [x.strip() for x in args.layout.split(",") if x.strip()]
    if bad := [x for x in layouts if x not in ("one-process", "engine-process")]:
        ap.error(f"unknown --layout {bad}")
    base_layouts = [x.strip() for x in args.baseline_layout.split(",") if x.strip()]
    if args.baseline and (bad := [x for x in base_layouts if x not in layouts]):
        ap.error(f"--baseline-layout {bad} not in --layout")
    shapes = [x.strip() for x in args.shape.split(",") if x.strip()]
    if unknown := [x for x in shapes if x not in SHAPES]:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    given = {k: getattr(args, k) for k in SHAPES["local"]}
    rows: list[dict] = []
    load0 = os.getloadavg()
    trees = [("current", REPO)]
    base_commit = None
    if args.baseline:
        base_tree = baseline_tree(args.baseline)
        base_commit = subprocess.run(["git", "rev-parse", args.baseline], cwd=REPO, capture_output=True,
                                     text=True, check=True).stdout.strip()
        trees.insert(0, ("baseline", base_tree))
    try:
        for shape in shapes:
            args.shape_name = shape
            for k, v in SHAPES[shape].items():
                setattr(args, k, v if given[k] is None else given[k])
            for trainer in trainers:
                for n in [int(x) for x in args.nodes.split(",") if x.strip()]:
                    for label, tree, layout, idle_mode in [(lb, t, la, im) for lb, t in trees for la in layouts
                                                           for im in idle_modes if lb == "current" or la in base_layouts]:
                        print(f"--- {label} ({tree}), {layout}, {shape}, trainer {trainer}, idle {idle_mode}", flush=True)
                        got = run_one(n, args, tree, trainer, label, layout, idle_mode)
                        for r in got:
                            r["shape"] = shape
                            r["storage"] = args.tmp_root or tempfile.gettempdir()
                        got[-1]["coordinator_overrides"] = coordinator_overrides(args, Path("TMP"), n, trainer, layout)
                        rows.extend(got)
                        print_table(got)
    finally:
        if args.baseline:
            remove_tree(base_tree)
    print_table(rows)
    if args.baseline:
        print_comparison(rows)
    if len(layouts) > 1:
        print_layouts(rows)
    doc = {"benchmark": "load", "rows": rows,
           "config": {"coordinator": "python -m node.cli coordinator --config configs/local.toml --set ... "
                                     "(each summary row lists its overrides)",
                      "heartbeat_s": args.heartbeat, "gen_s": args.gen, "idle_s": args.idle, "procs": args.procs,
                      "warmup_s": args.warmup, "checkpoint_poll_s": args.checkpoint_poll,
                      "storage_under": args.tmp_root or tempfile.gettempdir()},
           "code": git_state(), "baseline": {"ref": args.baseline, "commit": base_commit} if args.baseline else None,
           "machine": f"{os.cpu_count()} cores", "loadavg_before": [round(x, 2) for x in load0],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "note": args.note}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
