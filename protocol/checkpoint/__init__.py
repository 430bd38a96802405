"""Signed, sharded, zstd-compressed safetensors checkpoints (docs/PROTOCOL.md, "Checkpoint format").

A checkpoint is `CKPT/manifest.json` + `CKPT/shards/NNNNN.zst`. The raw payload is a deterministic
safetensors file of the full model state; it is cut into `shard_size` pieces, each compressed as one zstd
frame. Encodings: "full" (the pieces themselves), "xor-delta" (each piece XORed bytewise with the base step's
payload), "sparse-delta" (each piece as a block listing the words changed since the base step;
sparse.py) and "lora-adapter" (the payload is a LoRA adapter; the weights are a full base step's merged with it,
adapter.py). The manifest
lists every shard's raw size, compressed size and compressed sha256, the payload's sha256, and is signed
(Ed25519 over the canonical JSON of every other field).

Producer (coordinator):
    m0 = pack_checkpoint(state_or_path, "ckpt/0", identity=key, step=0, run_id="r", payload_out="p0")
    m1 = pack_checkpoint(state, "ckpt/1", identity=key, step=1, run_id="r", parent=m0, base_payload="p0",
                         encoding="sparse-delta")        # or "xor-delta" (the default with a base)
    # CheckpointError(code="delta_layout") -> pack step 1 with base_payload=None (full) instead.

Consumer (worker fetcher, relay, peer), shards from any untrusted source:
    m = Manifest.from_json_bytes(untrusted)                 # strict schema, size-bounded
    verify_manifest(m, {coordinator_hex}, previous=held)    # signature, signer, rollback, parent chain
    verify_shard(m, i, data)                                # per shard, before storing/forwarding it
    raw = decompress_shard(m, i, data)                      # exactly m.shards[i].size bytes, bomb-proof
    reconstruct_payload(m, reader, "model.safetensors", base_payload=held_payload)  # checks total sha256
    unpack_checkpoint("ckpt/1", "model_dir", trusted_keys={hex}, base="model_dir_of_step_0")
    tensors = load_payload("model_dir/model.safetensors")  # safetensors only; tied weights re-tied

Servers map a URL's `{index}` with `parse_shard_index` and read files with `DirShardReader` (no path
escapes, no symlinks). Every refusal is a `CheckpointError` whose `.code` is a short machine reason and
whose message names the shard or field. torch is imported only by the tensor-facing functions.
"""
from .adapter import adapter_pairs, check_adapter_base, merge_adapter_payload, merge_lora, write_state
from .codec import compress_shard, compress_shard_to, decompress_shard, verify_shard, xor_into
from .errors import CheckpointError
from .manifest import (ADAPTER_ENCODING, DEFAULT_SHARD_SIZE, DELTA_ENCODINGS, ENCODINGS, FORMAT, MAX_MANIFEST_BYTES, Manifest,
                       LoraSpec, ShardEntry, check_forward, check_parent, manifest_hash, sign_manifest, verify_manifest,
                       verify_signature)
from .pack import check_delta_compatible, pack_checkpoint
from .payload import (PayloadLayout, layout_from_files, layout_from_state, load_payload, open_layout,
                      parse_header, read_header_file, serialize_state)
from .reconstruct import (PAYLOAD_FILE_NAME, BasePayload, ShardDecoder, iter_payload, open_base,
                          reconstruct_payload, resolve_base, unpack_checkpoint)
from .shard_files import (MANIFEST_NAME, SHARDS_DIR, DirShardReader, load_manifest, parse_shard_index,
                          read_manifest_bytes, scan_shard_dir, shard_file_name, shard_relpath)
from .sparse import apply_block, encode_block

__all__ = [
    "manifest_hash", "ADAPTER_ENCODING", "LoraSpec", "adapter_pairs", "check_adapter_base", "merge_adapter_payload",
    "merge_lora", "write_state",
    "BasePayload", "CheckpointError", "DEFAULT_SHARD_SIZE", "DELTA_ENCODINGS", "DirShardReader", "ENCODINGS",
    "FORMAT", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "Manifest", "PAYLOAD_FILE_NAME", "PayloadLayout",
    "SHARDS_DIR", "ShardDecoder", "ShardEntry", "apply_block", "check_delta_compatible", "check_forward",
    "check_parent", "compress_shard", "compress_shard_to", "decompress_shard", "encode_block",
    "iter_payload", "layout_from_files", "layout_from_state", "load_manifest", "load_payload", "open_base",
    "open_layout", "pack_checkpoint", "parse_header", "parse_shard_index", "read_header_file",
    "read_manifest_bytes", "reconstruct_payload", "resolve_base", "scan_shard_dir", "serialize_state",
    "shard_file_name", "shard_relpath", "sign_manifest", "unpack_checkpoint", "verify_manifest",
    "verify_shard", "verify_signature", "xor_into",
]
