"""LoRA on the trainer's model (trainer.lora, issue #29), with peft.

`wrap` injects peft's LoRA layers into the target projections and freezes everything else: the model's
parameters that still require a gradient are exactly the adapters' (lora_A, lora_B), so the optimizer and
the gradient clipping of node/trainer/runner.py see only them. The model becomes a peft `PeftModel`, whose
attribute lookups (config, get_decoder, get_output_embeddings) and forward reach the wrapped transformers
model, so the forward paths (node/trainer/forward.py) and the evaluator take it unchanged.

Three views of the wrapped model under the base model's own names (no `base_layer`, no `.default`):
`base_state_dict` (the frozen base: what a trainer snapshot's model/ holds), `plain_adapter` (lora_A / lora_B
per adapted layer: what a `lora-adapter` checkpoint carries, node/coordinator/publisher.py) and
`merged_state_dict` (W + alpha / rank * B @ A for every target, by the protocol's `merge_lora`: the policy the
trainer stands for; step 0 is published as these merged weights, full). None mutates the training model:
peft's own merge would write into the base weights, which the next step's forward must still see unmerged.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from node.trainer.config import LoraConfig
from protocol.checkpoint.adapter import A_SUFFIX, B_SUFFIX, merge_lora
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


@contextmanager
def base_trainable(model: Any) -> Iterator[None]:
    """Within: the base model's parameters train and the adapters are frozen at their init; on exit, as before.
    The warm start runs in it (Trainer.sft): it builds the base, the model step 0 publishes in full, so the
    adapters start RL at zero (lora_B = 0) and every later step's adapter is rank r. Trained through the adapters
    instead, the warm start's adapter would have to be subtracted from every later step's (publisher.py
    stack_adapters: rank 2r, twice the bytes), and a LoRA on a small base learns much less from it (measured:
    bench/learning.py --lora-ranks, docs/BENCHMARKS.md "LoRA against full fine-tuning")."""
    before = [(p, p.requires_grad) for p in model.parameters()]
    for name, p in model.named_parameters():
        p.requires_grad_(_LORA_PART not in name)
    try:
        yield
    finally:
        for p, flag in before:
            p.requires_grad_(flag)


def _base(model: Any) -> torch.nn.Module:
    return model.get_base_model()


def _plain_name(name: str) -> str:
    return name.replace(_BASE_LAYER + ".", ".")


def base_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base model's state under its own names (tied weights share storage, as in state_dict())."""
    return {_plain_name(k): v for k, v in _base(model).state_dict().items() if _LORA_PART not in k}


def lora_scale(model: Any) -> tuple[int, int]:
    """(rank, alpha) of the model's adapter, as peft holds them (what a published adapter signs)."""
    config = model.peft_config[ADAPTER]
    return int(config.r), int(config.lora_alpha)


def plain_adapter(model: Any) -> dict[str, torch.Tensor]:
    """The adapter under the base model's module names, as a `lora-adapter` checkpoint carries it
    (protocol/checkpoint/adapter.py): `M.lora_A` (rank x in) and `M.lora_B` (out x rank) for every adapted
    linear layer M. The model's own tensors (not copies)."""
    from peft.tuners.lora import Linear, LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, module in _base(model).named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, Linear):  # would be published unmerged
            raise TypeError(f"{name}: LoRA on a {type(module).__name__} is not merged for publication")
        if isinstance(module, Linear) and ADAPTER in module.lora_A:
            if getattr(module, "fan_in_fan_out", False) or module.use_dora.get(ADAPTER, False):
                raise TypeError(f"{name}: a fan_in_fan_out or DoRA layer is not W + alpha / rank * B @ A")
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)  # nn.Linear weights (torch types them loosely)
            out[f"{name}{A_SUFFIX}"], out[f"{name}{B_SUFFIX}"] = a, b
    return out


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's names and shapes, every target's weight replaced by W + alpha / rank * B @ A (a new
    tensor; the model is not touched), every other entry the model's own tensor. Computed by the protocol's
    merge (protocol/checkpoint/adapter.py, `merge_lora`), the one a worker applies to a published adapter."""
    rank, alpha = lora_scale(model)
    return merge_lora(base_state_dict(model), plain_adapter(model), rank=rank, alpha=alpha)


class BroadcastAdapter(NamedTuple):
    """The adapter to publish: `plain_adapter`'s tensors (copies, contiguous on CPU, in the broadcast dtype) with
    peft's rank and alpha (node/coordinator/publisher.py packs them as a `lora-adapter` checkpoint)."""
    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: int


def adapter_for_broadcast(model: Any, dtype: torch.dtype) -> BroadcastAdapter:
    rank, alpha = lora_scale(model)
    tensors = {n: t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
               for n, t in plain_adapter(model).items()}
    return BroadcastAdapter(tensors, rank, alpha)


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


def adapter_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's (lora_A, lora_B) parameters by their names in the wrapped model, in parameter order, whatever
    trains now (adapter_state_dict is what requires a gradient, the base inside base_trainable)."""
    return {n: p for n, p in model.named_parameters() if _LORA_PART in n}


def check_snapshot(snap: Path, saved: dict[str, Any] | None, cfg: LoraConfig) -> None:
    """A snapshot resumes only with the trainer.lora it was trained with (`saved`: its trainer.json's "lora", None
    for a full fine-tuning snapshot), else TrainerStateError."""
    if saved is not None and not cfg.enabled:
        raise TrainerStateError(f"{snap} was trained with trainer.lora ({saved}); resume it with the same "
                                f"trainer.lora")
    if cfg.enabled and saved != cfg.model_dump():
        raise TrainerStateError(f"{snap}: trainer.lora is {cfg.model_dump()}, the snapshot was trained with {saved}")
