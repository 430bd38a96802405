"""The three checkpoint routes (docs/PROTOCOL.md, "HTTP API"), for every server that holds a `CheckpointDir`:
the coordinator and relays serve exactly the same paths, answers and errors.

    GET /v1/checkpoints                         the servable steps and their listing
    GET /v1/checkpoints/{step}/manifest         the signed manifest's bytes
    GET /v1/checkpoints/{step}/shards/{index}   compressed shard bytes (Range, HEAD, the shared upload cap)

A `ShardGate` (the coordinator's super-seeding) may refuse a shard request before any byte is sent, hears whether
the copy got out, and may add headers to a manifest (the first copies' holders).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, TypeVar

from aiohttp import web

from node.checkpoint_dir import CheckpointDir
from node.http import ApiError, file_response, int_param
from node.rate_limit import AsyncRateLimiter


Ticket = TypeVar("Ticket")  # whatever a gate's `before` hands its own `after`


class ShardGate(Protocol[Ticket]):
    async def before(self, request: web.Request, step: int, index: int) -> Ticket:
        """Raise ApiError to refuse; return a ticket for `after`. May wait (the seeding gate holds a deferred
        request while the first copy is in flight)."""

    def after(self, ticket: Ticket, sent: bool) -> None:
        """The copy was sent whole (True) or not (False)."""

    def manifest_headers(self, request: web.Request, step: int) -> Mapping[str, str] | None:
        """Headers to add to the manifest of `step` (the seeding gate names first holders), or None."""


class CheckpointRoutes:
    def __init__(self, store: CheckpointDir, *, servable: Callable[[], list[int]], throttle: AsyncRateLimiter,
                 on_bytes: Callable[[int], None] = lambda n: None, gate: ShardGate[Any] | None = None):
        self.store = store
        self.servable = servable  # steps this server may hand out (the coordinator: committed to its ledger)
        self.throttle = throttle
        self.on_bytes = on_bytes
        self.gate = gate

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/checkpoints", self.checkpoints)
        app.router.add_get("/v1/checkpoints/{step}/manifest", self.manifest)
        app.router.add_get("/v1/checkpoints/{step}/shards/{index}", self.shard)

    def _servable_step(self, request: web.Request) -> int:
        step = int_param(request, "step")
        if step not in self.servable():
            raise ApiError(404, "not_found", f"no checkpoint for step {step} here")
        return step

    async def checkpoints(self, request: web.Request) -> web.Response:
        steps = self.servable()
        return web.json_response({"steps": steps, "newest": steps[-1] if steps else None,
                                  "checkpoints": self.store.listing(steps)})

    async def manifest(self, request: web.Request) -> web.Response:
        step = self._servable_step(request)
        data = self.store.manifest_bytes(step)
        if data is None:
            raise ApiError(404, "not_found", "no such manifest")
        headers = self.gate.manifest_headers(request, step) if self.gate is not None else None
        return web.Response(body=data, content_type="application/json", headers=headers)

    async def shard(self, request: web.Request) -> web.StreamResponse:
        step = self._servable_step(request)
        index = int_param(request, "index", 100_000)
        ticket = await self.gate.before(request, step, index) if self.gate is not None else None
        try:
            resp = await file_response(request, self.store.shard_path(step, index), self.throttle, self.on_bytes)
        except BaseException:
            if self.gate is not None:
                self.gate.after(ticket, sent=False)
            raise
        if self.gate is not None:
            self.gate.after(ticket, sent=True)
        return resp
