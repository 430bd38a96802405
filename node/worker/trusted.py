"""Which manifests a node trusts, decided without IO (in the manner of python-tuf's trusted metadata
set): the fetcher hands in bytes from any untrusted source and gets a verified `Manifest` or a
`CheckpointError` saying why not."""
from __future__ import annotations

from protocol.checkpoint import CheckpointError, Manifest, check_parent, verify_manifest


class TrustedManifests:
    def __init__(self, coordinator_key: str):
        self.key = coordinator_key.lower()

    def accept(self, raw: bytes, step: int, *, newest_held: Manifest | None, parent: Manifest | None) -> Manifest:
        """`raw` as the manifest of `step`: strict schema, signed by the pinned coordinator key, moving
        forward from the newest step held (no rollback), chained to the previous step when it is held."""
        m = Manifest.from_json_bytes(raw)
        verify_manifest(m, {self.key}, previous=newest_held)
        if m.step != step:
            raise CheckpointError("manifest_schema", f"asked for step {step}, got {m.step}")
        if parent is not None:
            check_parent(m, parent)
        return m
