"""The signed checkpoint manifest (docs/PROTOCOL.md, "Manifest"): strict schema, signing, and the checks that
need no shard.

Everything here treats the manifest as untrusted input: it is size-bounded before parsing, validated by
a pydantic model with extra="forbid" and strict types (no bool-as-int, no float-as-int), and checked for
internal consistency (shard count and sizes must follow from total_size and shard_size) before anyone
allocates or downloads anything on its word.
"""
from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import SignatureError
from ..identity import Identity
from ..signing import canonical_json, sign_document, strict_json_loads, verify_document
from .errors import CheckpointError

FORMAT = "prime-node/checkpoint/v1"
DEFAULT_SHARD_SIZE = 32 * 1024 * 1024
MIN_SHARD_SIZE = 4 * 1024  # smaller shards only multiply per-shard overhead; tests use 64 KiB
MAX_SHARD_SIZE = 1024 * 1024 * 1024
MAX_SHARDS = 99_999  # shard files are named NNNNN.zst: five digits
MAX_TOTAL_SIZE = 4 * 1024 ** 4  # 4 TiB: far above any model this runs, far below int overflow games
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # ~150 bytes per shard entry * MAX_SHARDS, with room to spare
MIN_PAYLOAD_SIZE = 8  # a safetensors file starts with an 8-byte header length

# Encodings a reader of this version knows (docs/PROTOCOL.md). A delta needs the base step's raw payload.
ENCODINGS = ("full", "xor-delta", "sparse-delta", "lora-adapter")
DELTA_ENCODINGS = ("xor-delta", "sparse-delta")
# A LoRA adapter (protocol/checkpoint/adapter.py): its payload is the adapter tensors alone, a plain safetensors
# file like a full one's; the weights are the base step's full payload merged with it (`lora` says how).
ADAPTER_ENCODING = "lora-adapter"
MAX_LORA_RANK = 2048  # trainer.lora.rank <= 1024; a published adapter may stack two of them (publisher.py)
MAX_LORA_ALPHA = 1 << 20
# A sparse-delta shard decompresses to one block: a 16-byte header, then at most the raw range's length
# (the dense fallback is header + XOR of the range). protocol/checkpoint/sparse.py holds the format.
SPARSE_BLOCK_HEADER = 16

_HEX64 = r"^[0-9a-f]{64}$"
_HEX128 = r"^[0-9a-f]{128}$"


def max_compressed_size(size: int) -> int:
    """Upper bound of a zstd frame for `size` input bytes (ZSTD_compressBound plus slack)."""
    return size + (size >> 7) + 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ShardEntry(_Strict):
    index: int = Field(ge=0, le=MAX_SHARDS - 1)
    size: int = Field(ge=1, le=MAX_SHARD_SIZE)
    zsize: int = Field(ge=1, le=max_compressed_size(MAX_SHARD_SIZE))
    sha256: str = Field(pattern=_HEX64)


class Compression(_Strict):
    codec: Literal["zstd"]
    level: int = Field(ge=-131072, le=22)


class LoraSpec(_Strict):
    """What merging a `lora-adapter` payload into its base needs, signed (docs/PROTOCOL.md, "lora-adapter"):
    `base` is the manifest hash of the full checkpoint of `base_step`; every weight named by an adapter pair
    becomes W + (alpha / rank) * B @ A."""

    base: str = Field(pattern=_HEX64)
    rank: int = Field(ge=1, le=MAX_LORA_RANK)
    alpha: int = Field(ge=1, le=MAX_LORA_ALPHA)


def manifest_hash(doc: dict[str, Any]) -> str:
    """sha256 hex of a manifest document's canonical JSON without its `signature` (the manifest's
    `parent`, docs/PROTOCOL.md, "Manifest"; what peers name a step by). Defined once: `Manifest.canonical_hash`
    and the peer shard stores use it."""
    return hashlib.sha256(canonical_json({k: v for k, v in doc.items() if k != "signature"})).hexdigest()


class Manifest(_Strict):
    """A parsed, schema-valid manifest. Signature and chain are checked by `verify_manifest`."""

    format: Literal["prime-node/checkpoint/v1"]
    run_id: str = Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    step: int = Field(ge=0, le=2 ** 53)
    parent: Optional[str] = Field(pattern=_HEX64)
    encoding: Literal["full", "xor-delta", "sparse-delta", "lora-adapter"]
    base_step: Optional[int] = Field(ge=0, le=2 ** 53)
    # Only in a `lora-adapter` manifest; absent (not null) in every other, so their documents, hashes and
    # signatures are those of a reader that never heard of it (`to_dict` leaves it out).
    lora: Optional[LoraSpec] = None
    dtype: str = Field(pattern=r"^[a-z0-9_]{1,32}$")
    compression: Compression
    shard_size: int = Field(ge=MIN_SHARD_SIZE, le=MAX_SHARD_SIZE)
    total_size: int = Field(ge=MIN_PAYLOAD_SIZE, le=MAX_TOTAL_SIZE)
    sha256: str = Field(pattern=_HEX64)
    shards: list[ShardEntry] = Field(min_length=1, max_length=MAX_SHARDS)
    created_at: int = Field(ge=0, le=2 ** 53)
    signer: str = Field(pattern=_HEX64)
    signature: str = Field(pattern=_HEX128)

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        # Each message names the field, so a refused manifest says exactly what is wrong with it.
        if self.encoding == "full" and self.base_step is not None:
            raise ValueError("base_step must be null for encoding 'full'")
        if (self.encoding == ADAPTER_ENCODING) != (self.lora is not None):
            raise ValueError("lora is required for encoding 'lora-adapter' and allowed for no other")
        if self.encoding in DELTA_ENCODINGS or self.encoding == ADAPTER_ENCODING:
            if self.base_step is None:
                raise ValueError(f"base_step is required for encoding '{self.encoding}'")
            if self.base_step >= self.step:
                raise ValueError(f"base_step {self.base_step} must be before step {self.step}")
        if self.step == 0 and self.parent is not None:
            raise ValueError("step 0 cannot have a parent")
        expected = math.ceil(self.total_size / self.shard_size)
        if len(self.shards) != expected:
            raise ValueError(f"shards: {len(self.shards)} entries, but total_size {self.total_size} / "
                             f"shard_size {self.shard_size} needs {expected}")
        for i, entry in enumerate(self.shards):
            if entry.index != i:
                raise ValueError(f"shards[{i}].index is {entry.index}, expected {i}")
            raw = min(self.shard_size, self.total_size - i * self.shard_size)
            if self.encoding == "sparse-delta":
                # `size` is what the shard decompresses to: one encoded block for this raw range.
                if not (SPARSE_BLOCK_HEADER <= entry.size <= SPARSE_BLOCK_HEADER + raw):
                    raise ValueError(f"shards[{i}].size is {entry.size}, impossible for a sparse-delta block "
                                     f"of {raw} raw bytes ({SPARSE_BLOCK_HEADER}..{SPARSE_BLOCK_HEADER + raw})")
            elif entry.size != raw:
                raise ValueError(f"shards[{i}].size is {entry.size}, expected {raw}")
            if entry.zsize > max_compressed_size(entry.size):
                raise ValueError(f"shards[{i}].zsize {entry.zsize} is impossible for {entry.size} raw bytes")
        return self

    # --- construction and serialization -------------------------------------------------------
    @classmethod
    def from_dict(cls, doc: Any) -> "Manifest":
        if not isinstance(doc, dict):
            raise CheckpointError("manifest_schema", "manifest is not a JSON object")
        encoding = doc.get("encoding")
        if isinstance(encoding, str) and encoding not in ENCODINGS:
            # Said plainly, before the schema: a newer coordinator may use an encoding this reader lacks.
            shown = encoding[:40] + ("…" if len(encoding) > 40 else "")
            raise CheckpointError("unknown_encoding", f"field 'encoding': {shown!r} is not an encoding this "
                                                      f"reader knows ({', '.join(ENCODINGS)}); upgrade "
                                                      "prime-node or fetch a full checkpoint")
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            raise CheckpointError("manifest_schema", f"manifest invalid: {_first_error(e)}") from None

    @classmethod
    def from_json_bytes(cls, data: bytes) -> "Manifest":
        """Strict parse of untrusted bytes (size-bounded, no NaN, schema + consistency checked)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise CheckpointError("manifest_too_large",
                                  f"manifest is {len(data)} bytes (limit {MAX_MANIFEST_BYTES})")
        try:
            doc = strict_json_loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError("manifest_schema", f"manifest is not valid JSON: {e}") from None
        return cls.from_dict(doc)

    def to_dict(self) -> dict[str, Any]:
        doc = self.model_dump(mode="json")
        if doc["lora"] is None:
            del doc["lora"]
        return doc

    def to_json_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    def canonical_hash(self) -> str:
        """sha256 hex of the canonical JSON without `signature`: what the next step's `parent` holds."""
        return manifest_hash(self.to_dict())

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def compressed_size(self) -> int:
        return sum(s.zsize for s in self.shards)

    @property
    def is_delta(self) -> bool:
        """True when reconstructing this step needs the raw payload of `base_step`."""
        return self.encoding in DELTA_ENCODINGS

    @property
    def is_adapter(self) -> bool:
        """True for a LoRA adapter: its payload rebuilds alone, the weights need the full payload of
        `base_step` (protocol/checkpoint/adapter.py)."""
        return self.encoding == ADAPTER_ENCODING

    def shard_offset(self, index: int) -> int:
        return index * self.shard_size

    def raw_size(self, index: int) -> int:
        """Raw payload bytes covered by shard `index` (equal to its `size` except for sparse-delta)."""
        return min(self.shard_size, self.total_size - index * self.shard_size)

    def describe(self) -> str:
        base = f", base step {self.base_step}" if self.is_delta or self.is_adapter else ""
        return (f"step {self.step} of run {self.run_id} ({self.encoding}{base}, {self.dtype}, "
                f"{self.num_shards} shards, {self.total_size / 1e6:.1f} MB raw, "
                f"{self.compressed_size / 1e6:.1f} MB compressed)")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    msg = err.get("msg", "invalid")
    return f"field '{loc}': {msg}" if loc else msg


def sign_manifest(identity: Identity, fields: dict[str, Any]) -> Manifest:
    """Sign the unsigned fields (everything but signer/signature) and return the validated Manifest."""
    doc = dict(fields)
    doc.setdefault("format", FORMAT)
    doc.setdefault("created_at", int(time.time() * 1000))
    return Manifest.from_dict(sign_document(identity, doc))


def verify_signature(manifest: Manifest, trusted_keys: set[str] | None) -> str:
    """Check signer is trusted and the signature covers every other field; return the signer."""
    try:
        return verify_document(manifest.to_dict(), trusted_keys)
    except SignatureError as e:
        code = "unknown_signer" if e.code == "unknown_signer" else "bad_signature"
        raise CheckpointError(code, f"manifest of step {manifest.step}: {e.detail}") from None


def check_forward(manifest: Manifest, previous: Manifest) -> None:
    """Refuse a manifest that is not a forward step of the same run from `previous` (what we hold).

    `parent` must chain when the step is the very next one; across a gap the intermediate manifests are
    unknown to us, so only forward motion and the run id can be checked (documented in PROTOCOL.md).
    """
    if manifest.run_id != previous.run_id:
        raise CheckpointError("run_mismatch", f"manifest is for run {manifest.run_id!r}, "
                                              f"but the held checkpoint is from run {previous.run_id!r}")
    if manifest.step <= previous.step:
        raise CheckpointError("rollback", f"step {manifest.step} does not move forward from step "
                                          f"{previous.step} already held")
    if manifest.step == previous.step + 1:
        check_parent(manifest, previous)


def check_parent(manifest: Manifest, parent: Manifest) -> None:
    """Strict chain check: `manifest.parent` must be the hash of `parent` (given as its parent)."""
    want = parent.canonical_hash()
    if manifest.parent != want:
        got = "null" if manifest.parent is None else manifest.parent[:16] + "…"
        raise CheckpointError("parent_chain", f"field 'parent' of step {manifest.step} is {got}, but the "
                                              f"manifest of step {parent.step} hashes to {want[:16]}…")
    if manifest.step <= parent.step:
        raise CheckpointError("rollback", f"step {manifest.step} does not move forward from its parent's "
                                          f"step {parent.step}")
    if manifest.run_id != parent.run_id:
        raise CheckpointError("run_mismatch", f"run {manifest.run_id!r} differs from its parent's run "
                                              f"{parent.run_id!r}")


def verify_manifest(manifest: Manifest, trusted_keys: set[str] | None, *,
                    previous: Manifest | None = None) -> str:
    """Signature + trusted signer, then (if `previous` is the manifest the verifier holds) forward motion
    and the parent chain. Returns the signer hex. `trusted_keys=None` accepts any signer (integrity only)."""
    signer = verify_signature(manifest, trusted_keys)
    if previous is not None:
        check_forward(manifest, previous)
    return signer
