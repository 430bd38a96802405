"""LoRA on the trainer's model (trainer.lora, issue #29), with peft.

`wrap` injects peft's LoRA layers into the target projections and freezes everything else: the model's
parameters that still require a gradient are exactly the adapters' (lora_A, lora_B), so the optimizer and
the gradient clipping of node/trainer/runner.py see only them. The model becomes a peft `PeftModel`, whose
attribute lookups (config, get_decoder, get_output_embeddings) and forward reach the wrapped transformers
model, so the forward paths (node/trainer/forward.py) and the evaluator take it unchanged.

Two views of the wrapped model under the base model's own parameter names (no `base_layer`, no `lora_`):
`base_state_dict` (the frozen base: what a trainer snapshot's model/ holds) and `merged_state_dict`
(W + alpha / rank * B @ A for every target: what is published to workers, so the checkpoint format,
verification and deltas are those of full fine-tuning). Neither mutates the training model: peft's own
merge would write into the base weights, which the next step's forward must still see unmerged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from node.trainer.config import LoraConfig
from node.trainer.state import TrainerStateError

ADAPTER = "default"  # peft's adapter name; a trainer holds one adapter
ADAPTER_FILE = "lora.safetensors"  # in a trainer snapshot, beside model/ (the base) and optimizer.*
_LORA_PART = ".lora_"  # a peft LoRA parameter's name has a `lora_A.` / `lora_B.` component
_BASE_LAYER = ".base_layer"  # peft moves a target's own weight under `<target>.base_layer.`


def wrap(model: Any, cfg: LoraConfig) -> Any:
    """`model` with LoRA adapters on cfg.target_modules, the base frozen (peft.get_peft_model; in place).
    The adapters' random init (lora_A; lora_B starts at zero, so the model's output is unchanged) draws from
    torch's global RNG, which the caller has seeded."""
    import peft

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in names]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: the model has no module named {missing} "
                         f"(a Llama/Qwen2-shaped model has q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                         f"down_proj)")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none")
    return peft.get_peft_model(model, config, adapter_name=ADAPTER)


def _base(model: Any) -> torch.nn.Module:
    return model.get_base_model()


def _plain_name(name: str) -> str:
    return name.replace(_BASE_LAYER + ".", ".")


def base_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base model's state under its own names (tied weights share storage, as in state_dict())."""
    return {_plain_name(k): v for k, v in _base(model).state_dict().items() if _LORA_PART not in k}


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's names and shapes, every target's weight replaced by W + alpha / rank * B @ A (a new
    tensor; the model is not touched), every other entry the model's own tensor."""
    from peft.tuners.lora import Linear, LoraLayer

    out = base_state_dict(model)
    for name, module in _base(model).named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, Linear):  # would be published unmerged
            raise TypeError(f"{name}: LoRA on a {type(module).__name__} is not merged for publication")
        if isinstance(module, Linear) and ADAPTER in module.lora_A:
            key = f"{name}.weight"
            base = out[key]
            out[key] = base + module.get_delta_weight(ADAPTER).to(base.dtype)
    return out


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters by their names in the wrapped model, in parameter order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_adapter(model: Any, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Copy a snapshot's adapter (adapter_state_dict's) into `model`; exactly the same names and shapes, or
    TrainerStateError (a snapshot of another rank or other targets)."""
    own = adapter_state_dict(model)
    if set(own) != set(tensors):
        extra, absent = sorted(set(tensors) - set(own)), sorted(set(own) - set(tensors))
        raise TrainerStateError(f"{where}: the adapter does not match trainer.lora (unexpected {extra[:3]}, "
                                f"missing {absent[:3]})")
    for n, p in own.items():
        if tensors[n].shape != p.shape:
            raise TrainerStateError(f"{where}: adapter tensor {n} has shape {tuple(tensors[n].shape)}, "
                                    f"trainer.lora gives {tuple(p.shape)}")
        p.copy_(tensors[n])
