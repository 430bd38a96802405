"""Gossip announcements: their schema, signing, and the checks every received one must pass.

Two kinds travel on the per-run topic `/prime-node/<run_id>/announce`:
- `manifest`: "the signed manifest for step n is available" (manifest hash + step), signed by the
  coordinator key; whoever relays it does not matter, the signature does.
- `have`: "I hold shards [..] of step n", signed by the announcing node, whose key must be the one
  its libp2p peer id embeds (gossipsub's own message signature proves who originated the message,
  our document signature proves who made the claim; both must be the same key).

Pure: no libp2p, no I/O. The trio side hands in the bytes and the origin's node id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from protocol.errors import SignatureError
from protocol.identity import Identity
from protocol.signing import canonical_json, sign_document, strict_json_loads, verify_document

from .errors import AnnouncementRejected

MAX_ANNOUNCEMENT_BYTES = 64 * 1024
MAX_INDICES = 4096  # a 7B bf16 model is ~430 shards of 32 MiB; 4096 indices still fit in 64 KiB
MAX_SHARD_INDEX = 99_999  # shard files are named NNNNN.zst (docs/PROTOCOL.md, "Layout")
MAX_ADDRS = 8
MAX_STEP = 2**53  # JSON-safe integer

HexHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
HexSig = Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]
RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
ShardIndex = Annotated[int, Field(ge=0, le=MAX_SHARD_INDEX)]
Addr = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^/[\x21-\x7e]+$")]


class _Signed(BaseModel):
    # strict: the signature covers the JSON as received, so no silent coercion ("1" -> 1) may
    # make the validated object differ from what was signed.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    run_id: RunId
    step: Step
    manifest_hash: HexHash
    ts_ms: int = Field(ge=0)
    signer: HexKey
    signature: HexSig


class ManifestAnnouncement(_Signed):
    kind: Literal["manifest"]


class HaveAnnouncement(_Signed):
    kind: Literal["have"]
    indices: list[ShardIndex] = Field(min_length=1, max_length=MAX_INDICES)
    # Where the announcer can be dialled (empty for an outbound-only node).
    addrs: list[Addr] = Field(default_factory=list, max_length=MAX_ADDRS)


Announcement = Annotated[Union[ManifestAnnouncement, HaveAnnouncement], Field(discriminator="kind")]
_ANNOUNCEMENT = TypeAdapter(Announcement)


@dataclass(frozen=True)
class AnnouncementEvent:
    """A validated announcement as delivered to subscribers. `peer_id` is the gossip originator."""

    announcement: ManifestAnnouncement | HaveAnnouncement
    peer_id: str


def topic_for_run(run_id: str) -> str:
    return f"/prime-node/{run_id}/announce"


def _now_ms() -> int:
    return int(time.time() * 1000)


def encode_manifest_announcement(identity: Identity, *, run_id: str, step: int, manifest_hash: str,
                                 ts_ms: int | None = None) -> bytes:
    doc = {"kind": "manifest", "run_id": run_id, "step": step, "manifest_hash": manifest_hash,
           "ts_ms": _now_ms() if ts_ms is None else ts_ms}
    return _finish(identity, doc)


def encode_have_announcement(identity: Identity, *, run_id: str, step: int, manifest_hash: str,
                             indices: list[int], addrs: Sequence[str] = (), ts_ms: int | None = None) -> bytes:
    doc = {"kind": "have", "run_id": run_id, "step": step, "manifest_hash": manifest_hash,
           "indices": sorted(set(indices)), "addrs": list(addrs)[:MAX_ADDRS],
           "ts_ms": _now_ms() if ts_ms is None else ts_ms}
    return _finish(identity, doc)


def _finish(identity: Identity, doc: dict) -> bytes:
    signed = sign_document(identity, doc)
    try:
        _ANNOUNCEMENT.validate_python(signed)  # never send what a peer would drop
    except ValidationError as e:
        raise ValueError(f"announcement is invalid: {_first_error(e)}") from None
    data = canonical_json(signed)
    if len(data) > MAX_ANNOUNCEMENT_BYTES:
        raise ValueError(f"announcement is {len(data)} bytes (limit {MAX_ANNOUNCEMENT_BYTES})")
    return data


def decode_announcement(data: bytes, *, run_id: str, coordinator_key: str | None, origin_node_id: str | None,
                        max_age_s: float, now_ms: int | None = None) -> ManifestAnnouncement | HaveAnnouncement:
    """Validate a received announcement or raise AnnouncementRejected(reason, detail).

    `origin_node_id`: the node id bound to the gossip message's (libp2p-signed) originator, or None
    if it has none. `coordinator_key`: hex key trusted for manifest announcements (None: trust none).
    The same as `verify_announcement(precheck_announcement(...))`.
    """
    return verify_announcement(precheck_announcement(data, run_id=run_id, coordinator_key=coordinator_key,
                                                     origin_node_id=origin_node_id, max_age_s=max_age_s,
                                                     now_ms=now_ms))


@dataclass(frozen=True)
class CheckedAnnouncement:
    """An announcement that passed every check but its signature (never enough to accept it)."""

    announcement: ManifestAnnouncement | HaveAnnouncement
    document: dict


def precheck_announcement(data: bytes, *, run_id: str, coordinator_key: str | None, origin_node_id: str | None,
                          max_age_s: float, now_ms: int | None = None) -> CheckedAnnouncement:
    """Every check that costs no cryptography, cheapest first: size, JSON, schema, run, key binding,
    timestamp. Raises AnnouncementRejected. The service runs it before libp2p's signature check."""
    if len(data) > MAX_ANNOUNCEMENT_BYTES:
        raise AnnouncementRejected("too_large", f"announcement is {len(data)} bytes (limit {MAX_ANNOUNCEMENT_BYTES})")
    try:
        raw = strict_json_loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise AnnouncementRejected("malformed", f"announcement is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AnnouncementRejected("malformed", "announcement is not a JSON object")
    if "signature" not in raw or "signer" not in raw:
        raise AnnouncementRejected("unsigned", "announcement has no signer/signature")
    try:
        ann = _ANNOUNCEMENT.validate_python(raw)
    except ValidationError as e:
        raise AnnouncementRejected("malformed", f"announcement does not match the schema: {_first_error(e)}") from None
    if ann.run_id != run_id:
        raise AnnouncementRejected("wrong_run", f"announcement is for run {ann.run_id!r}, not {run_id!r}")
    if isinstance(ann, ManifestAnnouncement):
        if coordinator_key is None or ann.signer != coordinator_key.lower():
            raise AnnouncementRejected("wrong_key", "manifest announcement is not signed by the coordinator")
    elif origin_node_id is None or ann.signer != origin_node_id.lower():
        raise AnnouncementRejected("wrong_key", "have announcement is signed by a key other than its sender's")
    now = _now_ms() if now_ms is None else now_ms
    if abs(now - ann.ts_ms) > max_age_s * 1000:
        raise AnnouncementRejected("stale", f"announcement timestamp is {abs(now - ann.ts_ms) / 1000:.0f} s off")
    return CheckedAnnouncement(ann, raw)


def verify_announcement(checked: CheckedAnnouncement) -> ManifestAnnouncement | HaveAnnouncement:
    """The Ed25519 check of the document signature (the expensive part); raises AnnouncementRejected."""
    ann = checked.announcement
    try:
        verify_document(checked.document, {ann.signer})
    except SignatureError as e:
        raise AnnouncementRejected("bad_signature", f"announcement signature is invalid: {e.detail}") from None
    return ann


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg', 'invalid')}"[:200]
