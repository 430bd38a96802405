"""`prime-node checkpoint pack|unpack` handlers. torch is never needed: packing reads safetensors files."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from protocol.checkpoint import (CheckpointError, load_manifest, pack_checkpoint, resolve_base,
                                 unpack_checkpoint, verify_manifest)
from protocol.errors import PrimeNodeError
from protocol.identity import Identity, public_key_arg


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def cmd_pack(args) -> int:
    identity = Identity.load(args.key)
    progress = sys.stderr.isatty()
    parent = None
    if args.parent:
        parent = load_manifest(args.parent)
        try:
            verify_manifest(parent, {identity.public_hex})
        except CheckpointError as e:
            raise CheckpointError(e.code, f"parent {args.parent}: {e.detail}") from None
        if parent.run_id != args.run_id:
            raise PrimeNodeError(f"parent {args.parent} belongs to run {parent.run_id!r}; "
                                 f"pass --run-id {parent.run_id}")
        if args.step <= parent.step:
            raise PrimeNodeError(f"--step {args.step} does not move forward from parent step {parent.step}")
    want_delta = parent is not None and args.encoding != "full"
    explicit = args.encoding in ("xor-delta", "sparse-delta")
    delta_encoding = args.encoding if explicit else "xor-delta"  # the default with --parent
    if explicit and parent is None:
        raise PrimeNodeError(f"--encoding {args.encoding} needs --parent (the base step's checkpoint)")
    if want_delta and parent is not None and parent.encoding != "full":
        if explicit:
            raise PrimeNodeError(f"parent {args.parent} is itself a {parent.encoding}, so its full payload cannot "
                                 "be rebuilt from it alone; use --encoding full or a full parent")
        _note(f"parent is a {parent.encoding} checkpoint; packing this step as full")
        want_delta = False
    out = Path(args.out).absolute()
    if out.exists():
        raise PrimeNodeError(f"{args.out} already exists; refusing to overwrite a checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".pack-base-", dir=out.parent) as work:
        base = resolve_base(args.parent, {identity.public_hex}, work, progress=progress) if want_delta else None
        common = dict(identity=identity, step=args.step, run_id=args.run_id, parent=parent,
                      shard_size=args.shard_size, level=args.level, progress=progress)
        try:
            manifest = pack_checkpoint(args.model, args.out, base_payload=base,
                                       encoding=delta_encoding if want_delta else "full", **common)
        except CheckpointError as e:
            if e.code != "delta_layout" or explicit:
                raise
            _note("tensor layout differs from the parent's; packing this step as full")
            manifest = pack_checkpoint(args.model, args.out, **common)
    seconds = time.perf_counter() - started
    ratio = manifest.total_size / max(manifest.compressed_size, 1)
    print(f"packed {manifest.describe()} into {args.out} in {seconds:.1f} s "
          f"({manifest.total_size / 1e6 / max(seconds, 1e-9):.0f} MB/s, ratio {ratio:.2f}x)")
    print(f"manifest hash (the next step's parent): {manifest.canonical_hash()}")
    return 0


def cmd_unpack(args) -> int:
    trusted = None
    if args.key:
        trusted = {public_key_arg("--key", args.key)}
    started = time.perf_counter()
    manifest = unpack_checkpoint(args.ckpt, args.out, trusted_keys=trusted, base=args.base,
                                 progress=sys.stderr.isatty())
    if trusted is None:
        _note(f"no --key given: trusted the manifest's own signer {manifest.signer[:16]}… "
              "(proves integrity, not origin)")
    seconds = time.perf_counter() - started
    print(f"unpacked {manifest.describe()} into {Path(args.out) / 'model.safetensors'} in {seconds:.1f} s "
          f"(payload sha256 verified)")
    return 0
