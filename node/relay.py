"""`prime-node relay --upstream URL`: mirror verified checkpoints and serve them over HTTP.

A relay is a fetcher without an inference engine: it pulls every published step from its upstream
(coordinator or another relay) with the worker's own fetcher, which verifies every shard against the
coordinator-signed manifest before storing it, and serves the same checkpoint routes as the
coordinator (node/checkpoint_routes.py), with Range support and an optional upload cap. Nodes find
relays in the join response (`distribution.relays`).

With `p2p.enabled` (and `p2p.relay_hop` not false) it also runs a libp2p host that is a circuit relay v2 hop
for NATed nodes, within the `p2p.relay_*` limits (docs/P2P.md "Relaying and hole punching"): the coordinator
lists it in `p2p.relay_addrs`, nodes bootstrap from it and NATed ones reserve a slot on it and announce
circuits through it. The hop only relays: it holds no shards, fetches nothing over p2p and publishes nothing.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from node.aio import client_session
from node.checkpoint_dir import CheckpointDir
from node.checkpoint_routes import CheckpointRoutes
from node.config import load_config
from node.fdlimits import listen_backlog
from node.http import ConnectionLimits, HardenedAppRunner, error_middleware
from node.lifecycle import run_async
from node.logs import setup_logging
from node.p2p.config import P2PConfig
from node.rate_limit import AsyncRateLimiter
from node.worker.client import MAX_RESPONSE_BYTES, Unreachable, read_limited
from node.worker.fetcher import Fetcher
from node.worker.sources import HttpSource
from protocol import messages as M
from protocol.identity import Identity, parse_public_key, public_key_arg

log = logging.getLogger("prime_node.relay")


class Relay:
    def __init__(self, upstream: str, root: Path, *, upstream_key: str | None = None, keep: int = 16,
                 upload_limit: int = 0, limits: ConnectionLimits | None = None, p2p: P2PConfig | None = None,
                 identity: Identity | None = None):
        self.upstream = upstream.rstrip("/")
        # Per client address, the serving fd share and a minimum send rate (node/http.py): a relay serves
        # strangers the same shards the coordinator does, so it is held to the same limits.
        self.limits = limits or ConnectionLimits()
        self.store = CheckpointDir(Path(root))
        self.key = upstream_key.lower() if upstream_key else None
        self.keep = keep
        self.bytes_served = 0
        self.routes = CheckpointRoutes(self.store, servable=self.store.steps, throttle=AsyncRateLimiter(upload_limit),
                                       on_bytes=self._count)
        self.stop_event = asyncio.Event()
        self.url: str | None = None
        self.fetcher: Fetcher | None = None
        # The circuit relay v2 hop (None: none), its identity (the peer id the coordinator's p2p.relay_addrs names:
        # keep the key file) and the addresses to list there, known once it runs.
        self.p2p_cfg = p2p if p2p is not None and p2p.enabled and p2p.relay_hop is not False else None
        if self.p2p_cfg is not None and identity is None:
            raise ValueError("a relay hop needs the relay's own identity")
        self.identity = identity
        self.run_id: str | None = None
        self.hop = None
        self.hop_addrs: list[str] = []

    def _count(self, n: int) -> None:
        self.bytes_served += n

    async def _learn_key(self, session: aiohttp.ClientSession) -> str:
        """The coordinator key checkpoints must be signed with (given, pinned, or pinned now on first sight); with
        a hop, also the run id (its gossip topic), from the upstream's status, which must name the same key."""
        pin = self.store.root / "upstream.pub"
        key = self.key or (pin.read_text().strip() if pin.is_file() else None)
        if key is not None and self.p2p_cfg is None:
            return key
        try:
            async with session.get(self.upstream + "/v1/status") as r:  # untrusted bytes: bounded, then the wire model
                body = await read_limited(r, MAX_RESPONSE_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise Unreachable(f"cannot reach {self.upstream}/v1/status: {e or type(e).__name__}") from None
        try:
            info = M.decode(M.RunInfo, body, limit=MAX_RESPONSE_BYTES)
        except M.WireError as e:
            raise Unreachable(f"{self.upstream}/v1/status is not a coordinator's status: {e}") from None
        if key is None:
            key = info.coordinator_key
            parse_public_key(key)
            pin.write_text(key + "\n")
            log.warning("pinned upstream coordinator key %s on first sight; pass --upstream-key to be strict", key)
        elif info.coordinator_key.lower() != key.lower():
            raise Unreachable(f"{self.upstream} runs {info.run_id!r} with coordinator key {info.coordinator_key}, "
                              f"not the pinned {key}")
        self.run_id = info.run_id
        return key

    async def _start_hop(self, key: str, host: str) -> None:
        """The libp2p host, a hop for everyone and nothing else: no shards to serve (no store, no HTTP plane), no
        NAT keeping (that starts only on a dial-back verdict, which a relay never gets), nothing published. It
        joins the run's gossip topic, as the coordinator's host does: nodes that bootstrap from it mesh with it."""
        from node.p2p import P2PNode

        assert self.p2p_cfg is not None  # run() starts a hop only when the relay has its settings
        hop = P2PNode(self.identity, self.p2p_cfg.model_copy(update={"http": False, "relay_hop": True}),
                      run_id=self.run_id, coordinator_key=key)
        try:
            await hop.start()
        except BaseException:
            await hop.stop()
            raise
        self.hop = hop
        addrs = list(hop.announce_addrs)
        if not addrs and not _is_wildcard(host):  # listening on all interfaces: where our HTTP side is reached
            addrs = hop.addrs_at(host)
        self.hop_addrs = addrs
        if addrs:
            log.info("relay hop %s (list it in the coordinator's p2p.relay_addrs)", " ".join(addrs))
        else:
            log.warning("relay hop listening on %s, but no address to list in the coordinator's p2p.relay_addrs: "
                        "set p2p.announce_addrs (or p2p.listen_host) to this machine's public address",
                        hop.listen_addrs)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        self.routes.add_to(app)

        async def status(request):
            # run_id and coordinator_key (the RunInfo a relay reads) let another relay with a hop mirror this one
            known = {"run_id": self.run_id, "coordinator_key": self.key} if self.run_id and self.key else {}
            # the hop's addresses and counters (reservations held, circuits relayed and refused) for its operator
            hop: dict[str, Any] = {"relay_hop": self.hop_addrs, "relay_hop_stats": await self.hop.relay_stats()} if (
                self.hop is not None and self.hop.running) else {}
            return web.json_response({"role": "relay", "upstream": self.upstream, "steps": self.store.steps(),
                                      "bytes_served": self.bytes_served, **hop, **known})

        app.router.add_get("/v1/status", status)
        return app

    async def run(self, host: str, port: int, on_ready=None) -> None:
        async with client_session() as session:
            key = self.key = await self._learn_key(session)
            self.fetcher = Fetcher(self.store, [HttpSource(self.upstream, "coordinator", session)], key,
                                   keep=self.keep, on_new_step=lambda step, path: log.info("mirrored step %d", step))
            # Idle keep-alive connections are dropped after 10 s (the coordinator's header_timeout_s), not
            # aiohttp's 75 s: a connection that says nothing should not keep its descriptor.
            runner = HardenedAppRunner(self.app(), access_log=None, keepalive_timeout=10.0, limits=self.limits)
            await runner.setup()
            site = web.TCPSite(runner, host, port, backlog=listen_backlog())
            await site.start()
            self.url = f"http://{host}:{runner.bound_port()}"
            try:
                if self.p2p_cfg is not None:
                    await self._start_hop(key, host)
                if on_ready:
                    on_ready(self.url)
                await self.fetcher.run(self.stop_event)
            finally:
                if self.hop is not None:
                    await self.hop.stop()
                await runner.cleanup()


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name: not an address to put in a multiaddr
        return True


def cmd_relay(args) -> int:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.server.log_format)
    upstream_key = public_key_arg("--upstream-key", args.upstream_key) if args.upstream_key else None
    identity = None
    if cfg.p2p.enabled and cfg.p2p.relay_hop is not False:  # the hop's peer id: stable across restarts
        key_path = Path(args.key) if args.key else Path(args.dir) / "relay.key"
        key_path.parent.mkdir(parents=True, exist_ok=True)
        identity, created = Identity.load_or_create(key_path)
        if created:
            print(f"created relay key {key_path} (node id {identity.node_id[:16]}…)", file=sys.stderr)
    relay = Relay(args.upstream, Path(args.dir), upstream_key=upstream_key, p2p=cfg.p2p, identity=identity)

    def ready(url: str) -> None:  # what scripts read (tests/integration/test_relay_hop.py)
        print(f"relay serving {url}", flush=True)
        for addr in relay.hop_addrs:
            print(f"relay hop {addr}", flush=True)

    async def main():
        await relay.run(args.host, args.port, on_ready=ready)

    return run_async("relay", main, relay.stop_event.set)
