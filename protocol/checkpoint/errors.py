"""The one error type of the checkpoint format: a short machine code plus a sentence naming the culprit."""
from __future__ import annotations

from ..errors import PrimeNodeError


class CheckpointError(PrimeNodeError):
    """A checkpoint (or a piece of one) was refused.

    `code` is a short machine reason, stable for callers to branch on (a fetcher retries another peer on
    "shard_hash" but gives up on "bad_signature"). Codes: manifest_schema, manifest_too_large,
    missing_manifest, bad_signature, unknown_signer, rollback, run_mismatch, parent_chain, shard_index, shard_size,
    shard_hash, decompress_bomb, decompress_error, missing_shard, extra_shard, bad_shard_name,
    payload_hash, base_mismatch, delta_layout, bad_payload, out_exists, step_mismatch (URL vs manifest),
    io_error, unknown_encoding (an encoding this version does not know), bad_delta (a sparse-delta block
    that does not fit its shard), bad_adapter (a lora-adapter payload whose tensors do not make a LoRA of its
    base: names, shapes, rank).
    `shard` is the shard index the failure is about, or None.
    """

    def __init__(self, code: str, detail: str, *, shard: int | None = None):
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.shard = shard

    def line(self) -> str:
        """One report line: `[code] detail`."""
        return f"[{self.code}] {self.detail}"
