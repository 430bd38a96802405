"""The coordinator's aiohttp application: the routes of docs/PROTOCOL.md, "HTTP API", each a thin
translation to Coordinator."""
from __future__ import annotations

import asyncio
import importlib.resources
import json

from aiohttp import web
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from node.checkpoint_routes import CheckpointRoutes
from node.coordinator.openapi import build_openapi
from node.coordinator.refusals import Refused
from node.coordinator.seeding import SeedingGate
from node.fdlimits import listen_backlog
from node.http import (BODY_BUDGET, BODY_TIMEOUT, MAX_BODY_BYTES, RETRY_AFTER_MS_HEADER, ApiError, BodyBudget,
                       ConnectionLimits, HardenedAppRunner, error_middleware, read_signed)
from node.rate_limit import AsyncRateLimiter, KeyedRateLimit
from protocol import messages as M
from protocol.signing import RequestVerifier

# /v1/status and /metrics are built at most once per this many seconds, however many dashboards poll.
STATUS_MAX_AGE_S = 1.0
# Bodies parsed in a thread rather than on the loop. A 1.4 MB submission parses in ~5 ms, but under load its hop to a
# thread and back waited up to 270 ms (the default executor is shared with the intake's assessments, and the
# GIL with the loop): parsed on the loop it blocks the loop ~5 ms instead. 8 MiB (~30 ms) still goes to a thread.
LARGE_BODY_BYTES = 2 * 1024 * 1024
FAILED_RETRY_AFTER_S = 60  # a failed coordinator exits and is restarted, or an operator looks: not soon
# A request body's read buffer (aiohttp's `read_bufsize`, 64 KiB by default): aiohttp stops reading the socket once
# twice this is buffered and goes on only after the handler has taken it, so a 1.4 MB submission came in ~11 turns
# of a busy event loop, each waiting for the handler's task (up to 460 ms under load: docs/BENCHMARKS.md, "The
# intake's CPU cut"). Bodies are still bounded by server.max_body_bytes and the body budget.
READ_BUFSIZE = 512 * 1024


def parse_wire(model: type[BaseModel], body: bytes) -> BaseModel:
    """A request body as its wire model, parsed and validated in one pass by pydantic's JSON parser; 400 with the
    first problems otherwise (the same answers as node/http.py's parse_body).

    Not json.loads then model_validate: for a 1.2 MB submission that is ~27 ms, most of it json.loads' one C call
    holding the GIL while the event loop waits for it (the first seconds of bench/load.py's N = 1,000 window);
    this is ~5 ms, and ~3 µs instead of ~10 µs for a heartbeat. The same guarantees: every wire model says
    allow_inf_nan=False, so NaN and ±Infinity (which this parser reads, like json.loads) are refused at every float
    field (tests/unit/test_app_parse.py); nesting is bounded inside the parser (a validation error, never a
    RecursionError)."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise ApiError(400, "malformed", f"body is not valid JSON: {errors[0]['msg']}"[:300]) from None
        probs = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in errors[:3])
        raise ApiError(400, "malformed", f"invalid request: {probs}") from None


def _json(model_or_dict, status: int = 200) -> web.Response:
    if hasattr(model_or_dict, "model_dump_json"):
        return web.Response(text=model_or_dict.model_dump_json(), status=status, content_type="application/json")
    return web.json_response(model_or_dict, status=status)


def _json_or_204(answer) -> web.Response:
    """An answer, or 204 No Content when there is nothing (no work, no job) right now."""
    return web.Response(status=204) if answer is None else _json(answer)


# A domain refusal's HTTP status (node/coordinator/refusals.py says why each is what it is): the only place a
# code meets a status line. Complete for RefusalCode (tests/unit/test_refusals.py).
REFUSAL_STATUS: dict[str, int] = {
    "unknown_node": 403, "banned": 403, "not_a_verifier": 403, "not_your_assignment": 403,
    "not_allowlisted": 403, "token_required": 403, "bad_token": 403, "token_expired": 403, "token_used": 403,
    "pow_required": 403, "bad_pow": 403,
    "unknown_assignment": 404, "unknown_job": 404,
    "stale_policy": 409, "unpublished_policy": 409, "policy_went_back": 409, "duplicate": 409, "expired": 409,
    "declined": 409, "not_your_job": 409,
    "wrong_verdict_count": 400,
    "too_many_assignments": 429, "busy": 503,
}


@web.middleware
async def refusals_to_http(request: web.Request, handler):
    """A Refused from the domain, as the API's error (error_middleware, outside this one, writes the body)."""
    try:
        return await handler(request)
    except Refused as e:
        headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
        raise ApiError(REFUSAL_STATUS[e.code], e.code, e.detail, headers) from None


def build_app(coord) -> web.Application:
    cfg = coord.cfg.server

    # prometheus_client's labels() builds and locks per call (~2 % of the loop at 1,000 nodes, bench/load.py
    # --py-spy): the child counter of each (route, status) is kept. Bounded: routes are ours, statuses few.
    counters: dict[tuple[str, int], Counter] = {}

    @web.middleware
    async def count_requests(request, handler):
        resp = await handler(request)
        resource = request.match_info.route.resource
        key = (resource.canonical if resource else "other", resp.status)
        child = counters.get(key)
        if child is None:
            child = counters[key] = coord.metrics.requests.labels(key[0], str(key[1]))
        child.inc()
        return resp

    @web.middleware
    async def refuse_when_failed(request, handler):
        """A coordinator whose training thread or a background task died (node/coordinator/supervisor.py)
        hands out no more work: every node and verifier request (the POSTs under /v1/) is answered 503 with
        the reason before its body is read; status, metrics, the dashboard and checkpoints stay readable."""
        failure = coord.failure
        if failure is not None and request.method == "POST" and request.path.startswith("/v1/"):
            raise ApiError(503, "coordinator_failed", f"the coordinator stopped handing out work: "
                                                      f"{failure.component} died ({failure.reason})",
                           {"Retry-After": str(FAILED_RETRY_AFTER_S)})
        return await handler(request)

    # count_requests is outermost so it also counts the JSON error responses.
    app = web.Application(middlewares=[count_requests, error_middleware, refusals_to_http, refuse_when_failed],
                          client_max_size=cfg.max_body_bytes)
    app[MAX_BODY_BYTES] = cfg.max_body_bytes
    app[BODY_TIMEOUT] = cfg.body_timeout_s
    # One full body per key at a time: a key with many stalled submissions holds no more than one.
    app[BODY_BUDGET] = BodyBudget(cfg.max_body_bytes_in_flight, per_key=cfg.max_body_bytes)
    verifier = RequestVerifier(coord.cfg.run.run_id)
    limiter = KeyedRateLimit(cfg.rate_limit_per_second, cfg.rate_limit_burst, max_keys=100_000)  # per node
    joins_per_minute = coord.cfg.admission.joins_per_address_per_minute
    join_limiter = KeyedRateLimit(joins_per_minute / 60.0, joins_per_minute, max_keys=100_000)  # per address
    throttle = AsyncRateLimiter(coord.cfg.distribution.origin_upload_limit)  # one cap for every upload

    def not_banned(key: str) -> None:  # /v1/join: a new key is welcome there, a banned one is not
        node = coord.ledger.node(key)
        if node is not None and node.banned:
            raise ApiError(403, "banned", "this node is banned after repeated failed verification")

    async def signed(request: web.Request, model, check_key=coord._known_node):
        """A signed request's signer and validated body; `check_key` refuses a key from the headers alone,
        before its body is read (default: a joined node that is not banned)."""
        signer, body = await read_signed(request, verifier, limiter, check_key)
        if len(body) > LARGE_BODY_BYTES:  # see LARGE_BODY_BYTES
            return signer, await asyncio.to_thread(parse_wire, model, body)
        return signer, parse_wire(model, body)

    async def join(request):
        if not join_limiter.allow(request.remote or "unknown"):
            raise ApiError(429, "too_many_joins", f"at most {joins_per_minute} joins per minute from one address")
        signer, req = await signed(request, M.JoinRequest, not_banned)
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        return _json(await coord.join(signer, req, remote=request.remote, local_ip=sock[0] if sock else None))

    async def heartbeat(request):
        signer, req = await signed(request, M.HeartbeatRequest)
        answer = _json(coord.heartbeat(signer, req))
        answer.headers[RETRY_AFTER_MS_HEADER] = str(coord.next_heartbeat_ms(signer))
        return answer

    async def work(request):
        signer, req = await signed(request, M.WorkRequest)
        answer = coord.work(signer, req)
        if isinstance(answer, M.NoWork):
            return web.Response(status=204, headers={RETRY_AFTER_MS_HEADER: str(answer.retry_after_ms)})
        return _json(answer)

    async def submit(request):
        signer, req = await signed(request, M.SubmitRequest)
        return _json(await coord.submit(signer, req))

    async def verify_jobs(request):
        signer, req = await signed(request, M.VerifyJobsRequest, coord._board)
        return _json_or_204(coord.verify_jobs(signer, req))

    async def verify_verdicts(request):
        signer, req = await signed(request, M.VerdictsRequest, coord._board)
        return _json(coord.verify_verdicts(signer, req))

    def count(n: int) -> None:
        coord.bytes_by_source["coordinator"] += n
        coord.metrics.bytes_served.inc(n)

    gate = SeedingGate(coord.seeder, verifier, lambda node_id: (n := coord.ledger.node(node_id)) is not None
                       and not n.banned, allow_private_addrs=coord.cfg.p2p.allow_private_addrs,
                       verified=coord.dialback.http_addr_verified)
    CheckpointRoutes(coord.checkpoints, servable=coord.servable_steps, throttle=throttle, on_bytes=count,
                     gate=gate).add_to(app)

    async def status(request):
        return web.Response(body=coord.status_json(max_age_s=STATUS_MAX_AGE_S), content_type="application/json")

    async def metrics(request):
        return web.Response(body=coord.metrics.render(), content_type="text/plain", charset="utf-8")

    async def dashboard(request):
        page = importlib.resources.files("node.coordinator").joinpath("static/dashboard.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def index(request):
        raise web.HTTPFound("/dashboard")

    openapi_doc = json.dumps(build_openapi(run_id=coord.cfg.run.run_id, max_body_bytes=cfg.max_body_bytes))

    async def openapi(request):
        return web.Response(text=openapi_doc, content_type="application/json")

    app.router.add_post("/v1/join", join)
    app.router.add_post("/v1/heartbeat", heartbeat)
    app.router.add_post("/v1/work", work)
    app.router.add_post("/v1/submit", submit)
    app.router.add_post("/v1/verify/jobs", verify_jobs)
    app.router.add_post("/v1/verify/verdicts", verify_verdicts)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/", index)

    return app


async def start_server(coord, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start the coordinator and its HTTP server; returns (runner, bound port)."""
    await coord.start()
    app = build_app(coord)
    # aiohttp's keep-alive timer runs from the connection (and from each answer) until a request's headers
    # are complete, so it bounds a slow header sender as well as an idle connection.
    cfg = coord.cfg.server
    limits = ConnectionLimits(max_per_address=cfg.max_connections_per_address, min_send_rate=cfg.min_send_rate,
                              send_grace_s=cfg.send_grace_s)
    runner = HardenedAppRunner(app, access_log=None, keepalive_timeout=cfg.header_timeout_s, limits=limits,
                               read_bufsize=READ_BUFSIZE)
    await runner.setup()
    # the backlog bounds the sockets a connection flood holds beyond the serving budget (node/fdlimits.py)
    site = web.TCPSite(runner, host, port, backlog=listen_backlog())
    await site.start()
    bound = runner.bound_port()
    coord.url = f"http://{host}:{bound}"
    return runner, bound
