"""The one patch of aiohttp (node/http.py, harden_aiohttp_server): it is applied by HardenedAppRunner.setup and
nowhere else, importing node.http touches nothing of aiohttp's, and it still takes effect on the aiohttp in use
(a real server on 127.0.0.1: the connection over the per-address limit and a request the parser refuses get
the JSON answers only the swapped-in classes give)."""
import asyncio
import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from aiohttp import web

from node.fdlimits import FdBudget
from node.http import (AIOHTTP_PATCHED_VERSIONS, ConnectionLimits, HardenedAppRunner, _HardenedServer,
                       harden_aiohttp_server)
from node.peer_log import PeerEventLog

pytestmark = pytest.mark.timeout(60)


def test_importing_node_http_leaves_aiohttp_untouched():
    """A fresh interpreter: every attribute of aiohttp's Server, AppRunner and RequestHandler is still
    aiohttp's own after `import node.http` (the patch is per server object, at setup, never at import)."""
    code = (
        "from aiohttp import web, web_protocol, web_runner, web_server\n"
        "classes = (web.Server, web.AppRunner, web_runner.BaseRunner, web.RequestHandler)\n"
        "before = {(c, k): v for c in classes for k, v in vars(c).items()}\n"
        "import node.http\n"
        "after = {(c, k): v for c in classes for k, v in vars(c).items()}\n"
        "assert before == after, sorted(str(k) for k in set(before.items()) ^ set(after.items()))\n"
        "assert web.Server is web_server.Server and web.RequestHandler is web_protocol.RequestHandler\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_aiohttp_in_use_is_the_one_the_patch_was_written_for():
    assert metadata.version("aiohttp").startswith(AIOHTTP_PATCHED_VERSIONS + "."), \
        "aiohttp was upgraded: re-check harden_aiohttp_server's defect and these tests, then its target version"


async def _raw(port: int, data: bytes, timeout: float = 5.0) -> tuple[asyncio.StreamWriter, bytes]:
    """Open a connection, send `data`, and return what the server sent before closing or `timeout`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(65536), timeout)
    except TimeoutError:
        got = b""
    return writer, got


def _json_status(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), answer[:200]
    assert b"application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_the_patch_takes_effect_on_a_real_server():
    async def ok(request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/", ok)
    runner = HardenedAppRunner(app, access_log=None, limits=ConnectionLimits(max_per_address=1),
                               fd_budget=FdBudget(64))
    await runner.setup()
    try:
        assert type(runner.server) is _HardenedServer  # the swap happened in setup, before any site listens
        with pytest.raises(RuntimeError):
            runner.bound_port()  # no site yet
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.bound_port()  # the kernel's choice: the connections below reach the server on it
        # Over the per-address limit: 429 JSON before a request is read (stock aiohttp serves it).
        _, first = await asyncio.open_connection("127.0.0.1", port)
        try:
            second, answer = await _raw(port, b"")
            second.close()
            status, body = _json_status(answer)
            assert (status, body["error"]) == (429, "too_many_connections"), answer
        finally:
            first.close()
        # Wait until the first connection is accounted as gone, bounded.
        deadline = asyncio.get_running_loop().time() + 10
        while runner.connection_stats()["open"] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert runner.connection_stats()["open"] == 0, runner.connection_stats()
        # A request the HTTP parser refuses: JSON error (stock aiohttp answers text/plain).
        conn, answer = await _raw(port, b"NOT A REQUEST LINE\r\n\r\n")
        conn.close()
        status, body = _json_status(answer)
        assert (status, body["error"]) == (400, "malformed"), answer
        assert runner.connection_stats()["refused"] == {"too_many_connections": 1}
    finally:
        await runner.cleanup()


async def test_hardening_is_idempotent_and_refuses_what_it_was_not_written_for():
    app = web.Application()
    runner = HardenedAppRunner(app, access_log=None, fd_budget=FdBudget(64))
    await runner.setup()
    try:
        server = runner.server
        server.by_address["127.0.0.1"] = 1  # state a second call must not reset
        again = harden_aiohttp_server(server, peer_log=runner.peer_log, limits=ConnectionLimits(),
                                      fds=FdBudget(8))
        assert again is server and server.by_address == {"127.0.0.1": 1} and server.limits is runner.limits
    finally:
        await runner.cleanup()
    log = PeerEventLog(logging.getLogger("test"), "x")
    with pytest.raises(RuntimeError):
        harden_aiohttp_server(None, peer_log=log, limits=ConnectionLimits(), fds=FdBudget(8))

    class OtherServer(web.Server):
        pass

    other = OtherServer(lambda request: None)
    with pytest.raises(TypeError):
        harden_aiohttp_server(other, peer_log=log, limits=ConnectionLimits(), fds=FdBudget(8))
