"""Property tests of every wire parser (hypothesis): arbitrary bytes and structures, and valid documents
with one part replaced by something hostile, never raise anything but the parser's documented error,
and whatever a parser accepts stays within its bounds.

  parser                                         documented error
  protocol.messages models (model_validate[_json]) pydantic ValidationError
  node.http.parse_body               ApiError 400
  node.http._parse_range             ApiError 416 (a valid range is inside the file)
  node.http.int_param                ApiError 400
  Manifest.from_json_bytes                       CheckpointError
  node.p2p.shard_wire decode_request etc.        BadRequest
  node.p2p.announce.decode_announcement          AnnouncementRejected
"""
from __future__ import annotations

import inspect
import json
import math
import struct
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from node.http import ApiError, _parse_range, int_param, parse_body
from node.p2p.announce import decode_announcement, encode_have_announcement, encode_manifest_announcement
from node.p2p.errors import AnnouncementRejected
from node.p2p.shard_wire import (BadRequest, Status, decode_header, decode_request, parse_request_length)
from protocol import messages as M
from protocol.checkpoint import CheckpointError
from protocol.checkpoint.manifest import Manifest
from protocol.identity import Identity
from protocol.signing import canonical_json, sign_document

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PER_MODEL = settings(FUZZ, max_examples=80)  # x 21 models x 2 properties

H64 = "ab" * 32
INT64 = 2**63

# -- hostile values -----------------------------------------------------------------------------------
NASTY_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**100,
              int("9" * 4300)]
NASTY_FLOATS = [0.0, -0.0, 1e308, -1e308, 1e-320, float("inf"), float("-inf"), float("nan"), 2.0**63, 0.5]
NASTY_STRS = ["", "\x00", "\ud800", "²", "١", "Ａ", "\u202e", "a" * 5000, "../../etc/passwd", "0" * 65, "NaN"]
leaves = (st.none() | st.booleans() | st.integers() | st.sampled_from(NASTY_INTS) | st.floats()
          | st.sampled_from(NASTY_FLOATS) | st.text(max_size=40) | st.sampled_from(NASTY_STRS))
json_like = st.recursive(leaves, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(
    st.text(max_size=12) | st.sampled_from(["run_id", "step", "index", "policy_step", "rollouts", "kind"]),
    kids, max_size=6), max_leaves=30)
nesting = st.sampled_from([b"[" * 100_000, b'{"a":' * 100_000, b"[" * 5000 + b"]" * 5000, b"[" * 1024,
                           b'{"node":' * 1024])


def hostile_bytes():
    return (st.binary(max_size=2048) | nesting
            | json_like.map(lambda v: json.dumps(v, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")))


def paths(doc, prefix=()):
    """Every location in a JSON document, containers included."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, prefix + (i,))


def replaced(doc, path, value, drop: bool):
    if not path:
        return value
    doc = json.loads(json.dumps(doc))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@st.composite
def mutated(draw, doc):
    """`doc` with one location replaced by a hostile value, dropped, or given an unknown sibling."""
    where = draw(st.sampled_from(list(paths(doc))))
    how = draw(st.sampled_from(["replace", "replace", "replace", "drop", "extra"]))
    if how == "drop" and where:
        return replaced(doc, where, None, drop=True)
    if how == "extra" and isinstance(_at(doc, where), dict):
        return replaced(doc, where + ("unexpected",), draw(json_like), drop=False)
    return replaced(doc, where, draw(json_like), drop=False)


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def bounded(value) -> None:
    """What a model accepted: finite floats, integers within int64, serializable as strict JSON."""
    json.dumps(value, allow_nan=False)
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, bool) or x is None or isinstance(x, str):
            continue
        elif isinstance(x, int):
            assert -INT64 <= x < INT64, x
        else:
            assert isinstance(x, float) and math.isfinite(x), x


# -- protocol.messages ----------------------------------------------------------------------------------
ROLLOUT = {"prompt_id": "p0", "sample_index": 1, "completion_ids": [5, 6, 4], "logprobs": [-0.1, -2.0, -0.01],
           "finish_reason": "stop", "commitment": "AAAA"}
REPLAY = {"prompt_ids": [1, 2], "completion_ids": [5, 6, 4], "logprobs": [-0.1, -2.0, -0.01], "finish_reason": "stop",
          "commitment": "AAAA", "seed": 2**63 - 1}
SPEC = {"run_id": "r", "coordinator_key": H64, "model_config_json": {"vocab_size": 100}, "eos_token_id": 4,
        "async_level": 2, "checkpoint_dtype": "bfloat16", "relays": ["http://127.0.0.1:9"]}
JOB = {"job_id": "ab12-0", "policy_step": 3, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8},
       "lease_ms": 1_700_000_000_000, "items": [REPLAY]}
VERDICT = {"reason": "verify_sampling", "tokens": 3, "near_ties": 0, "outlier": True, "fit": 0.0523}
CKPT = {"step": 3, "encoding": "xor-delta", "base_step": 2, "num_shards": 2, "total_size": 300_000,
        "compressed_size": 90_000, "manifest_hash": H64}
SAMPLES: dict[type[BaseModel], dict] = {
    M.NodeInfo: {"name": "n", "backend": "transformers", "device": "cpu", "p2p_addrs": ["/ip4/1.2.3.4/tcp/1"],
                 "listen_ports": {"libp2p": 4001, "http": 4002}},
    M.ListenPorts: {"libp2p": 4001, "http": 4002},
    M.Reachability: {"observed_ip": "1.2.3.4", "libp2p": True, "http": False},
    M.JoinRequest: {"node": {"name": "n"}, "pow": "00ff", "token": "abc"},
    M.AdmissionInfo: {"mode": "open", "pow_bits": 19},
    M.RunInfo: {"run_id": "local-demo", "coordinator_key": H64, "admission": {"mode": "token", "pow_bits": 0}},
    M.RunSpec: {"run_id": "r", "node_id": H64, "coordinator_key": H64, "task": "reverse-text", "async_level": 2,
                "current_step": 7, "group_size": 8, "model_config_json": {"vocab_size": 100, "rope": {"theta": 1e4}},
                "tokenizer_files": {"tokenizer.json": "{}"}, "eos_token_id": 4, "checkpoint_dtype": "bfloat16",
                "p2p_bootstrap": ["/ip4/127.0.0.1/tcp/4001"], "relays": ["http://127.0.0.1:9"],
                "reachability": {"observed_ip": "1.2.3.4", "libp2p": False, "http": None}},
    M.HeartbeatRequest: {"policy_step": 3, "tokens_per_second": 12.5, "steps_held": [1, 2, 3], "state": "generating",
                         "bytes_by_source": {"coordinator": 10, "relay": 0, "peer": 2**40}},
    M.HeartbeatResponse: {"current_step": 3, "banned": False},
    M.WorkRequest: {"policy_step": 0},
    M.NoWork: {"retry_after_ms": 5000},
    M.Sampling: {"temperature": 1.0, "top_p": 0.9, "max_tokens": 32},
    M.PromptWork: {"prompt_id": "p0", "prompt_ids": [1, 2, 3], "seeds": [0, 2**63 - 1], "env_state": "5"},
    M.Assignment: {"assignment_id": "a1", "batch_step": 3, "min_policy_step": 1, "group_size": 2,
                   "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}, "deadline_ms": 1_700_000_000_000,
                   "prompts": [{"prompt_id": "p0", "prompt_ids": [1, 2], "seeds": [1, 2]}]},
    M.RolloutSubmission: ROLLOUT,
    M.ModelTurnWire: {k: ROLLOUT[k] for k in ("completion_ids", "logprobs", "finish_reason", "commitment")},
    M.EnvTurn: {"env_ids": [2, 7, 3], "completion_ids": [5, 4], "logprobs": [-0.5, 0.0], "finish_reason": "stop",
                "commitment": "AAAA"},
    M.SubmitRequest: {"assignment_id": "a1", "policy_step": 1, "rollouts": [ROLLOUT, dict(ROLLOUT, sample_index=0)]},
    M.RolloutRef: {"prompt_id": "p0", "sample_index": 0},
    M.Rejection: {"prompt_id": "p0", "sample_index": 1, "reason": "token_out_of_vocab"},
    M.SubmitResponse: {"accepted": [{"prompt_id": "p0", "sample_index": 0}],
                       "rejected": [{"prompt_id": "p0", "sample_index": 1, "reason": "group_rejected"}]},
    M.ErrorBody: {"error": "malformed", "detail": "body is not valid JSON"},
    M.VerifyJobsRequest: {"spec": True},
    M.VerifierSpec: SPEC,
    M.ReplayItem: REPLAY,
    M.VerifyJob: JOB,
    M.VerifyJobsResponse: {"spec": SPEC, "job": JOB},
    M.ReplayVerdict: VERDICT,
    M.VerdictsRequest: {"job_id": "ab12-0", "verdicts": [VERDICT, dict(VERDICT, reason=None, outlier=False, fit=None)]},
    M.VerdictsResponse: {"accepted": True},
    M.CheckpointInfo: CKPT,
    M.CheckpointList: {"steps": [2, 3], "newest": 3, "checkpoints": [CKPT]},
    M.StatusResponse: {"run_id": "local-demo", "coordinator_key": H64, "admission": {"mode": "open", "pow_bits": 0},
                       "step": 3, "async_level": 2, "checkpoints": [CKPT], "nodes": [], "uptime_s": 1.5},
}
MODELS = sorted(SAMPLES, key=lambda m: m.__name__)


def test_every_wire_model_has_a_sample_that_validates():
    defined = {obj for _, obj in inspect.getmembers(M, inspect.isclass)
               if issubclass(obj, BaseModel) and obj.__module__ == M.__name__ and obj is not M.Wire}
    assert defined == set(SAMPLES), "a new wire model needs a sample here (and so gets fuzzed)"
    for model, doc in SAMPLES.items():
        bounded(model.model_validate(doc).model_dump(mode="json"))


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@PER_MODEL
@given(data=st.data())
def test_a_wire_model_refuses_or_bounds_a_hostile_document(model, data):
    doc = data.draw(mutated(SAMPLES[model]) | json_like)
    try:
        parsed = model.model_validate(doc)
    except ValidationError:
        return
    bounded(parsed.model_dump(mode="json"))


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@PER_MODEL
@given(raw=hostile_bytes())
def test_a_wire_model_parses_hostile_bytes_or_raises_validation_error(model, raw):
    try:
        parsed = model.model_validate_json(raw)  # how the worker's client reads the coordinator's answers
    except ValidationError:
        return
    bounded(parsed.model_dump(mode="json"))


@pytest.mark.parametrize("model", [M.JoinRequest, M.HeartbeatRequest, M.WorkRequest, M.SubmitRequest],
                         ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data())
def test_parse_body_answers_400_or_a_bounded_request(model, data):
    raw = data.draw(hostile_bytes() | mutated(SAMPLES[model]).map(
        lambda d: json.dumps(d, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")))
    try:
        req = parse_body(model, raw)
    except ApiError as e:
        assert e.status == 400 and e.code == "malformed" and len(e.detail) <= 1024
        return
    bounded(req.model_dump(mode="json"))


@FUZZ
@given(xs=st.lists(st.floats(min_value=M.MIN_LOGPROB, max_value=0.0, width=32), min_size=1, max_size=64))
@example(xs=[-0.0, -1e-45, -123456.789, -0.33996593952178955, M.MIN_LOGPROB])
def test_wire_logprobs_give_every_float32_back_and_validate(xs):
    """M.wire_logprobs (what a worker sends): every float32 value comes back exactly, in at most 9 significant
    digits, and the result still validates where logprobs are bounded."""
    sent = M.wire_logprobs(xs)
    assert struct.pack(f"<{len(xs)}f", *sent) == struct.pack(f"<{len(xs)}f", *xs)
    assert all(len(repr(x)) <= 16 for x in sent)  # 9 digits, a sign, a point, an exponent (17 digits before)
    M.EnvTurn(env_ids=[1], completion_ids=[1] * len(sent), logprobs=sent, finish_reason="stop", commitment="AQAA")


def test_parse_body_refuses_deep_nesting_with_400():
    for raw in (b"[" * 100_000, b'{"node":' * 100_000):
        with pytest.raises(ApiError) as e:
            parse_body(M.HeartbeatRequest, raw)
        assert e.value.status == 400


# -- node.http: Range and path numbers --------------------------------------------------------
def reference_range(header: str, size: int):
    """RFC 9110 single byte range with ASCII digits, written independently of _parse_range."""
    if not header.startswith("bytes="):
        return None
    spec = header[len("bytes="):].strip(" \t")
    if spec.count("-") != 1:
        return None
    a, b = (x.strip(" \t") for x in spec.split("-"))
    if not all(c in "0123456789" for c in a + b) or len(a) > 40 or len(b) > 40:
        return None
    if a == "":
        if b == "" or int(b) == 0:
            return None
        return max(0, size - int(b)), size - 1
    start, end = int(a), (min(int(b), size - 1) if b else size - 1)
    return (start, end) if start <= end else None


range_headers = st.one_of(
    st.text(max_size=60),
    st.builds(lambda a, b, sp: f"bytes={sp}{a}{sp}-{sp}{b}{sp}",
              st.integers(0, 10**45).map(str) | st.just("") | st.sampled_from(["²", "١", "0x1", "+1", "1_0", "-1"]),
              st.integers(0, 10**45).map(str) | st.just("") | st.sampled_from(["٢", "1e3", " "]),
              st.sampled_from(["", " ", "\t"])),
    st.sampled_from(["bytes=0-1,2-3", "bytes=-", "bytes=--1", "items=0-1", "bytes=0-" + "9" * 5000]),
)


@FUZZ
@given(header=range_headers, size=st.integers(1, 2**40))
@example(header="bytes=١-٢", size=100)
@example(header="bytes=-" + "9" * 5000, size=100)
def test_parse_range_returns_a_range_inside_the_file_or_416(header, size):
    want = reference_range(header, size)
    try:
        start, end = _parse_range(header, size)
    except ApiError as e:
        assert e.status == 416 and e.headers == {"Content-Range": f"bytes */{size}"}
        assert want is None, (header, want)
        return
    assert (start, end) == want and 0 <= start <= end < size


@FUZZ
@given(raw=st.text(max_size=14) | st.sampled_from(["²", "١", "０", "+1", "1_0", " 1", "1 ", "-0", "4294967296"]),
       limit=st.sampled_from([100_000, 2**31]))
def test_int_param_accepts_only_ascii_digits_below_the_limit(raw, limit):
    request = SimpleNamespace(match_info={"step": raw})  # int_param reads nothing else
    ok = raw != "" and len(raw) <= 10 and all(c in "0123456789" for c in raw) and int(raw) < limit
    try:
        value = int_param(request, "step", limit)
    except ApiError as e:
        assert e.status == 400 and not ok, raw
        return
    assert ok and value == int(raw)


# -- checkpoint manifest -----------------------------------------------------------------------------------
COORD = Identity.generate()
MANIFEST = sign_document(COORD, {
    "format": "prime-node/checkpoint/v1", "run_id": "run-1", "step": 1, "parent": H64, "encoding": "full",
    "base_step": None, "dtype": "bfloat16", "compression": {"codec": "zstd", "level": 1}, "shard_size": 4096,
    "total_size": 5000, "sha256": H64, "created_at": 1_700_000_000_000,
    "shards": [{"index": 0, "size": 4096, "zsize": 100, "sha256": H64},
               {"index": 1, "size": 904, "zsize": 50, "sha256": H64}]})


def test_the_sample_manifest_parses():
    assert Manifest.from_json_bytes(canonical_json(MANIFEST)).num_shards == 2


@FUZZ
@given(raw=hostile_bytes() | mutated(MANIFEST).map(
    lambda d: json.dumps(d, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")))
def test_manifest_parser_raises_only_checkpoint_error(raw):
    if raw.startswith(b"[" * 1024) or raw.startswith(b'{"a":' * 1024) or raw.startswith(b'{"node":' * 1024):
        return  # deep nesting: its own test below
    try:
        m = Manifest.from_json_bytes(raw)
    except CheckpointError:
        return
    bounded(m.to_dict())


def test_manifest_parser_refuses_deep_nesting_with_checkpoint_error():
    with pytest.raises(CheckpointError):
        Manifest.from_json_bytes(b"[" * 100_000)


# -- p2p shard protocol frames ------------------------------------------------------------------------------
@FUZZ
@given(raw=st.binary(max_size=1024) | json_like.map(lambda v: json.dumps(v).encode()[:1024])
       | st.fixed_dictionaries({"step": st.sampled_from(NASTY_INTS), "index": st.sampled_from(NASTY_INTS),
                                "manifest_hash": st.none() | st.sampled_from(NASTY_STRS + [H64]),
                                "max_bytes": st.sampled_from(NASTY_INTS)}).map(lambda d: json.dumps(d).encode()))
def test_shard_request_decoder_raises_only_bad_request(raw):
    try:
        req = decode_request(raw)
    except BadRequest:
        return
    bounded(req.model_dump(mode="json"))


def test_shard_request_decoder_refuses_deep_nesting_with_bad_request():
    with pytest.raises(BadRequest):
        decode_request(b"[" * 1024)


@FUZZ
@given(prefix=st.binary(min_size=4, max_size=4), header=st.binary(min_size=9, max_size=9))
def test_shard_frame_headers_raise_only_bad_request(prefix, header):
    try:
        n = parse_request_length(prefix)
        assert 1 <= n <= 1024 and n == struct.unpack(">I", prefix)[0]
    except BadRequest:
        pass
    try:
        status, length = decode_header(header)
        assert isinstance(status, Status) and 0 <= length < 2**64
    except BadRequest:
        pass


# -- p2p announcements --------------------------------------------------------------------------------------
PEER = Identity.generate()
NOW = 1_700_000_000_000
ANNOUNCEMENTS = [
    json.loads(encode_manifest_announcement(COORD, run_id="run-1", step=7, manifest_hash=H64, ts_ms=NOW)),
    json.loads(encode_have_announcement(PEER, run_id="run-1", step=7, manifest_hash=H64, indices=[0, 3],
                                        addrs=["/ip4/127.0.0.1/tcp/1"], ts_ms=NOW)),
]


def decode(raw: bytes):
    return decode_announcement(raw, run_id="run-1", coordinator_key=COORD.public_hex, origin_node_id=PEER.node_id,
                               max_age_s=60, now_ms=NOW)


def test_the_sample_announcements_decode():
    for doc in ANNOUNCEMENTS:
        assert decode(canonical_json(doc)).step == 7


@FUZZ
@given(raw=hostile_bytes() | st.sampled_from(ANNOUNCEMENTS).flatmap(mutated).map(
    lambda d: json.dumps(d, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")))
def test_announcement_decoder_raises_only_announcement_rejected(raw):
    if raw.startswith(b"[" * 1024) or raw.startswith(b'{"a":' * 1024) or raw.startswith(b'{"node":' * 1024):
        return  # deep nesting: its own test below
    try:
        ann = decode(raw)
    except AnnouncementRejected:
        return
    bounded(ann.model_dump(mode="json"))


def test_announcement_decoder_refuses_deep_nesting_with_announcement_rejected():
    with pytest.raises(AnnouncementRejected):
        decode(b"[" * 60_000)
