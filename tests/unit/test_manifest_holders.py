"""The worker's side of "Holders named with the manifest" (docs/PROTOCOL.md, "Super-seeding"): what an HttpSource
keeps of the X-Prime-Shard-Holder values a server sends with a manifest. A real aiohttp server on 127.0.0.1 plays
the server; what it sends is hostile in part (malformed values, more values than the cap, a relay naming holders)."""
import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from node.http import SHARD_HOLDER_HEADER
from node.worker.sources import MAX_SHARD_HOLDERS, HttpSource

pytestmark = pytest.mark.timeout(60)

A, B = "a" * 64, "b" * 64


async def _serving(values: list[str], seen: list) -> TestServer:
    async def manifest(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        headers = [(SHARD_HOLDER_HEADER, v) for v in values]
        return web.Response(body=b"{}", content_type="application/json", headers=CIMultiDict(headers))

    app = web.Application()
    app.router.add_get("/v1/checkpoints/{step}/manifest", manifest)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_the_origin_names_holders_a_relay_does_not_and_malformed_values_are_dropped():
    good = [f"0 {A} /ip4/203.0.113.1/tcp/81/http", f"3 {B} /ip4/203.0.113.2/tcp/4001"]
    hostile = ["0 notanodeid /ip4/1.2.3.4/tcp/1/http", f"999999 {A} /ip4/1.2.3.4/tcp/1/http", f"1 {A} relative/path",
               f"1 {A} /ip4/203.0.113.1/tcp/81/http trailing", ""]
    seen: list = []
    server = await _serving(hostile[:2] + good + hostile[2:], seen)
    try:
        async with aiohttp.ClientSession() as session:
            origin = HttpSource(str(server.make_url("")), "coordinator", session, swarm=True,
                                signer=lambda method, path: {"X-Prime-Signature": f"signed {method} {path}"})
            relay = HttpSource(str(server.make_url("")), "relay", session)
            assert await origin.manifest(7) == b"{}"
            assert await relay.manifest(7) == b"{}"
        assert origin.first_holders(7) == [(0, A, "/ip4/203.0.113.1/tcp/81/http"), (3, B, "/ip4/203.0.113.2/tcp/4001")]
        assert origin.first_holders(7) == []  # taken once
        assert relay.first_holders(7) == []  # only the origin (a swarm source) names holders: a relay is not asked
        # the origin's request was a signed swarm request; the relay's carried neither
        assert seen[0]["X-Prime-Swarm"] == "1"
        assert seen[0]["X-Prime-Signature"] == "signed GET /v1/checkpoints/7/manifest"
        assert "X-Prime-Swarm" not in seen[1] and "X-Prime-Signature" not in seen[1]
    finally:
        await server.close()


async def test_at_most_the_cap_of_values_is_read_and_few_steps_are_kept():
    # (aiohttp's client refuses an answer of more than ~128 header lines outright: a SourceError, as any bad answer)
    values = [f"{i} {A} /ip4/203.0.113.1/tcp/81/http" for i in range(MAX_SHARD_HOLDERS + 40)]
    server = await _serving(values, [])
    try:
        async with aiohttp.ClientSession() as session:
            origin = HttpSource(str(server.make_url("")), "coordinator", session, swarm=True)
            for step in range(20):
                await origin.manifest(step)
        assert len(origin._first_holders) <= 8  # the newest steps' only: a fetcher that never takes them keeps 8
        assert len(origin.first_holders(19)) == MAX_SHARD_HOLDERS
    finally:
        await server.close()
