"""INTELLECT-2's checkpoint distribution, shardcast (PyPI `shardcast`, pinned 0.3.2), as a mode of
bench/broadcast.py: its own origin server, one middle node (its relay) and N client nodes, each a process.

    pip install shardcast==0.3.2            # bench only; needs `wget` on PATH (its client shells out to it)

Three things are patched here, for the bench's rules, none in shardcast's transfer logic:
- its HTTP servers bind 0.0.0.0 on a fixed port (`shardcast.server.run_server`); here they bind 127.0.0.1
  on the port the bench picked (an ephemeral one);
- its origin has no upload cap; here the origin's file copies draw from one token bucket, the same cap
  (`--cap`) our origin gets, and count the bytes they send;
- every downloader first fetches a probe file `data1.bin` that an operator must place in each server's
  directory (its TODO) to a fixed path, /tmp/dummy.bin, which processes on one machine race for; here each
  server directory gets a 1 KiB probe and each process probes into its own temporary directory.
The file broadcast is the checkpoint's compressed shards, concatenated: the same bytes our nodes fetch.
Each client polls until shardcast's own checksum-checked reassembly succeeds; the bench checks the bytes.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_loopback() -> None:
    """shardcast's servers on 127.0.0.1 (it hard-codes 0.0.0.0)."""
    from shardcast import server

    def run_server(directory, port=0, shutdown_event=None):
        shutdown_event = shutdown_event or threading.Event()
        srv = server.ShardcastServer(("127.0.0.1", port), directory, shutdown_event)
        t = threading.Thread(target=server._server_thread, args=(srv, shutdown_event), daemon=True)
        t.start()
        return srv, t

    server.run_server = run_server


PROBE = b"\0" * 1024


def place_probe(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "data1.bin").write_bytes(PROBE)


def patch_probe() -> None:
    """Each process probes a server into its own temporary file (shardcast uses /tmp/dummy.bin for all)."""
    import tempfile

    from shardcast.client import ShardDownloader

    def init_server_metrics(self):
        with tempfile.TemporaryDirectory() as tmp:
            for server in self.servers:
                if not self._download_file(server, "data1.bin", Path(tmp) / "probe.bin"):
                    raise RuntimeError(f"shardcast probe of {server} failed")

    ShardDownloader._init_server_metrics = init_server_metrics


class Bucket:
    """The origin's upload cap, shared by every handler thread: node.rate_limit's TokenBucket, the one our
    coordinator's cap uses (same 50 ms burst); counts the bytes sent."""
    def __init__(self, rate: int):
        from node.rate_limit import TokenBucket

        self.bucket = TokenBucket(rate, now=time.monotonic()) if rate else None
        self.lock = threading.Lock()
        self.sent = 0

    def take(self, n: int) -> None:
        with self.lock:
            self.sent += n
            wait = self.bucket.reserve(n, time.monotonic()) if self.bucket else 0.0
        if wait:
            time.sleep(wait)


def patch_cap(bucket: Bucket) -> None:
    from shardcast.server import ShardcastRequestHandler

    def copyfile(self, source, outputfile):
        while chunk := source.read(64 * 1024):
            bucket.take(len(chunk))
            outputfile.write(chunk)

    ShardcastRequestHandler.copyfile = copyfile


class Origin:
    """shardcast's OriginServer in this process, capped; `broadcast(file)` publishes version v1."""
    def __init__(self, root: Path, cap: int):
        patch_loopback()
        self.bucket = Bucket(cap)
        patch_cap(self.bucket)
        from shardcast import OriginServer

        place_probe(root)
        self.port = free_port()
        self.server = OriginServer(str(root), self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def broadcast(self, path: Path, shard_size: int) -> str:
        return self.server.broadcast(str(path), shard_size)

    def close(self) -> None:
        # shardcast serves with a handle_request() loop in a daemon thread: socketserver's shutdown() would
        # wait forever for a serve_forever() that never ran
        self.server.shutdown_event.set()
        self.server.http_server.server_close()


# Each process imports shardcast, says "ready", and starts on "go" (stdin): the clock starts when all are
# ready, as for the bench's other modes.
def _ready_then_go() -> None:
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"


def middle_cmd(upstream: str, root: str, port: int) -> None:
    patch_loopback()
    patch_probe()
    from shardcast import MiddleNode

    place_probe(Path(root))
    _ready_then_go()
    node = MiddleNode([upstream], root, port, check_interval=1)
    sys.stdin.readline()  # "stop", or EOF when the bench ends
    node.shutdown_event.set()


def client_cmd(server: str, out: str, version: str, timeout: float) -> int:
    patch_probe()
    from shardcast import ClientNode

    _ready_then_go()
    deadline = time.monotonic() + timeout
    while True:  # the middle node starts with the clock too: probe it until it serves
        try:
            client = ClientNode([server], str(Path(out).parent / "downloads"))
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    while time.monotonic() < deadline:
        if client.download_version(version, out):
            print("done", flush=True)
            return 0
        time.sleep(0.1)
    return 1


async def spawn(*args: str, log: Path):
    import asyncio

    env = {**os.environ, "SHARDCAST_LOG_LEVEL": "ERROR", "SHARDCAST_FAST_RETRY_INTERVAL": "1",
           "SHARDCAST_SLOW_RETRY_INTERVAL": "1"}
    return await asyncio.create_subprocess_exec(sys.executable, __file__, *args, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=open(log, "w"), env=env)


async def shardcast_round(n: int, compressed_shards: list[Path], cap: int, work: Path) -> dict:
    """Origin (this process, capped) -> one middle node -> n clients; seconds until every client holds the
    file (checked byte for byte), origin bytes, the processes' CPU seconds."""
    import asyncio
    import resource

    work.mkdir(parents=True, exist_ok=True)
    blob = work / "checkpoint.bin"
    blob.write_bytes(b"".join(p.read_bytes() for p in compressed_shards))
    origin = Origin(work / "origin", cap)
    procs = []
    try:
        version = origin.broadcast(blob, shard_size=131072)
        middle_port = free_port()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs.append(await spawn("middle", "--upstream", origin.url, "--dir", str(work / "middle"),
                             "--port", str(middle_port), log=work / "middle.log"))
        for i in range(n):
            procs.append(await spawn("client", "--server", f"http://127.0.0.1:{middle_port}", "--version", version,
                                     "--out", str(work / f"c{i}" / "checkpoint.bin"), log=work / f"c{i}.log"))
        for p in procs:
            assert (await asyncio.wait_for(p.stdout.readline(), 120)).strip() == b"ready"
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        for i, p in enumerate(procs[1:]):
            if (await asyncio.wait_for(p.stdout.readline(), 600)).strip() != b"done":
                raise RuntimeError(f"shardcast client {i} failed:\n" + (work / f"c{i}.log").read_text()[-3000:])
        seconds = time.monotonic() - t0
        procs[0].stdin.write(b"stop\n")
        await procs[0].stdin.drain()
        await asyncio.gather(*(p.wait() for p in procs))
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        want = blob.read_bytes()
        for i in range(n):
            assert (work / f"c{i}" / "checkpoint.bin").read_bytes() == want, "a shardcast client got other bytes"
        return {"mode": "shardcast", "nodes": n, "seconds": round(seconds, 2),
                "node_cpu_seconds": round((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), 1),
                "bytes_from_origin": origin.bucket.sent, "bytes_from_relay": n * len(want), "bytes_from_peers": 0}
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        origin.close()


def main() -> int:
    ap = argparse.ArgumentParser(description="one shardcast process of bench/broadcast.py")
    sub = ap.add_subparsers(dest="role", required=True)
    m = sub.add_parser("middle")
    m.add_argument("--upstream", required=True)
    m.add_argument("--dir", required=True)
    m.add_argument("--port", type=int, required=True)
    c = sub.add_parser("client")
    c.add_argument("--server", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--version", default="v1")
    c.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    if a.role == "middle":
        middle_cmd(a.upstream, a.dir, a.port)
        return 0
    return client_cmd(a.server, a.out, a.version, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
