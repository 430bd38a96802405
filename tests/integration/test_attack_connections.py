"""Attacks on connections rather than requests (issue 25, findings 4, 5 and 9), against real servers on
127.0.0.1 with real sockets: downloads that are never read, request bodies that never finish, many
connections from one address, and the node HTTP shard server's slots held by one address.

Attack sockets are plain `socket`s with a 4 KiB receive buffer, so a response the attacker never reads
fills its buffers after a few KiB; whether the server cut it is read from the attacker's own TCP state (an
aborted connection is reset). Addresses 127.0.0.2-127.0.0.9 are loopback too (Linux routes all of
127/8 there): they stand for other clients."""
import asyncio
import json
import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.coordinator_harness import REPO, RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(240)

TCP_ESTABLISHED = 1
# Shards of several MB: more than the kernel takes into a never-reader's socket buffers (on loopback its
# send buffer grows to a few MB), so the server itself is left waiting.
BIG_SHARDS = ("model.tiny_hidden_size=512", "distribution.shard_size=8388608")


def attacker_socket(local_ip: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    s.bind((local_ip, 0))
    s.setblocking(False)
    return s


async def open_raw(port: int, request: bytes, local_ip: str = "127.0.0.1") -> socket.socket:
    """A connection that sends `request` and then never reads."""
    loop = asyncio.get_running_loop()
    s = attacker_socket(local_ip)
    await loop.sock_connect(s, ("127.0.0.1", port))
    if request:
        await loop.sock_sendall(s, request)
    return s


def still_connected(s: socket.socket) -> bool:
    """From the attacker's side: the server has neither reset nor closed this connection (tcp_info's
    first byte is the TCP state; an aborted connection is reset, a closed one is in CLOSE_WAIT)."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_ESTABLISHED


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def read_head(s: socket.socket, timeout: float) -> bytes:
    """The status line and headers the server sent on `s`, or b"" if nothing came within `timeout`."""
    loop = asyncio.get_running_loop()
    buf = b""
    end = time.monotonic() + timeout
    while b"\r\n\r\n" not in buf and time.monotonic() < end:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(s, 4096), max(0.01, end - time.monotonic()))
        except (TimeoutError, ConnectionError):
            break
        if not chunk:
            break
        buf += chunk
    return buf


def status_of(head: bytes) -> int | None:
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None


def close_all(socks) -> None:
    for s in socks:
        s.close()


async def shard_path(base: str) -> tuple[str, int]:
    """The largest shard the coordinator serves now, and its size."""
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/checkpoints/0/manifest") as r:
            manifest = json.loads(await r.read())
    shards = manifest["shards"]
    i = max(range(len(shards)), key=lambda j: shards[j]["zsize"])
    return f"/v1/checkpoints/0/shards/{i}", shards[i]["zsize"]


# -- finding 4: downloads that are never read --------------------------------------------------------------
async def test_slow_readers_of_shards_are_cut_and_honest_download_proceeds(tmp_path):
    """50 clients ask for a shard and never read: each is cut within the send-rate deadline (here 1 s of grace
    at 64 KiB/s), while an honest client downloads the same shard whole. Today they hold their socket and
    the shard's open file for ever."""
    async with running_coordinator(tmp_path, *BIG_SHARDS, "server.send_grace_s=1", "server.min_send_rate=65536",
                                   "server.max_connections_per_address=4096", "server.header_timeout_s=120") as (coord, base):
        port = int(base.rsplit(":", 1)[1])
        path, size = await shard_path(base)
        assert size > 6 << 20, size  # larger than what the attackers' buffers take
        attackers = [await open_raw(port, get(path)) for _ in range(50)]
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(base + path) as r:
                    body = await r.read()
            assert r.status == 200 and len(body) == size
            deadline = time.monotonic() + 20  # grace 1 s + what their buffers took at 64 KiB/s, with slack
            while any(map(still_connected, attackers)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            held = sum(map(still_connected, attackers))
            assert held == 0, f"{held} of 50 never-readers still hold a download after 20 s"
        finally:
            close_all(attackers)


# -- finding 4: never-readers and the open-file limit ------------------------------------------------------
SUBPROCESS_COORDINATOR = textwrap.dedent('''
    import asyncio, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))  # a small hard limit: the attack needs fewer sockets
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from tests.integration.coordinator_harness import test_config
    from node.coordinator.app import start_server
    from node.coordinator.service import Coordinator
    from protocol.identity import Identity

    async def main():
        coord = Coordinator(test_config(Path(sys.argv[2]), *sys.argv[3:]), Identity.generate())
        runner, port = await start_server(coord, "127.0.0.1", 0)
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
        await runner.cleanup()
        await coord.stop()

    asyncio.run(main())
''')


async def test_never_readers_cannot_exhaust_fds_and_publishing_still_works(tmp_path):
    """A coordinator under a 512 open-file limit; 450 clients ask for a shard and never read (no per-address
    limit here, and a long send grace: only the descriptor budget stands in their way). A node that joined
    before the attack submits a batch over its kept-alive connection, and the step is trained and published
    (a checkpoint's files written). Today the attackers take every descriptor: accept fails with EMFILE, and
    so does writing the checkpoint."""
    script = tmp_path / "coordinator.py"
    script.write_text(SUBPROCESS_COORDINATOR)
    overrides = [*BIG_SHARDS, "verification.fraction=0", "run.batch_prompts=2", "run.prompts_per_assignment=2",
                 "run.group_size=2", "run.max_steps=1", "server.max_connections_per_address=100000",
                 "server.send_grace_s=600", "server.header_timeout_s=300"]
    proc = subprocess.Popen([sys.executable, str(script), str(REPO), str(tmp_path), *overrides],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attackers: list[socket.socket] = []
    failure: BaseException | None = None
    try:
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120))
        base = f"http://127.0.0.1:{port}"
        path, _ = await shard_path(base)
        # One kept-alive connection for the honest node, opened before the attack.
        # (Each request bounded: today a request can hang on a server out of descriptors.)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=600),
                                         timeout=aiohttp.ClientTimeout(total=30)) as s:
            node = RawNode(base, s)
            st, spec = await node.post("/v1/join", {})
            assert st == 200, spec
            model_config = spec["model_config_json"]
            model_config = json.loads(model_config) if isinstance(model_config, str) else model_config
            st, w = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200, w
            rollouts = fake_rollouts(w, spec["eos_token_id"], model_config["vocab_size"], random.Random(0))
            for _ in range(450):
                try:
                    attackers.append(await open_raw(port, get(path)))
                except OSError:  # the server stopped accepting: that is the failure this test looks for
                    break
            await asyncio.sleep(1.0)  # let the server take them all
            st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 0,
                                                      "rollouts": rollouts})
            assert st == 200, res
            deadline = time.monotonic() + 90
            step = 0
            while step < 1 and time.monotonic() < deadline:
                async with s.get(base + "/v1/status") as r:
                    assert r.status == 200
                    step = (await r.json())["step"]
                await asyncio.sleep(0.5)
            assert step >= 1, "the step was not published under the attack"
    except (AssertionError, OSError, TimeoutError, aiohttp.ClientError) as e:
        failure = e
    finally:
        close_all(attackers)
        try:  # communicate() closes its stdin: the coordinator stops
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert failure is None, f"{failure!r}; the coordinator's log ends: {err[-3000:]}"
    assert "Too many open files" not in err, err[-3000:]


# -- finding 5: bodies read before anything is checked -----------------------------------------------------
def stalled_post(node: RawNode, path: str, declared: int, *, ts: int | None = None) -> bytes:
    """Signed-looking headers for a body of `declared` bytes (signed over an empty body: the signature is
    only checked once a body arrived, which it never does)."""
    h = node.headers("POST", path, b"", ts=ts)
    h["Content-Length"] = str(declared)
    lines = [f"POST {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in h.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_body_stallers_from_unknown_keys_are_refused_before_the_body(tmp_path):
    """60 connections from unknown keys (and one joined key with a stale timestamp) send the headers of a
    1 MiB submission and no body: each is answered at once (403 unknown_node / 401 clock_skew) without a
    byte of body being read. Today each waits for its body (up to max_body_bytes buffered per connection
    for body_timeout_s) before the key is looked at."""
    async with running_coordinator(tmp_path, "server.max_connections_per_address=4096") as (coord, base):
        port = int(base.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as s:
            known = RawNode(base, s)
            assert (await known.post("/v1/join", {}))[0] == 200
            strangers = [RawNode(base, s) for _ in range(60)]
            socks = [await open_raw(port, stalled_post(n, "/v1/submit", 1 << 20)) for n in strangers]
            socks.append(await open_raw(port, stalled_post(known, "/v1/submit", 1 << 20,
                                                           ts=int(time.time() * 1000) - 600_000)))
            try:
                heads = await asyncio.gather(*(read_head(x, 5.0) for x in socks))
            finally:
                close_all(socks)
        statuses = [status_of(h) for h in heads]
        assert statuses[:60] == [403] * 60, statuses
        assert b"unknown_node" in heads[0]
        assert statuses[60] == 401 and b"clock_skew" in heads[60], heads[60]


async def test_body_bytes_in_flight_are_capped(tmp_path):
    """Five joined keys each open 4 submissions of 1 MiB and send all but one byte of each; with 4 MiB of
    body allowed in flight (and one full body per key), at most 4 are being read and the other 16 get 503
    with Retry-After at once; a small request still gets through. Today every one of them is read into
    memory and left hanging until the body timeout."""
    async with running_coordinator(tmp_path, "server.max_connections_per_address=4096", "server.max_body_bytes=1048576",
                                   "server.max_body_bytes_in_flight=4194304") as (coord, base):
        port = int(base.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            nodes = [RawNode(base, s) for _ in range(5)]
            for node in nodes:
                assert (await node.post("/v1/join", {}))[0] == 200
            socks = []
            for i in range(20):
                x = await open_raw(port, stalled_post(nodes[i % 5], "/v1/submit", 1 << 20))
                socks.append(x)
                asyncio.ensure_future(loop.sock_sendall(x, b"{" + b" " * ((1 << 20) - 2)))  # one byte short
            try:
                heads = await asyncio.gather(*(read_head(x, 3.0) for x in socks))
                statuses = [status_of(h) for h in heads]
                busy = [h for h in heads if status_of(h) == 503]
                assert len(busy) >= 16, statuses
                assert all(b"Retry-After:" in h for h in busy)
                assert statuses.count(None) <= 4  # those being read: the body never completes
                st, _ = await node.post("/v1/heartbeat", {"policy_step": 0})
                assert st == 200
            finally:
                close_all(socks)


# -- connections per client address ----------------------------------------------------------------------
async def test_connections_per_address_are_capped(tmp_path):
    """With at most 8 connections per address, a 9th connection from the same address is answered 429 with
    Retry-After before it sends anything, while another address is served. Today every connection is
    accepted and held."""
    async with running_coordinator(tmp_path, "server.max_connections_per_address=8") as (coord, base):
        port = int(base.rsplit(":", 1)[1])
        idle = [await open_raw(port, b"", "127.0.0.3") for _ in range(8)]
        try:
            await asyncio.sleep(0.3)
            extra = await open_raw(port, b"", "127.0.0.3")
            head = await read_head(extra, 3.0)
            extra.close()
            assert status_of(head) == 429 and b"Retry-After:" in head and b"too_many_connections" in head, head
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.4", 0))
            async with aiohttp.ClientSession(connector=connector) as s:
                async with s.get(base + "/v1/status") as r:
                    assert r.status == 200
        finally:
            close_all(idle)


# -- finding 9: the node HTTP shard server's slots ----------------------------------------------------------
async def test_never_readers_from_one_address_do_not_lock_the_node_shard_server():
    """A node's HTTP shard server (8 transfer slots); 8 connections from one address ask for a 4 MiB shard and
    never read. An honest peer at another address still gets the shard whole. Today the 8 take every slot
    for ~10 s + 4 MiB / 32 KiB/s ≈ 2 min, and the honest peer is told "busy"."""
    from node.p2p.http_shards import HttpShardServer, fetch_shard_http
    from node.p2p.shard_store import CallableShardStore
    from node.p2p.stats import P2PStats

    data = os.urandom(4 << 20)
    server = HttpShardServer(CallableShardStore(lambda step, index: data if (step, index) == (1, 0) else None),
                             stats=P2PStats(), max_concurrent=8, max_bytes=8 << 20, read_timeout_s=10.0)
    port = await server.start("127.0.0.1", 0)
    manifest = "ab" * 32
    path = f"/v1/p2p/shards/1/0?manifest={manifest}"
    attackers = [await open_raw(port, get(path), "127.0.0.5") for _ in range(8)]
    try:
        await asyncio.sleep(0.5)
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.6", 0))
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as s:
            got = await fetch_shard_http(s, f"http://127.0.0.1:{port}", peer="honest", step=1, index=0,
                                         manifest_hash=manifest, max_bytes=8 << 20, stats=P2PStats(),
                                         read_timeout_s=10.0, connect_timeout_s=5.0)
        assert got == data
    finally:
        close_all(attackers)
        await server.stop()


# -- the send-rate floor itself (the libp2p shard server uses it per write) ------------------------------
def test_min_send_rate_cuts_a_trickle_that_passes_a_per_write_timeout_but_not_an_honest_reader():
    """The arithmetic of node.rate_limit.MinSendRate (no clock, no sleeps). A trickle that takes each 64 KiB
    write in 9 s (under the old 10 s per-write timeout: it could hold a libp2p slot for 32 MiB / 7 KiB/s,
    over an hour) runs out of credit within a minute at a 16 KiB/s floor; a reader at 20 Mbit/s never does."""
    from node.rate_limit import MinSendRate

    trickle, honest = MinSendRate(16 * 1024, 10.0), MinSendRate(16 * 1024, 10.0)
    chunk = 64 * 1024
    waited = 0.0
    while trickle.allowance(chunk) >= 9.0:  # each write would finish before its deadline
        trickle.spent(chunk, 9.0)
        waited += 9.0
    assert waited <= 60.0, waited
    for _ in range(10_000):  # 640 MB at 2.5 MB/s
        assert honest.allowance(chunk) >= chunk / 2.5e6
        honest.spent(chunk, chunk / 2.5e6)
    assert honest.credit == 10.0
