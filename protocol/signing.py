"""Canonical JSON and signed HTTP requests (docs/PROTOCOL.md, "Signed requests", run-bound v2).

The signed string is  METHOD \n PATH \n TIMESTAMP \n NONCE \n RUN_ID \n sha256_hex(BODY)
where PATH has no scheme/host and keeps its query string, and RUN_ID travels in `X-Prime-Run`: a
request captured from one run cannot be replayed to another coordinator. `RequestVerifier` enforces the
run, the 60 s clock window, and remembers nonces seen inside it, with bounded memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import SignatureError
from .identity import Identity, PUBLIC_KEY_HEX_LEN, verify_bytes

HEADER_KEY = "X-Prime-Key"
HEADER_TIMESTAMP = "X-Prime-Timestamp"
HEADER_NONCE = "X-Prime-Nonce"
HEADER_SIGNATURE = "X-Prime-Signature"
HEADER_RUN = "X-Prime-Run"
SIGNED_HEADERS = (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_RUN, HEADER_SIGNATURE)

CLOCK_WINDOW_MS = 60_000
NONCE_MIN_BYTES = 16
NONCE_MAX_HEX = 128


def _reject_constants(x: str) -> Any:
    raise ValueError(f"non-finite number {x} is not allowed in canonical JSON")


def canonical_json(obj: Any) -> bytes:
    """UTF-8, keys sorted, separators (",", ":"), no NaN/Infinity (raises ValueError)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def strict_json_loads(data: bytes | str) -> Any:
    """json.loads that refuses NaN/Infinity (Python accepts them by default) and reports nesting deeper
    than the parser's recursion limit as a ValueError like any other malformed document (untrusted
    input: 1 KiB of '[' would otherwise escape every caller as a RecursionError)."""
    try:
        return json.loads(data, parse_constant=_reject_constants)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def signing_string(method: str, path: str, timestamp: str, nonce: str, run_id: str, body: bytes) -> bytes:
    return "\n".join([method.upper(), path, timestamp, nonce, run_id, sha256_hex(body)]).encode()


def sign_request(identity: Identity, method: str, path: str, body: bytes, *, run_id: str,
                 timestamp_ms: int | None = None, nonce: str | None = None) -> dict[str, str]:
    """Return the five X-Prime-* headers for a request to run `run_id`."""
    ts = str(int(time.time() * 1000) if timestamp_ms is None else timestamp_ms)
    nonce = nonce or os.urandom(NONCE_MIN_BYTES).hex()
    sig = identity.sign(signing_string(method, path, ts, nonce, run_id, body))
    return {HEADER_KEY: identity.public_hex, HEADER_TIMESTAMP: ts, HEADER_NONCE: nonce, HEADER_RUN: run_id,
            HEADER_SIGNATURE: sig}


@dataclass(frozen=True)
class VerifiedRequest:
    signer: str  # node id (hex public key)
    timestamp_ms: int
    nonce: str


class RequestVerifier:
    """Checks signed requests: signature, clock window, replay. Thread-safe enough for one event loop.

    Nonces are remembered until their timestamp leaves the clock window. The store is capped at
    `max_nonces`: when full, requests are refused (`nonce_store_full`) rather than forgetting a nonce
    that could still be replayed.
    """

    def __init__(self, run_id: str, *, window_ms: int = CLOCK_WINDOW_MS, max_nonces: int = 1_000_000,
                 clock: Callable[[], int] | None = None):
        self.run_id = run_id
        self.window_ms = window_ms
        self.max_nonces = max_nonces
        self._clock = clock or (lambda: int(time.time() * 1000))
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce key -> expiry ms (insertion ordered)

    def _expire(self, now: int) -> None:
        while self._seen:
            key, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            self._seen.popitem(last=False)

    def check_headers(self, headers: Mapping[str, str]) -> str:
        """What can be checked before the body arrives: the five headers are present and well-formed, the
        timestamp is inside the clock window and the run is ours. Returns the (lower-case) key; raises
        SignatureError. Nothing is remembered: `verify` checks all of this again with the signature."""
        return self._check_headers(headers, self._clock())[0].lower()

    def _check_headers(self, headers: Mapping[str, str], now: int) -> tuple[str, str, str, str, str, int]:
        missing = [h for h in SIGNED_HEADERS if not headers.get(h)]
        if missing:
            raise SignatureError("missing_headers", f"missing signature headers: {', '.join(missing)}")
        key, ts, nonce, run_id, sig = (headers[h] for h in SIGNED_HEADERS)
        if len(key) != PUBLIC_KEY_HEX_LEN or not _is_hex(key):  # checked before the key is looked up
            raise SignatureError("bad_key", "X-Prime-Key must be 64 hex characters")
        if not (ts.isascii() and ts.isdigit() and len(ts) <= 16):  # int() would take "١٢", "1_0", " 12"
            raise SignatureError("bad_timestamp", "X-Prime-Timestamp must be Unix milliseconds (ASCII digits)")
        ts_ms = int(ts)
        if not (2 * NONCE_MIN_BYTES <= len(nonce) <= NONCE_MAX_HEX) or not _is_hex(nonce):
            raise SignatureError("bad_nonce", "X-Prime-Nonce must be 16 to 64 random bytes in hex")
        if abs(now - ts_ms) > self.window_ms:
            raise SignatureError("clock_skew", f"timestamp is {abs(now - ts_ms) / 1000:.0f} s off (limit 60 s)")
        if run_id != self.run_id:
            raise SignatureError("wrong_run", f"this coordinator runs {self.run_id!r}, the request is for "
                                              f"{run_id[:64]!r}")
        return key, ts, nonce, run_id, sig, ts_ms

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> VerifiedRequest:
        now = self._clock()
        key, ts, nonce, run_id, sig, ts_ms = self._check_headers(headers, now)
        if not verify_bytes(key, sig, signing_string(method, path, ts, nonce, run_id, body)):
            raise SignatureError("bad_signature", "signature does not match the request")
        self._expire(now)
        nonce_key = f"{key.lower()}:{nonce.lower()}"
        if nonce_key in self._seen:
            raise SignatureError("replay", "nonce already used (replayed request)")
        if len(self._seen) >= self.max_nonces:
            raise SignatureError("nonce_store_full", "too many requests in the replay window; retry later")
        # Remembered at least until the timestamp itself leaves the window.
        self._seen[nonce_key] = max(ts_ms, now) + self.window_ms
        return VerifiedRequest(signer=key.lower(), timestamp_ms=ts_ms, nonce=nonce)


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
        return True
    except ValueError:
        return False


def sign_document(identity: Identity, doc: Mapping[str, Any], *, field: str = "signature",
                  signer_field: str = "signer") -> dict[str, Any]:
    """Return a copy of `doc` with `signer` and a signature over the canonical JSON of every other field."""
    out = {k: v for k, v in doc.items() if k != field}
    out[signer_field] = identity.public_hex
    out[field] = identity.sign(canonical_json(out))
    return out


def verify_document(doc: Mapping[str, Any], trusted_keys: set[str] | None, *, field: str = "signature",
                    signer_field: str = "signer") -> str:
    """Verify a document signed by `sign_document`; return the signer. Raises SignatureError."""
    signer = doc.get(signer_field)
    sig = doc.get(field)
    if not isinstance(signer, str) or not isinstance(sig, str):
        raise SignatureError("unsigned", f"document has no {signer_field}/{field}")
    if trusted_keys is not None and signer.lower() not in {k.lower() for k in trusted_keys}:
        raise SignatureError("unknown_signer", f"signer {signer[:16]}… is not a trusted key")
    body = {k: v for k, v in doc.items() if k != field}
    try:
        payload = canonical_json(body)
    except (TypeError, ValueError) as e:
        raise SignatureError("bad_document", f"document is not canonical JSON: {e}") from None
    if not verify_bytes(signer, sig, payload):
        raise SignatureError("bad_signature", "signature does not match the document")
    return signer.lower()
