"""A LoRA adapter as an engine serves it unmerged (`worker.lora_serving = "adapter"`, docs/OPERATIONS.md).

The only source is the store's verified checkpoint: `from_store` takes the adapter payload the fetcher rebuilt (a
store with `unmerged_adapters`), or rebuilds it from the step's shard files, against its signed manifest (every shard's hash and the payload's sha256 checked again by
`reconstruct_payload`), and every pair is checked by the protocol's `adapter_pairs` (protocol/checkpoint/adapter.py).
Nothing from the network reaches an engine without that check. The math is the protocol's merge
(`W + alpha / rank * B @ A`, docs/PROTOCOL.md, "lora-adapter") applied on the fly instead of into W.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.checkpoint import CheckpointError, DirShardReader, Manifest, load_payload, reconstruct_payload
from protocol.checkpoint.adapter import adapter_pairs

if TYPE_CHECKING:
    from torch import Tensor

    from node.checkpoint_dir import CheckpointDir

PEFT_WEIGHTS = "adapter_model.safetensors"  # the file names vLLM's LoRA loader (and peft) look for
PEFT_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraAdapter:
    step: int
    base: str  # the manifest hash of the full checkpoint it applies to (signed in its manifest's `lora.base`)
    rank: int
    alpha: int
    pairs: dict[str, tuple["Tensor", "Tensor"]]  # module name -> (A [rank, in], B [out, rank])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_manifest(cls, manifest: Manifest, state: dict[str, "Tensor"]) -> "LoraAdapter":
        if not manifest.is_adapter or manifest.lora is None:
            raise CheckpointError("base_mismatch", f"step {manifest.step} is {manifest.encoding}, not a LoRA adapter")
        return cls(manifest.step, manifest.lora.base, manifest.lora.rank, manifest.lora.alpha,
                   adapter_pairs(state, manifest.lora.rank))

    @classmethod
    def from_store(cls, store: "CheckpointDir", step: int) -> "LoraAdapter":
        """The adapter of held step `step`: the fetcher's rebuilt payload where the store keeps adapters unmerged,
        else rebuilt here from its verified shard files (a few MB: in memory)."""
        manifest = store.manifest(step)
        if manifest is None:
            raise CheckpointError("missing_manifest", f"step {step} is not held")
        if store.unmerged_adapters and store.adapter_payload_path(step).is_file():
            return cls.from_manifest(manifest, load_payload(store.adapter_payload_path(step)))
        with tempfile.TemporaryDirectory(dir=store.root) as tmp:
            out = Path(tmp) / "adapter.safetensors"
            reconstruct_payload(manifest, DirShardReader(store.step_dir(step), manifest), out)
            return cls.from_manifest(manifest, load_payload(out))

    def check_base(self, base: str | None) -> None:
        """Refuse to apply this adapter to an engine whose base weights are not the pinned checkpoint (CheckpointError
        "base_mismatch"): its output would be neither policy, and every rollout would be rejected."""
        if base != self.base:
            held = f"{base[:16]}…" if base else "no full checkpoint (merged weights)"
            raise CheckpointError("base_mismatch", f"step {self.step} is a LoRA adapter on {self.base[:16]}…, but the "
                                                   f"engine's base is {held}")

    def write_peft_dir(self, path: Path) -> Path:
        """The adapter as a peft directory (adapter_config.json + adapter_model.safetensors, peft's key names under
        `base_model.model.`), the format vLLM's LoRA loader reads. Written fresh from the verified tensors."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for module, (a, b) in self.pairs.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        save_file(tensors, str(path / PEFT_WEIGHTS))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                  "target_modules": sorted({m.rsplit(".", 1)[-1] for m in self.pairs}), "lora_dropout": 0.0,
                  "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
                  "modules_to_save": None}
        (path / PEFT_CONFIG).write_text(json.dumps(config))
        return path
