"""`prime-node relay --upstream URL`: mirror verified checkpoints and serve them over HTTP.

A relay is a fetcher without an inference engine: it pulls every published step from its upstream
(coordinator or another relay) with the worker's own fetcher, which verifies every shard against the
coordinator-signed manifest before storing it, and serves the same checkpoint routes as the
coordinator (node/checkpoint_routes.py), with Range support and an optional upload cap. Nodes find
relays in the join response (`distribution.relays`).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
from aiohttp import web

from node.aio import client_session
from node.checkpoint_dir import CheckpointDir
from node.checkpoint_routes import CheckpointRoutes
from node.fdlimits import listen_backlog
from node.http import ConnectionLimits, HardenedAppRunner, error_middleware
from node.lifecycle import run_async
from node.logs import setup_logging
from node.rate_limit import AsyncRateLimiter
from node.worker.fetcher import Fetcher
from node.worker.client import MAX_RESPONSE_BYTES, Unreachable, read_limited
from node.worker.sources import HttpSource
from protocol import messages as M
from protocol.identity import parse_public_key, public_key_arg

log = logging.getLogger("prime_node.relay")


class Relay:
    def __init__(self, upstream: str, root: Path, *, upstream_key: str | None = None, keep: int = 16,
                 upload_limit: int = 0, limits: ConnectionLimits | None = None):
        self.upstream = upstream.rstrip("/")
        # Per client address, the serving fd share and a minimum send rate (node/http.py): a relay serves
        # strangers the same shards the coordinator does, so it is held to the same limits.
        self.limits = limits or ConnectionLimits()
        self.store = CheckpointDir(Path(root))
        self.key = upstream_key.lower() if upstream_key else None
        self.keep = keep
        self.bytes_served = 0
        self.routes = CheckpointRoutes(self.store, servable=self.store.held_steps, throttle=AsyncRateLimiter(upload_limit),
                                       on_bytes=self._count)
        self.stop_event = asyncio.Event()
        self.url: str | None = None
        self.fetcher: Fetcher | None = None

    def _count(self, n: int) -> None:
        self.bytes_served += n

    async def _learn_key(self, session: aiohttp.ClientSession) -> str:
        pin = self.store.root / "upstream.pub"
        if self.key:
            return self.key
        if pin.is_file():
            return pin.read_text().strip()
        async with session.get(self.upstream + "/v1/status") as r:  # untrusted bytes: bounded, then the wire model
            body = await read_limited(r, MAX_RESPONSE_BYTES)
        try:
            key = M.decode(M.RunInfo, body, limit=MAX_RESPONSE_BYTES).coordinator_key
        except M.WireError as e:
            raise Unreachable(f"{self.upstream}/v1/status is not a coordinator's status: {e}") from None
        parse_public_key(key)
        pin.write_text(key + "\n")
        log.warning("pinned upstream coordinator key %s on first sight; pass --upstream-key to be strict", key)
        return key

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        self.routes.add_to(app)

        async def status(request):
            return web.json_response({"role": "relay", "upstream": self.upstream, "steps": self.store.held_steps(),
                                      "bytes_served": self.bytes_served})

        app.router.add_get("/v1/status", status)
        return app

    async def run(self, host: str, port: int, on_ready=None) -> None:
        async with client_session() as session:
            key = await self._learn_key(session)
            self.fetcher = Fetcher(self.store, [HttpSource(self.upstream, "coordinator", session)], key,
                                   keep=self.keep, on_new_step=lambda step, path: log.info("mirrored step %d", step))
            # Idle keep-alive connections are dropped after 10 s (the coordinator's header_timeout_s), not
            # aiohttp's 75 s: a connection that says nothing should not keep its descriptor.
            runner = HardenedAppRunner(self.app(), access_log=None, keepalive_timeout=10.0, limits=self.limits)
            await runner.setup()
            site = web.TCPSite(runner, host, port, backlog=listen_backlog())
            await site.start()
            self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
            if on_ready:
                on_ready(self.url)
            try:
                await self.fetcher.run(self.stop_event)
            finally:
                await runner.cleanup()


def cmd_relay(args) -> int:
    setup_logging("plain")
    upstream_key = public_key_arg("--upstream-key", args.upstream_key) if args.upstream_key else None
    relay = Relay(args.upstream, Path(args.dir), upstream_key=upstream_key)

    async def main():
        await relay.run(args.host, args.port, on_ready=lambda url: print(f"relay serving {url}", flush=True))

    return run_async("relay", main, relay.stop_event.set)
