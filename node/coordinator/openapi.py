"""GET /openapi.json: an OpenAPI 3.1 description of the coordinator's HTTP API (docs/PROTOCOL.md, "HTTP API").

Generated, not written by hand: the paths and status codes come from `ROUTES` below (the table of
docs/PROTOCOL.md, "HTTP API"; tests/integration/test_fuzz_api.py checks it against the application's
router), the request and response bodies are the JSON schemas pydantic makes from the wire models of
`protocol.messages` and the checkpoint `Manifest`, and the signed-request headers (docs/PROTOCOL.md,
"Signed requests") are five header `apiKey` security schemes that every signed operation requires
together. Every error answer is `ErrorBody` (`{"error": code, "detail": sentence}`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from protocol import messages as M
from protocol.checkpoint.manifest import Manifest
from protocol.signing import (CLOCK_WINDOW_MS, HEADER_KEY, HEADER_NONCE, HEADER_RUN, HEADER_SIGNATURE,
                              HEADER_TIMESTAMP)

OPENAPI_VERSION = "3.1.0"
SCHEMA_REF = "#/components/schemas/{model}"

# Status codes of docs/PROTOCOL.md, "HTTP API", with what each means on this API.
SIGNED_ERRORS = {
    400: "malformed: not JSON, NaN, an unknown field, a value out of range, an ambiguous header",
    401: "signature: missing_headers, bad_key, bad_timestamp, bad_nonce, clock_skew, wrong_run, "
         "bad_signature, replay",
    403: "unknown or banned node",
    408: "the body did not arrive within server.body_timeout_s",
    413: "body over server.max_body_bytes",
    429: "rate limit per node (rate_limited), nonce store full",
}
BINARY = "binary"
HTML = "html"
TEXT = "text"
ANY_JSON = "json"
NO_BODY = None


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    signed: bool = False
    request: type[BaseModel] | None = None
    # status -> (description, body: a model, BINARY/HTML/TEXT/ANY_JSON, or NO_BODY); errors are ErrorBody
    responses: dict[int, tuple[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    parameters: tuple[dict, ...] = ()


STEP_PARAM = {"name": "step", "in": "path", "required": True, "description": "policy step (ASCII digits)",
              "schema": {"type": "integer", "minimum": 0, "maximum": M.MAX_STEP}}
INDEX_PARAM = {"name": "index", "in": "path", "required": True, "description": "shard index (ASCII digits)",
               "schema": {"type": "integer", "minimum": 0, "maximum": M.MAX_SHARDS}}
RANGE_PARAM = {"name": "Range", "in": "header", "required": False,
               "description": "one byte range: bytes=a-b, bytes=a- or bytes=-n (ASCII digits)",
               "schema": {"type": "string", "maxLength": 100}}
SWARM_PARAM = {"name": "X-Prime-Swarm", "in": "header", "required": False,
               "description": '"1": the requester can also fetch shards from libp2p peers (super-seeding: '
                              "429 seeded while the shard is spreading); any other value is ignored",
               "schema": {"type": "string"}}

ROUTES: tuple[Route, ...] = (
    Route("post", "/v1/join", "Register the signer; returns the run spec.", True, M.JoinRequest,
          {200: ("the run spec", M.RunSpec)},
          {**SIGNED_ERRORS, 403: "admission refused: banned, pow_required, bad_pow, not_allowlisted, "
                                 "token_required, bad_token, token_expired, token_used",
           429: "too_many_joins from this address, or rate_limited"}),
    Route("post", "/v1/heartbeat", "Liveness and node stats.", True, M.HeartbeatRequest,
          {200: ("the coordinator's newest step", M.HeartbeatResponse)}, SIGNED_ERRORS),
    Route("post", "/v1/work", "Ask for an assignment.", True, M.WorkRequest,
          {200: ("an assignment", M.Assignment), 204: ("no work right now", NO_BODY)},
          {**SIGNED_ERRORS, 409: "stale_policy: fetch a newer checkpoint; unpublished_policy, policy_went_back",
           429: "rate_limited, or too many assignments in flight"}),
    Route("post", "/v1/submit", "Submit rollouts for an assignment.", True, M.SubmitRequest,
          {200: ("a verdict per rollout", M.SubmitResponse)},
          {**SIGNED_ERRORS, 403: "unknown or banned node, not_your_assignment", 404: "unknown_assignment",
           409: "duplicate, expired, stale_policy"}),
    Route("post", "/v1/verify/jobs", "A verifier (verification.verifier_keys) asks for a replay job.", True,
          M.VerifyJobsRequest,
          {200: ("the run facts (when asked) and/or a leased job", M.VerifyJobsResponse),
           204: ("no job right now", NO_BODY)},
          {**SIGNED_ERRORS, 403: "not_a_verifier"}),
    Route("post", "/v1/verify/verdicts", "A verifier's verdicts on its leased job, one per rollout.", True,
          M.VerdictsRequest, {200: ("taken", M.VerdictsResponse)},
          {**SIGNED_ERRORS, 400: "malformed, or wrong_verdict_count", 403: "not_a_verifier",
           404: "unknown_job", 409: "not_your_job: the lease ran out and the job went to another verifier"}),
    Route("get", "/v1/checkpoints", "The steps a node may fetch.",
          responses={200: ("available checkpoints", M.CheckpointList)}),
    Route("get", "/v1/checkpoints/{step}/manifest", "The signed manifest of a step (docs/PROTOCOL.md, \"Manifest\").",
          responses={200: ("the signed manifest", Manifest)},
          errors={400: "step is not a number", 404: "no such step"}, parameters=(STEP_PARAM,)),
    Route("get", "/v1/checkpoints/{step}/shards/{index}", "Compressed shard bytes (HTTP Range supported).",
          responses={200: ("the shard", BINARY), 206: ("part of the shard", BINARY)},
          errors={400: "step or index is not a number", 404: "no such step or shard",
                  416: "range_not_satisfiable", 429: "seeded: fetch it from a peer"},
          parameters=(STEP_PARAM, INDEX_PARAM, RANGE_PARAM, SWARM_PARAM)),
    Route("get", "/v1/status", "Run status: step, nodes, throughput, verification counts, reward curve.",
          responses={200: ("the status document", M.StatusResponse)}),
    Route("get", "/dashboard", "The live dashboard page.", responses={200: ("the page", HTML)}),
    Route("get", "/metrics", "Prometheus text format.", responses={200: ("the metrics", TEXT)}),
    Route("get", "/openapi.json", "This document.", responses={200: ("OpenAPI 3.1", ANY_JSON)}),
    Route("get", "/", "Redirects to the dashboard.", responses={302: ("to /dashboard", NO_BODY)}),
)

SECURITY_SCHEMES = {
    HEADER_KEY: "signer's Ed25519 public key, 64 lowercase hex characters (the node id)",
    HEADER_TIMESTAMP: f"Unix time in milliseconds, ASCII digits, within {CLOCK_WINDOW_MS // 1000} s of the "
                      "coordinator's clock",
    HEADER_NONCE: "16 to 64 random bytes in hex, never reused within the clock window",
    HEADER_RUN: "the run id (GET /v1/status returns it as run_id)",
    HEADER_SIGNATURE: "hex Ed25519 signature over METHOD\\nPATH\\nTIMESTAMP\\nNONCE\\nRUN_ID\\nsha256_hex(BODY) "
                      "(PATH with its query string)",
}


def _models() -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    out: list[tuple[type[BaseModel], JsonSchemaMode]] = [(M.ErrorBody, "serialization")]
    for r in ROUTES:
        if r.request is not None:
            out.append((r.request, "validation"))
        for _, body in r.responses.values():
            if isinstance(body, type) and issubclass(body, BaseModel):
                out.append((body, "serialization"))
    seen, unique = set(), []
    for m in out:
        if m not in seen:
            seen.add(m)
            unique.append(m)
    return unique


def _content(body: Any, refs: dict) -> dict | None:
    if body is NO_BODY:
        return None
    if body == BINARY:
        return {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    if body == HTML:
        return {"text/html": {"schema": {"type": "string"}}}
    if body == TEXT:
        return {"text/plain": {"schema": {"type": "string"}}}
    if body == ANY_JSON:
        return {"application/json": {"schema": {"type": "object"}}}
    return {"application/json": {"schema": refs[(body, "serialization")]}}


def _operation_id(r: Route) -> str:
    words = [w.strip("{}") for w in r.path.split("/") if w]
    return "_".join([r.method, *words]) if words else f"{r.method}_index"


def build_openapi(*, run_id: str | None = None, max_body_bytes: int | None = None) -> dict:
    """The OpenAPI document of this coordinator (`run_id`, `max_body_bytes`: its settings, for the text)."""
    refs, top = models_json_schema(_models(), ref_template=SCHEMA_REF)
    error = {"description": "", "content": {"application/json": {"schema": refs[(M.ErrorBody, "serialization")]}}}
    paths: dict[str, dict] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"operationId": _operation_id(r), "summary": r.summary, "responses": {}}
        if r.parameters:
            op["parameters"] = [dict(p) for p in r.parameters]
        if r.signed:
            op["security"] = [{name: [] for name in SECURITY_SCHEMES}]
        if r.request is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(r.request, "validation")]}}}
        for status, (description, body) in sorted(r.responses.items()):
            resp: dict[str, Any] = {"description": description}
            content = _content(body, refs)
            if content:
                resp["content"] = content
            op["responses"][str(status)] = resp
        for status, description in sorted(r.errors.items()):
            op["responses"][str(status)] = {**error, "description": description}
        paths.setdefault(r.path, {})[r.method] = op
    try:
        pkg_version = version("prime-node")
    except PackageNotFoundError:
        pkg_version = "0"
    limits = f" Request bodies are at most {max_body_bytes} bytes." if max_body_bytes else ""
    run = f" This coordinator serves run {run_id!r}." if run_id else ""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "prime-node coordinator",
            "version": pkg_version,
            "description": "Decentralized RL coordinator (docs/PROTOCOL.md, \"HTTP API\"). Signed requests carry the "
                           "five X-Prime-* headers (run-bound v2). Every error is a JSON ErrorBody; no client input "
                           "produces a 500." + run + limits,
        },
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {name: {"type": "apiKey", "in": "header", "name": name, "description": text}
                                for name, text in SECURITY_SCHEMES.items()},
        },
    }
