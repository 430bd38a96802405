"""Wire format of the shard exchange protocol `/prime-node/shard/1.0.0` (pure, no I/O).

Request  (client -> server): u32 big-endian length, then that many bytes of JSON
         {"step": n, "index": i, "manifest_hash": hex|null, "max_bytes": m}   (≤ 1 KiB)
Response (server -> client): 1 byte status, u64 big-endian length, then `length` bytes:
         the compressed shard for OK, a short UTF-8 reason for any other status (≤ 1 KiB).
The server closes its side after the response; one request per stream.

The shard bytes are opaque here: the caller checks them against the signed manifest.
`manifest_hash` lets a server refuse to serve the same step number of a different checkpoint
(another run, or a re-published step) instead of wasting a transfer that would fail the hash check.
"""
from __future__ import annotations

import enum
import struct

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.signing import canonical_json, strict_json_loads

from .announce import HexHash, MAX_SHARD_INDEX, MAX_STEP

PROTOCOL_ID = "/prime-node/shard/1.0.0"
MAX_REQUEST_BYTES = 1024
MAX_REASON_BYTES = 1024
REQUEST_PREFIX = struct.Struct(">I")
RESPONSE_HEADER = struct.Struct(">BQ")
# What one write of shard bytes should carry so that it crosses as ONE yamux DATA frame in ONE Noise transport
# message: Noise carries at most 65535 - 16 (the Poly1305 tag) = 65519 plaintext bytes per message, and yamux puts a
# 12-byte header in front of each frame (py-libp2p 0.8.1: MAX_PLAINTEXT_LENGTH in libp2p/security/noise/io.py,
# HEADER_SIZE in libp2p/stream_muxer/yamux/yamux.py). A 64 KiB write crossed as 2 frames (65524 + 12 bytes) and
# 3 Noise messages, each with its own Python trip through yamux, Noise, msgio and the socket on both ends
# (docs/P2P.md, "Shard throughput over libp2p"). tests/unit/test_p2p_throughput.py checks these against libp2p's.
NOISE_MAX_PLAINTEXT = 65535 - 16
YAMUX_HEADER_BYTES = 12
FRAME_PAYLOAD_BYTES = NOISE_MAX_PLAINTEXT - YAMUX_HEADER_BYTES


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    BUSY = 2
    BAD_REQUEST = 3
    TOO_LARGE = 4
    ERROR = 5


class ShardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    step: int = Field(ge=0, le=MAX_STEP)
    index: int = Field(ge=0, le=MAX_SHARD_INDEX)
    manifest_hash: HexHash | None = None
    # The client's own limit, so the server can refuse up front instead of sending bytes for nothing.
    max_bytes: int = Field(ge=1, le=2**40)


class BadRequest(ValueError):
    pass


def encode_request(req: ShardRequest) -> bytes:
    body = canonical_json(req.model_dump())
    return REQUEST_PREFIX.pack(len(body)) + body


def parse_request_length(prefix: bytes) -> int:
    (n,) = REQUEST_PREFIX.unpack(prefix)
    if not 0 < n <= MAX_REQUEST_BYTES:
        raise BadRequest(f"request length {n} is outside 1..{MAX_REQUEST_BYTES}")
    return n


def decode_request(body: bytes) -> ShardRequest:
    try:
        raw = strict_json_loads(body)
        return ShardRequest.model_validate(raw)
    except (ValueError, UnicodeDecodeError) as e:  # ValidationError is a ValueError
        detail = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
        raise BadRequest(f"malformed shard request: {detail}"[:200]) from None


def encode_header(status: Status, length: int) -> bytes:
    return RESPONSE_HEADER.pack(int(status), length)


def encode_error(status: Status, reason: str) -> bytes:
    body = reason.encode()[:MAX_REASON_BYTES]
    return encode_header(status, len(body)) + body


def decode_header(header: bytes) -> tuple[Status, int]:
    code, length = RESPONSE_HEADER.unpack(header)
    try:
        return Status(code), length
    except ValueError:
        raise BadRequest(f"unknown response status {code}") from None
