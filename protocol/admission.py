"""Admission to a run (docs/PROTOCOL.md, "Admission"): proof of work for new keys of open runs, join
tokens for token runs.

Proof of work (memory-hard): the join body carries `"pow": "<hex nonce>"` such that
    scrypt(password = raw public key ‖ run_id bytes ‖ nonce bytes, salt = POW_SALT,
           N = 2**pow_log2_n, r = 8, p = 1, dklen = 32)
starts with `pow_bits` zero bits. It is bound to the key and the run, so a solution is worth one key in one
run. A solver tries 2**pow_bits nonces on average; the coordinator checks one. Each try fills and reads
128 · r · N bytes (16 MiB at the default N = 2**14) in a data-dependent order, so it is bound by memory
bandwidth and latency rather than by arithmetic: a GPU gains ~350x over one CPU core here, where it gains
~1,400x on SHA-256 (docs/SECURITY.md, "Admission", has the measurements). Defaults: N = 2**14, 5 bits,
~1.5 s of one core here to join, ~46 ms and 16 MiB for the coordinator to check.

Join token: a document signed by the coordinator key (`sign_document`), base64url-encoded:
    {"format": "prime-node/join-token/v1", "run_id", "node_id" (hex key or null = any key),
     "expires_ms", "signer", "signature"}
No IO here: the coordinator decides with the clock it is given.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
from typing import Any

from .errors import PrimeNodeError, SignatureError
from .identity import Identity, parse_public_key
from .signing import canonical_json, sign_document, strict_json_loads, verify_document

TOKEN_FORMAT = "prime-node/join-token/v1"
MAX_POW_NONCE_HEX = 64
MAX_TOKEN_CHARS = 2048
POW_SALT = b"prime-node/join-pow/scrypt-v1"
POW_SCRYPT_R = 8  # scrypt's block size: 128 · r bytes per block (r = 8: 1 KiB)
POW_SCRYPT_P = 1  # no parallel lanes: a lane is one more try, not a faster one
MIN_POW_LOG2_N = 1
MAX_POW_LOG2_N = 16  # 64 MiB and ~0.2 s per scrypt: the most a coordinator (or a worker) is asked to spend
MAX_POW_BITS = 24  # 2**24 tries is months of one core: a config or a status asking more is a mistake


class AdmissionError(PrimeNodeError):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


def _raw_key(public_hex: str) -> bytes:
    parse_public_key(public_hex)  # ValueError unless a valid Ed25519 key
    return bytes.fromhex(public_hex)


def pow_memory_bytes(log2_n: int) -> int:
    """What one scrypt evaluation of the proof of work holds: 128 · r · N bytes."""
    return 128 * POW_SCRYPT_R * (1 << log2_n)


def pow_digest(public_hex: str, run_id: str, nonce: bytes, log2_n: int) -> bytes:
    """One try: scrypt of key ‖ run ‖ nonce (memory: `pow_memory_bytes(log2_n)`, freed on return)."""
    if not MIN_POW_LOG2_N <= log2_n <= MAX_POW_LOG2_N:
        raise ValueError(f"pow log2(N) {log2_n} outside [{MIN_POW_LOG2_N}, {MAX_POW_LOG2_N}]")
    return hashlib.scrypt(_raw_key(public_hex) + run_id.encode() + nonce, salt=POW_SALT, n=1 << log2_n,
                          r=POW_SCRYPT_R, p=POW_SCRYPT_P, maxmem=2 * pow_memory_bytes(log2_n) + (1 << 20), dklen=32)


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def check_pow(public_hex: str, run_id: str, nonce_hex: str | None, bits: int, log2_n: int) -> None:
    """Raises AdmissionError unless `nonce_hex` is a valid proof of `bits` zero bits. Costs one scrypt
    evaluation (`pow_memory_bytes(log2_n)` of memory) once the nonce's form is checked; the caller bounds how
    many run at once."""
    if bits <= 0:
        return
    if not nonce_hex:
        raise AdmissionError("pow_required", f"a new key joins this run with a proof of work of {bits} bits "
                                             f"(the \"pow\" field; see docs/PROTOCOL.md, \"Admission\")")
    if len(nonce_hex) > MAX_POW_NONCE_HEX:
        raise AdmissionError("bad_pow", f"pow nonce longer than {MAX_POW_NONCE_HEX} hex characters")
    try:
        nonce = bytes.fromhex(nonce_hex)
    except ValueError:
        raise AdmissionError("bad_pow", "pow nonce is not hex") from None
    if leading_zero_bits(pow_digest(public_hex, run_id, nonce, log2_n)) < bits:
        raise AdmissionError("bad_pow", f"proof of work has fewer than {bits} leading zero bits")


def solve_pow(public_hex: str, run_id: str, bits: int, log2_n: int) -> str:
    """A nonce (hex) for `check_pow`: about 2**bits scrypt evaluations (run it off the event loop)."""
    if not 0 <= bits <= MAX_POW_BITS:
        raise ValueError(f"pow bits {bits} outside [0, {MAX_POW_BITS}]")
    counter = int.from_bytes(os.urandom(4), "big") << 32  # two solvers never walk the same nonces
    while True:
        nonce = counter.to_bytes(8, "big")
        if leading_zero_bits(pow_digest(public_hex, run_id, nonce, log2_n)) >= bits:
            return nonce.hex()
        counter += 1


def make_join_token(identity: Identity, run_id: str, expires_ms: int, node_id: str | None = None) -> str:
    if node_id is not None:
        node_id = _raw_key(node_id).hex()
    doc = sign_document(identity, {"format": TOKEN_FORMAT, "run_id": run_id, "node_id": node_id,
                                   "expires_ms": int(expires_ms)})
    return _token_spelling(doc)


def _token_spelling(doc: dict[str, Any]) -> str:
    """The one spelling of a signed token document: base64url, no padding, of its canonical JSON."""
    return base64.urlsafe_b64encode(canonical_json(doc)).decode().rstrip("=")


def check_join_token(token: str | None, *, coordinator_key: str, run_id: str, node_id: str, now_ms: int) -> str:
    """Raises AdmissionError unless `token` admits `node_id` to `run_id` at `now_ms`; returns the token's
    identity, the key a coordinator records its use under: sha256 hex of its one spelling.

    A token has one spelling only (what `make_join_token` writes: base64url without padding of the canonical
    JSON, the signature in lower-case hex). Any other spelling of the same signed document (padding, the
    standard alphabet, JSON whitespace, key order, escapes, upper-case hex) decodes to a document that
    verifies, so it is refused here: otherwise each spelling would be "another token" to the ledger and one
    token would admit any number of keys. The identity is sha256(token) of that spelling, the key ledgers
    written before this check recorded, so their used tokens stay used."""
    if not token:
        raise AdmissionError("token_required", "this run admits nodes with a join token from its operator "
                                               "(--set worker.join_token=...)")
    if len(token) > MAX_TOKEN_CHARS:
        raise AdmissionError("bad_token", "join token is too long")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
        doc = strict_json_loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise AdmissionError("bad_token", "join token is not base64url JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != TOKEN_FORMAT:
        raise AdmissionError("bad_token", "not a prime-node join token")
    try:
        verify_document(doc, {coordinator_key})
    except SignatureError as e:
        raise AdmissionError("bad_token", f"join token: {e.detail}") from None
    if doc["signature"] != doc["signature"].lower() or _token_spelling(doc) != token:
        raise AdmissionError("bad_token", "join token is not spelled as the operator's tool wrote it (base64url "
                                          "of canonical JSON, no padding): copy it unchanged")
    if doc.get("run_id") != run_id:
        raise AdmissionError("bad_token", "join token is for another run")
    if doc.get("node_id") not in (None, node_id):
        raise AdmissionError("bad_token", "join token is for another key")
    expires = doc.get("expires_ms")
    if not isinstance(expires, int) or isinstance(expires, bool) or expires <= now_ms:
        raise AdmissionError("token_expired", "join token has expired; ask the operator for a new one")
    return hashlib.sha256(token.encode()).hexdigest()
