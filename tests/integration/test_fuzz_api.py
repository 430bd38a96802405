"""Hostile peers against a live coordinator (docs/PROTOCOL.md, "HTTP API": no endpoint ever returns 500 for a
client's bad input): one regression test per finding, each sent over a real socket to a real server on 127.0.0.1.

The coordinator runs in a background thread with its own event loop, so these tests can use blocking
clients (raw sockets, and schemathesis, whose requests are synchronous)."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import urllib.request
from urllib.error import HTTPError

import pytest

from tests.integration.coordinator_harness import RawNode, running_coordinator

pytestmark = pytest.mark.timeout(240)


class LiveCoordinator:
    """`running_coordinator` in a thread of its own; `base` is its URL, `port` its port."""

    def __init__(self, tmp, *extra: str):
        self.tmp, self.extra = tmp, extra
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="live-coordinator")

    def _run(self):
        async def main():
            self.stop = asyncio.Event()
            async with running_coordinator(self.tmp, *self.extra) as (coord, base):
                self.coord, self.base = coord, base
                self.port = int(base.rsplit(":", 1)[1])
                self.ready.set()
                await self.stop.wait()

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:  # surfaced by __enter__
            self.error = e
            self.ready.set()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(120), "coordinator did not start in 120 s"
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)

    # -- clients -------------------------------------------------------------------------------
    def node(self) -> RawNode:
        return RawNode(self.base, session=None)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def post(self, node: RawNode, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        h = node.headers("POST", path, body) if headers is None else headers
        req = urllib.request.Request(self.base + path, data=body, headers=h, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def joined(self) -> RawNode:
        node = self.node()
        st, _, body = self.post(node, "/v1/join", b"{}")
        assert st == 200, body
        return node

    def raw(self, data: bytes, *, source: str = "127.0.0.1", close_after: float | None = None,
            first_response: bool = False) -> bytes:
        """Send bytes on a fresh connection (from `source`, any 127/8 address) and read until the
        server closes it; `close_after`: hang up that many seconds after sending instead;
        `first_response`: stop once one whole response has arrived."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=15, source_address=(source, 0)) as s:
            s.sendall(data)
            if close_after is not None:
                time.sleep(close_after)
                return b""
            out = b""
            while chunk := s.recv(65536):
                out += chunk
                if first_response and b"\r\n\r\n" in out:
                    head, _, rest = out.partition(b"\r\n\r\n")
                    if len(rest) >= int(split_response(head + b"\r\n\r\n")[1].get("content-length", 0)):
                        break
            return out

    def count_500s(self) -> float:
        return sum(v for (route, status), v in self._request_counts().items() if status == "500")

    def _request_counts(self) -> dict:
        st, _, body = self.get("/metrics")
        assert st == 200
        out = {}
        for m in re.finditer(r'^prime_http_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$',
                             body.decode(), re.M):
            out[(m[1], m[2])] = float(m[3])
        return out


def split_response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def assert_json_error(status: int, headers: dict, body: bytes, *expected: int) -> dict:
    """A 4xx whose body is the {"error", "detail"} of docs/PROTOCOL.md, "HTTP API"; `expected`: the allowed codes."""
    assert 400 <= status < 500, (status, body[:300])
    if expected:
        assert status in expected, (status, body[:300])
    ctype = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    assert ctype.startswith("application/json"), (status, ctype, body[:300])
    err = json.loads(body)
    assert set(err) == {"error", "detail"} and isinstance(err["error"], str) and isinstance(err["detail"], str), err
    return err


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with LiveCoordinator(tmp_path_factory.mktemp("fuzz"), "verification.fraction=0", "server.body_timeout_s=2",
                         "server.header_timeout_s=3",
                         "server.rate_limit_per_second=10000", "server.rate_limit_burst=10000") as lc:
        yield lc


@pytest.fixture(autouse=True)
def no_internal_errors(live, caplog):
    """Every test here also checks that the server counted no 500 and logged no internal error."""
    before = live.count_500s()
    yield
    assert live.count_500s() == before, "the server answered 500"
    internal = [r for r in caplog.records if r.name == "prime_node.http" and "internal error" in r.getMessage()]
    assert not internal, [r.getMessage() for r in internal]


# -- item 6: no 500 for any input ------------------------------------------------------------------
def test_deeply_nested_json_body_is_a_400(live):
    node = live.joined()
    for body in (b"[" * 100_000, b'{"node":' * 100_000, b"[" * 100_000 + b"]" * 100_000):
        st, h, raw = live.post(node, "/v1/heartbeat", body)
        err = assert_json_error(st, h, raw, 400)
        assert err["error"] == "malformed"


def test_non_ascii_digits_in_path_are_not_numbers(live):
    # "²" passes str.isdigit() but int() refuses it; "١" (Arabic-Indic one) int() reads as 1.
    for path in ("/v1/checkpoints/%C2%B2/manifest", "/v1/checkpoints/%D9%A0/manifest",
                 "/v1/checkpoints/0/shards/%D9%A0", "/v1/checkpoints/0/shards/%C2%B2",
                 "/v1/checkpoints/%EF%BC%90/manifest",  # fullwidth zero
                 "/v1/checkpoints/+0/manifest", "/v1/checkpoints/0_0/manifest", "/v1/checkpoints/%200/manifest"):
        st, h, raw = live.get(path)
        err = assert_json_error(st, h, raw, 400)
        assert err["error"] == "malformed", path
    st, _, _ = live.get("/v1/checkpoints/0/shards/0")  # the ASCII spelling is served
    assert st == 200


def test_huge_integers_in_a_heartbeat_are_refused_and_status_stays_up(live):
    nodes = [live.joined() for _ in range(2)]
    for node in nodes:
        for value in (b"9" * 4300, str(2**63).encode(), b"1e400", b"-1"):
            body = b'{"bytes_by_source":{"peer":' + value + b'}}'
            st, h, raw = live.post(node, "/v1/heartbeat", body)
            assert_json_error(st, h, raw, 400)
        # the biggest accepted counters still add up to a status document (sum of many nodes' 2**63-1)
        st, _, raw = live.post(node, "/v1/heartbeat", json.dumps({"bytes_by_source": {"peer": 2**63 - 1}}).encode())
        assert st == 200, raw
    # their sum is clamped to what every JSON reader takes (the document is rebuilt at most once a second)
    deadline = time.monotonic() + 5
    while True:
        st, _, raw = live.get("/v1/status")
        assert st == 200
        if json.loads(raw)["checkpoint_bytes_by_source"]["peer"] == 2**63 - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert json.loads(raw)["checkpoint_bytes_by_source"]["peer"] == 2**63 - 1


def request_bytes(method: str, path: str, headers: list[tuple[str, str | bytes]], body: bytes = b"",
                  content_length: str | None = None, keep_alive: bool = False) -> bytes:
    """An HTTP/1.1 request with exactly these header lines (repeats and raw bytes allowed)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    if not keep_alive:
        lines.append(b"Connection: close")
    for k, v in headers:
        lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()))
    lines.append(b"Content-Length: " + (str(len(body)) if content_length is None else content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """Every HTTP response on a connection, in order (bodies delimited by Content-Length)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status, headers, _ = split_response(head + b"\r\n\r\n")
        n = int(headers.get("content-length", len(rest)))
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def test_header_tricks_get_a_json_4xx(live):
    node = live.joined()
    body = b'{"policy_step":0}'

    def signed(**override) -> list[tuple[str, str | bytes]]:
        h = node.headers("POST", "/v1/heartbeat", body)
        h.update(override)
        return list(h.items())

    def one(data: bytes, *expected: int) -> dict:
        got = responses(live.raw(data))
        assert len(got) == 1, got
        return assert_json_error(*got[0], *expected)

    # headers over aiohttp's 8190-byte field limit, and too many of them: refused by the HTTP parser
    one(request_bytes("POST", "/v1/heartbeat", signed(**{"X-Prime-Nonce": "ab" * 10_000}), body), 400)
    one(request_bytes("POST", "/v1/heartbeat", signed() + [(f"X-Pad-{i}", "x") for i in range(200)], body), 400)
    one(request_bytes("POST", "/v1/heartbeat", [("X-Prime-Run", "x" * 100_000)], body), 400)
    # a large one within the parser's limit reaches the signature check
    err = one(request_bytes("POST", "/v1/heartbeat", signed(**{"X-Prime-Run": "r" * 8000}), body), 401)
    assert err["error"] == "wrong_run" and len(err["detail"]) < 300
    # a duplicated signed header is ambiguous (a proxy may keep the other one): refused, whichever comes first
    other = RawNode(live.base, None)
    for name in ("X-Prime-Key", "X-Prime-Signature", "X-Prime-Timestamp", "X-Prime-Nonce", "X-Prime-Run"):
        dup = signed() + [(name, other.headers("POST", "/v1/heartbeat", body)[name])]
        err = one(request_bytes("POST", "/v1/heartbeat", dup, body), 400)
        assert err["error"] == "malformed" and name in err["detail"]
    # non-ASCII (and non-UTF-8) values of every signed header
    for name in ("X-Prime-Key", "X-Prime-Signature", "X-Prime-Timestamp", "X-Prime-Nonce", "X-Prime-Run"):
        for value in (b"\xff\xfe\xc3\xa9", "١".encode() * 13, "²".encode() * 64, b"\xe2\x80\xae" + b"a" * 60):
            one(request_bytes("POST", "/v1/heartbeat", signed(**{name: value}), body), 401)
    # a timestamp is ASCII digits: "now" spelled in Arabic-Indic digits and correctly signed is refused
    arabic = str(int(time.time() * 1000)).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    h = {k: v for k, v in node.headers("POST", "/v1/heartbeat", body, ts=arabic).items()}
    err = one(request_bytes("POST", "/v1/heartbeat", [(k, v.encode()) for k, v in h.items()], body), 401)
    assert err["error"] == "bad_timestamp"

    # Content-Length lies
    for cl in ("abc", "-1", "99999999999999999999999", "1, 2", "0x10"):
        one(request_bytes("POST", "/v1/heartbeat", signed(), body, content_length=cl), 400, 413)
    one(request_bytes("POST", "/v1/heartbeat", signed() + [("Transfer-Encoding", "chunked")], body), 400)
    # shorter than the body: the rest is parsed as a next request (garbage). aiohttp answers the first
    # (401: the body read is not the one signed) unless both arrive in one read, then only the garbage.
    got = responses(live.raw(request_bytes("POST", "/v1/heartbeat", signed(), body, content_length="5",
                                           keep_alive=True)))
    assert [s for s, _, _ in got] in ([401, 400], [400]), got
    for r in got:
        assert_json_error(*r)
    # longer than the body, then the client hangs up: the handler sees the connection go (no 500 counted)
    live.raw(request_bytes("POST", "/v1/heartbeat", signed(), body, content_length="100"), close_after=0.5)
    time.sleep(0.5)
    # longer than the body, and the client waits: 408 once server.body_timeout_s (2 s here) has passed
    t0 = time.monotonic()
    got = responses(live.raw(request_bytes("POST", "/v1/heartbeat", signed(), body, content_length="100"),
                             first_response=True))
    assert 1.5 < time.monotonic() - t0 < 8 and len(got) == 1
    err = assert_json_error(*got[0], 408)
    assert err["error"] == "timeout" and got[0][1]["connection"] == "close"


def test_headers_sent_too_slowly_close_the_connection(live):
    """A sender trickling header lines (one every 0.5 s, never finishing) used to hold its connection
    for as long as it liked; the headers must now be complete within server.header_timeout_s (3 s here)."""
    import socket

    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        closed_at = None
        for _ in range(40):
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:  # the server closed the connection
                closed_at = time.monotonic() - t0
                break
            sock.settimeout(0.5)
            try:
                if sock.recv(1) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except socket.timeout:
                pass
        assert closed_at is not None and 2.5 < closed_at < 8, closed_at


def test_range_header_tricks_on_the_shard_route(live):
    path = "/v1/checkpoints/0/shards/0"
    st, h, data = live.get(path)
    assert st == 200 and len(data) > 10
    st, h, part = live.get(path, {"Range": "bytes=2-5"})
    assert st == 206 and part == data[2:6] and h["Content-Range"] == f"bytes 2-5/{len(data)}"
    st, _, part = live.get(path, {"Range": "bytes=0-" + "9" * 40})  # an end past the file is cut to it
    assert st == 206 and part == data
    for rng in ("bytes=" + "9" * 5000 + "-", "bytes=0-" + "9" * 5000, "bytes=-" + "9" * 5000, "bytes=9" + "9" * 30 + "-",
                "bytes=abc", "bytes=-", "bytes=5-2", "bytes=1-2,4-5", "bytes=١-٢", "bytes=²-", "bytes=0x1-2",
                "bytes=+1-2", "bytes=1_0-20", "items=0-1", "bytes=-0", "", "bytes=0-1" + "\u2028"):
        raw = request_bytes("GET", path, [("Range", rng.encode())], content_length="0")
        got = responses(live.raw(raw))
        assert len(got) == 1
        st, hh, b = got[0]
        err = assert_json_error(st, hh, b, 400, 416)
        if st == 416:
            assert err["error"] == "range_not_satisfiable" and hh["content-range"] == f"bytes */{len(data)}", rng
    # two Range headers: ambiguous, refused
    got = responses(live.raw(request_bytes("GET", path, [("Range", "bytes=0-1"), ("Range", "bytes=2-3")],
                                           content_length="0")))
    assert_json_error(*got[0], 416)


def test_odd_methods_and_paths_get_json_errors(live):
    cases = [("PUT", "/v1/work", 405), ("DELETE", "/v1/status", 405), ("OPTIONS", "/v1/join", 405),
             ("GET", "/v1/work", 405), ("GET", "/nope", 404), ("GET", "/v1/checkpoints/..%2F..%2Fetc/manifest", 400),
             ("GET", "/v1/checkpoints/0/shards/%00", 400), ("GET", "/v1/checkpoints/99999999999/manifest", 400),
             ("GET", "/v1/checkpoints/0/shards/100000", 400), ("GET", "/v1/checkpoints/2147483647/manifest", 404),
             ("GET", "/" + "a" * 9000, 400), ("BREW", "/v1/status", 400)]
    for method, path, want in cases:
        got = responses(live.raw(request_bytes(method, path, [], content_length="0")))
        assert len(got) == 1, (method, path)
        assert_json_error(*got[0], want)
    # HEAD of a shard: headers only, no body, no error
    head = live.raw(request_bytes("HEAD", "/v1/checkpoints/0/shards/0", [], content_length="0"))
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")


def test_malformed_http_is_logged_once_per_peer_address_per_minute(live, caplog):
    caplog.set_level(logging.INFO)
    garbage = [b"\x00\x01garbage\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
               b"POST /v1/work HTTP/1.1\r\nContent-Length: zz\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"]
    for source in ("127.0.0.7", "127.0.0.8"):
        for i in range(30):
            got = responses(live.raw(garbage[i % len(garbage)], source=source))
            assert len(got) == 1
            assert_json_error(*got[0], 400)
    time.sleep(0.2)
    for source in ("127.0.0.7", "127.0.0.8"):
        lines = [r for r in caplog.records if r.levelno >= logging.INFO and source in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].exc_info is None or lines[0].levelno <= logging.WARNING
    st, _, _ = live.get("/v1/status")  # the server is fine
    assert st == 200


# -- item 9: the OpenAPI description and a schemathesis fuzz run -------------------------------------
def test_openapi_document_describes_every_route(live):
    from node.coordinator.app import build_app
    from node.coordinator.openapi import ROUTES

    st, h, raw = live.get("/openapi.json")
    assert st == 200 and h["Content-Type"].startswith("application/json")
    doc = json.loads(raw)
    assert doc["openapi"].startswith("3.") and "local-demo" in doc["info"]["description"]
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {(r.method, r.resource.canonical) for r in build_app(live.coord).router.routes() if r.method != "HEAD"}
    assert documented == routed == {(r.method.upper(), r.path) for r in ROUTES}
    schemas = doc["components"]["schemas"]
    # request and response bodies are the wire models' own JSON schemas, with their bounds
    work = doc["paths"]["/v1/work"]["post"]
    assert work["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/WorkRequest"}
    assert schemas["WorkRequest"]["properties"]["policy_step"]["maximum"] == 2**31 - 1
    assert schemas["WorkRequest"]["additionalProperties"] is False
    assert schemas["HeartbeatRequest"]["properties"]["bytes_by_source"]["additionalProperties"]["maximum"] == 2**63 - 1
    assert set(work["responses"]) == {"200", "204", "400", "401", "403", "408", "409", "413", "429"}
    assert work["responses"]["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert set(schemas["ErrorBody"]["required"]) == {"error", "detail"}
    # signed operations require the five X-Prime-* headers (docs/PROTOCOL.md, "Signed requests", run-bound v2)
    assert set(work["security"][0]) == {"X-Prime-Key", "X-Prime-Timestamp", "X-Prime-Nonce", "X-Prime-Run",
                                        "X-Prime-Signature"}
    assert doc["components"]["securitySchemes"]["X-Prime-Run"] == {
        "type": "apiKey", "in": "header", "name": "X-Prime-Run", "description": doc["components"][
            "securitySchemes"]["X-Prime-Run"]["description"]}
    assert "security" not in doc["paths"]["/v1/status"]["get"]
    shard = doc["paths"]["/v1/checkpoints/{step}/shards/{index}"]["get"]
    assert {"200", "206", "416"} <= set(shard["responses"]) and {p["name"] for p in shard["parameters"]} >= {"Range"}


class SignV2:
    """requests auth: signs the request exactly as it goes out (final path with query, final body bytes)
    with the run-bound v2 scheme, through the harness's RawNode (a signer written from docs/PROTOCOL.md,
    "Signed requests")."""

    def __init__(self, node: RawNode):
        self.node = node

    def __call__(self, r):
        from urllib.parse import urlsplit

        body = r.body or b""
        body = body.encode() if isinstance(body, str) else body
        parts = urlsplit(r.url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        for k, v in self.node.headers(r.method, path, body).items():
            if k != "Content-Type":
                r.headers[k] = v
        return r


FUZZ_EXAMPLES = {"positive": 25, "negative": 25}  # per operation and mode; the run stays well under 60 s


def test_schemathesis_fuzz_finds_no_server_error(live):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.parameters import ParameterLocation
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    started = time.monotonic()
    node, beating = live.joined(), live.joined()
    # Real assignments (2 in flight per node), so that half of the generated submissions reach the
    # intake with a live assignment id and its prompt ids instead of stopping at 404.
    pool = []
    for _ in range(6):
        owner = live.joined()
        for _ in range(2):
            st, _, raw = live.post(owner, "/v1/work", b'{"policy_step":0}')
            if st == 200:
                pool.append((json.loads(raw), owner))
    assert pool
    turn = [0]

    def aim_at_a_live_assignment(case) -> RawNode:
        turn[0] += 1
        if turn[0] % 2 or not isinstance(case.body, dict) or case.meta.is_negative_at(ParameterLocation.BODY):
            return node
        a, owner = pool[turn[0] // 2 % len(pool)]
        body = dict(case.body, assignment_id=a["assignment_id"], policy_step=0)
        rollouts = []
        for k, r in enumerate(body.get("rollouts", [])):
            p = a["prompts"][k % len(a["prompts"])]
            n = len(r["completion_ids"])  # one logprob per token: a rule the JSON schema cannot state
            logprobs = (r["logprobs"] + [-1.0] * n)[:n]
            rollouts.append(dict(r, prompt_id=p["prompt_id"], sample_index=r["sample_index"] % len(p["seeds"]),
                                 logprobs=logprobs))
        case.body = dict(body, rollouts=rollouts)
        return owner

    def aim_at_a_published_step(case) -> None:
        turn[0] += 1
        if turn[0] % 2 == 0 and not case.meta.is_negative_at(ParameterLocation.PATH):
            case.path_parameters = {k: 0 for k in case.path_parameters}  # step 0 (and its shard 0) exist
        if case.path == "/v1/work" and turn[0] % 2 == 0 and not case.meta.is_negative_at(ParameterLocation.BODY):
            case.body = {"policy_step": 0}

    @schemathesis.hook
    def before_call(context, case, kwargs):
        # Half of the valid cases are aimed at things that exist (see above), the rest go as generated.
        if case.path_parameters or case.path == "/v1/work":
            aim_at_a_published_step(case)
        # A signed operation goes out signed, unless this case is about broken headers (a negative case
        # that drops or mangles the X-Prime-* headers): those are sent as generated and must be refused.
        if case.method.upper() != "POST" or case.meta.is_negative_at(ParameterLocation.HEADER):
            return
        # (heartbeats from a node of their own: the steps they report would make `node`'s work requests stale)
        signer = {"/v1/submit": aim_at_a_live_assignment, "/v1/heartbeat": lambda _: beating}.get(
            case.path, lambda _: node)(case)
        kwargs["auth"] = SignV2(signer)

    schema = schemathesis.openapi.from_url(live.base + "/openapi.json")
    session = requests.Session()
    stats = {"calls": 0, "by_status": {}, "by_op": {}}
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode_name, n in FUZZ_EXAMPLES.items():
                mode = schemathesis.GenerationMode(mode_name)
                checks = [not_a_server_error, status_code_conformance, content_type_conformance,
                          response_schema_conformance]

                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=n, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                def fuzz(case):
                    resp = case.call(base_url=live.base, session=session, timeout=30)
                    stats["calls"] += 1
                    stats["by_status"][resp.status_code] = stats["by_status"].get(resp.status_code, 0) + 1
                    per_op = stats["by_op"].setdefault(op.label, {})
                    per_op[resp.status_code] = per_op.get(resp.status_code, 0) + 1
                    assert resp.status_code < 500, (op.label, resp.status_code, resp.text[:300])
                    if resp.status_code >= 400:
                        err = resp.json()
                        ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", [""])
                        assert ctype[0].startswith("application/json"), (op.label, resp.status_code, ctype)
                        assert set(err) == {"error", "detail"} and all(isinstance(v, str) for v in err.values()), err
                    case.validate_response(resp, checks=checks)
                    if mode_name == "negative":  # schema-violating input is refused (416 included, which
                        # schemathesis's own negative_data_rejection does not count as a refusal)
                        assert 400 <= resp.status_code < 500, (op.label, resp.status_code, case.as_curl_command())

                try:
                    fuzz()
                except Unsatisfiable:  # negative mode on an operation without parameters or body
                    assert mode_name == "negative" and not op.body and not list(op.iter_parameters()), op.label
    finally:
        schemathesis.hooks.unregister(before_call)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {stats['calls']} calls in {elapsed:.1f} s, statuses {sorted(stats['by_status'].items())}")
    assert stats["calls"] >= 200
    assert stats["by_status"].get(200, 0) > 0 and not any(s >= 500 for s in stats["by_status"])
    for label, counts in sorted(stats["by_op"].items()):
        print(f"  {label}: {sorted(counts.items())}")
    assert stats["by_op"]["POST /v1/submit"].get(200, 0) > 0  # some generated submissions reached the intake
    st, _, _ = live.get("/v1/status")
    assert st == 200
