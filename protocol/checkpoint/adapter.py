"""LoRA adapter checkpoints (encoding "lora-adapter", docs/PROTOCOL.md, "lora-adapter"): the merge, defined once.

An adapter checkpoint's payload is an ordinary safetensors file (sharded, zstd-compressed, sha256'd and signed
like any other) holding, for each adapted linear layer `M` of the base model, `M.lora_A` (rank x in) and
`M.lora_B` (out x rank). Its manifest pins the base, the full checkpoint of `base_step`, by that manifest's
hash (`lora.base`), and signs `rank` and `alpha`. The weights a node generates with are

    W_M' = cast_to_dtype_of(W_M)( float32(W_M) + (float32(B_M) @ float32(A_M)) * float32(alpha / rank) )

for every adapted `M`, and the base's own tensors for every other name: `merge_lora`, pure, used by the worker
that rebuilds a step (node/worker/fetcher.py), by the coordinator that replays rollouts against it
(node/coordinator/publisher.py hands the same merged weights to verification), and by the trainer's own merged
view (node/trainer/lora.py), so all three compute it the same way. `merge_adapter_payload` is its IO wrapper:
check the base, read both payloads, merge, write the merged payload atomically.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .errors import CheckpointError
from .manifest import Manifest

if TYPE_CHECKING:
    import torch

A_SUFFIX = ".lora_A"
B_SUFFIX = ".lora_B"
_WRITE_CHUNK = 8 << 20
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def adapter_pairs(adapter: Mapping[str, "torch.Tensor"], rank: int) -> dict[str, tuple["torch.Tensor", "torch.Tensor"]]:
    """module name -> (A, B) of an adapter payload, every name and shape checked against `rank`; CheckpointError
    ("bad_adapter") naming the first tensor that is not one of a well-formed pair."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, t in adapter.items():
        if name.endswith(A_SUFFIX):
            module, part = name[:-len(A_SUFFIX)], "A"
        elif name.endswith(B_SUFFIX):
            module, part = name[:-len(B_SUFFIX)], "B"
        else:
            raise CheckpointError("bad_adapter", f"adapter tensor {name!r} is neither <module>{A_SUFFIX} nor "
                                                 f"<module>{B_SUFFIX}")
        if not module:
            raise CheckpointError("bad_adapter", f"adapter tensor {name!r} names no module")
        if str(t.dtype).removeprefix("torch.") not in _FLOAT_DTYPES:
            raise CheckpointError("bad_adapter", f"adapter tensor {name!r} is {t.dtype}, not a float type")
        if t.dim() != 2:
            raise CheckpointError("bad_adapter", f"adapter tensor {name!r} has shape {tuple(t.shape)}, not a matrix")
        pairs.setdefault(module, {})[part] = t
    if not pairs:
        raise CheckpointError("bad_adapter", "the adapter payload holds no tensor")
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = B_SUFFIX if "A" in pair else A_SUFFIX
            raise CheckpointError("bad_adapter", f"adapter for {module!r} lacks {module}{missing}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError("bad_adapter", f"adapter for {module!r}: A is {tuple(a.shape)} and B is "
                                                 f"{tuple(b.shape)}, but the manifest's rank is {rank}")
        out[module] = (a, b)
    return out


def merge_lora(base: Mapping[str, "torch.Tensor"], adapter: Mapping[str, "torch.Tensor"], *, rank: int,
               alpha: int) -> dict[str, "torch.Tensor"]:
    """The merged weights: `base` with every adapted `M.weight` replaced by the formula in this module's doc
    (a new tensor in W's dtype and device; `base` and `adapter` are not touched), every other entry `base`'s own
    tensor (tied tensors stay shared). Pure: no IO. CheckpointError("bad_adapter") for an adapter that names a
    weight the base lacks or whose shapes do not make W's."""
    import torch

    pairs = adapter_pairs(adapter, rank)
    scale = alpha / rank  # a Python float; multiplying a float32 tensor rounds it to float32, as peft's scaling
    out = dict(base)
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            key = f"{module}.weight"
            w = base.get(key)
            if w is None:
                raise CheckpointError("bad_adapter", f"adapter for {module!r}: the base has no tensor {key!r}")
            if w.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise CheckpointError("bad_adapter", f"adapter for {module!r}: B @ A is {b.shape[0]} x {a.shape[1]}, "
                                                     f"but {key} is {tuple(w.shape)}")
            if str(w.dtype).removeprefix("torch.") not in _FLOAT_DTYPES:
                raise CheckpointError("bad_adapter", f"adapter for {module!r}: {key} is {w.dtype}, not a float type")
            delta = b.to(device=w.device, dtype=torch.float32) @ a.to(device=w.device, dtype=torch.float32)
            out[key] = (w.to(torch.float32) + delta * scale).to(w.dtype)
    return out


def check_adapter_base(manifest: Manifest, base: Manifest) -> None:
    """`base` must be the very checkpoint `manifest` was made against: a full checkpoint of the same run at
    `base_step`, whose manifest hashes to the signed `lora.base`. CheckpointError("base_mismatch") otherwise."""
    if not manifest.is_adapter or manifest.lora is None:
        raise CheckpointError("base_mismatch", f"step {manifest.step} is {manifest.encoding}, not a LoRA adapter")
    want, got = manifest.lora.base, base.canonical_hash()
    if base.step != manifest.base_step or got != want:
        raise CheckpointError("base_mismatch", f"step {manifest.step} is a LoRA adapter on the step "
                                               f"{manifest.base_step} checkpoint {want[:16]}…, but the base held is "
                                               f"step {base.step}, {got[:16]}…")
    if base.encoding != "full" or base.run_id != manifest.run_id:
        raise CheckpointError("base_mismatch", f"the base of LoRA step {manifest.step} must be a full checkpoint "
                                               f"of run {manifest.run_id!r}, not {base.encoding} of {base.run_id!r}")


def write_state(state: Mapping[str, "torch.Tensor"], out_path: str | os.PathLike[str]) -> None:
    """`state` as a deterministic safetensors payload at `out_path` (payload.py's layout: sorted names, tied
    tensors once), written through a temporary file and renamed, streamed in pieces (no second copy in memory)."""
    from .payload import layout_from_state

    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    layout = layout_from_state(state)
    try:
        buf = bytearray(min(_WRITE_CHUNK, layout.total_size))
        with open(tmp, "xb") as f:
            for offset in range(0, layout.total_size, len(buf)):
                view = memoryview(buf)[:min(len(buf), layout.total_size - offset)]
                layout.read_into(offset, view)
                f.write(view)
        os.replace(tmp, out)
    finally:
        layout.close()
        tmp.unlink(missing_ok=True)


def merge_adapter_payload(manifest: Manifest, adapter_payload: Any, base: Manifest, base_payload: Any,
                          out_path: str | os.PathLike[str]) -> dict[str, "torch.Tensor"]:
    """Check `base` is the pinned base, merge the adapter payload (bytes or a path, already verified against
    `manifest.sha256`) into `base_payload` (the base step's full payload), write the merged weights to
    `out_path` (atomically) and return them."""
    from .payload import load_payload

    check_adapter_base(manifest, base)
    assert manifest.lora is not None  # check_adapter_base refused anything else
    merged = merge_lora(load_payload(base_payload), load_payload(adapter_payload), rank=manifest.lora.rank,
                        alpha=manifest.lora.alpha)
    write_state(merged, out_path)
    return merged
