import os
import stat

import pytest

from protocol.errors import KeyFileError, SignatureError
from protocol.identity import Identity, verify_bytes
from protocol.signing import (
    RequestVerifier, canonical_json, sign_document, sign_request, strict_json_loads, verify_document,
)


def test_key_file_round_trip_and_mode(tmp_path):
    ident = Identity.generate()
    path = ident.save(tmp_path / "node.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).public_hex == ident.public_hex
    assert len(ident.node_id) == 64 and ident.node_id == ident.node_id.lower()
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        ident.save(path)


def test_world_readable_key_is_refused(tmp_path):
    path = Identity.generate().save(tmp_path / "k")
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load(path)


def test_garbage_key_file(tmp_path):
    p = tmp_path / "k"
    p.write_bytes(b"not a key")
    os.chmod(p, 0o600)
    with pytest.raises(KeyFileError, match="not a PEM"):
        Identity.load(p)


def test_canonical_json():
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError):
        strict_json_loads('{"x": NaN}')


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


RUN = "run-a"


def _signed(ident, body=b'{"a":1}', path="/v1/work", ts=1_000_000, run_id=RUN):
    return sign_request(ident, "POST", path, body, run_id=run_id, timestamp_ms=ts), body


def test_request_round_trip():
    ident = Identity.generate()
    v = RequestVerifier(RUN, clock=Clock(1_000_000))
    headers, body = _signed(ident)
    assert v.verify("POST", "/v1/work", headers, body).signer == ident.node_id


@pytest.mark.parametrize("case,code", [
    ("bad_signature", "bad_signature"),
    ("body_changed", "bad_signature"),
    ("path_changed", "bad_signature"),
    ("method_changed", "bad_signature"),
    ("stale", "clock_skew"),
    ("future", "clock_skew"),
    ("missing", "missing_headers"),
    ("short_nonce", "bad_nonce"),
    ("other_run", "wrong_run"),  # a request captured from one run, replayed to another coordinator
    ("run_header_changed", "bad_signature"),  # the run id is inside the signed string
    ("no_run_header", "missing_headers"),  # a v1 (unbound) request
])
def test_request_rejections(case, code):
    ident = Identity.generate()
    now = 1_000_000_000
    v = RequestVerifier(RUN, clock=Clock(now))
    headers, body = _signed(ident, ts=now)
    method, path = "POST", "/v1/work"
    if case == "bad_signature":
        headers["X-Prime-Signature"] = Identity.generate().sign(b"x")
    elif case == "body_changed":
        body = b'{"a":2}'
    elif case == "path_changed":
        path = "/v1/submit"
    elif case == "method_changed":
        method = "PUT"
    elif case == "stale":
        headers, body = _signed(ident, ts=now - 61_000)
    elif case == "future":
        headers, body = _signed(ident, ts=now + 61_000)
    elif case == "missing":
        del headers["X-Prime-Nonce"]
    elif case == "short_nonce":
        headers = sign_request(ident, "POST", path, body, run_id=RUN, timestamp_ms=now, nonce="ab" * 8)
    elif case == "other_run":
        headers, body = _signed(ident, ts=now, run_id="run-b")
    elif case == "run_header_changed":  # signed for run-a, relabelled for a coordinator of run-b
        v = RequestVerifier("run-b", clock=Clock(now))
        headers["X-Prime-Run"] = "run-b"
    elif case == "no_run_header":
        del headers["X-Prime-Run"]
    with pytest.raises(SignatureError) as e:
        v.verify(method, path, headers, body)
    assert e.value.code == code


def test_replay_rejected_inside_window_and_forgotten_after():
    ident = Identity.generate()
    clock = Clock(5_000_000)
    v = RequestVerifier(RUN, clock=clock)
    headers, body = _signed(ident, ts=clock.t)
    v.verify("POST", "/v1/work", headers, body)
    clock.t += 59_000
    with pytest.raises(SignatureError) as e:
        v.verify("POST", "/v1/work", headers, body)
    assert e.value.code == "replay"
    clock.t += 10_000  # the original timestamp is now outside the window: rejected as skew, not remembered
    with pytest.raises(SignatureError) as e:
        v.verify("POST", "/v1/work", headers, body)
    assert e.value.code == "clock_skew"
    h2, b2 = _signed(ident, ts=clock.t)
    v.verify("POST", "/v1/work", h2, b2)
    assert len(v._seen) == 1  # the expired nonce was forgotten: memory stays bounded by the window


def test_nonce_store_is_bounded():
    ident = Identity.generate()
    v = RequestVerifier(RUN, clock=Clock(1_000_000), max_nonces=3)
    for _ in range(3):
        h, b = _signed(ident)
        v.verify("POST", "/v1/work", h, b)
    h, b = _signed(ident)
    with pytest.raises(SignatureError) as e:
        v.verify("POST", "/v1/work", h, b)
    assert e.value.code == "nonce_store_full"


def test_signed_document():
    ident = Identity.generate()
    doc = sign_document(ident, {"step": 3, "x": [1, 2]})
    assert verify_document(doc, {ident.public_hex}) == ident.public_hex
    with pytest.raises(SignatureError) as e:
        verify_document({**doc, "step": 4}, {ident.public_hex})
    assert e.value.code == "bad_signature"
    with pytest.raises(SignatureError) as e:
        verify_document(doc, {Identity.generate().public_hex})
    assert e.value.code == "unknown_signer"
    assert verify_bytes(ident.public_hex, ident.sign(b"m"), b"m")
    assert not verify_bytes(ident.public_hex, "zz" * 64, b"m")
