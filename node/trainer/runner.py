"""The model runner: what a Trainer does to its model, behind one small interface.

A `Trainer` (node/trainer/trainer.py) owns the training policy -- groups offered, advantages, filters,
difficulty pools, batching, stream mode, metrics, the bookkeeping of snapshots -- and holds one
`ModelRunner`, which owns the model and its optimizers and does the arithmetic:

    build               the model (under the run's seed, train mode) and the RL optimizer
    forward_backward    back-propagate the summed loss of some samples into .grad; tally tokens and metrics
    step                divide .grad by the batch's loss tokens, clip, optimizer step (skipped when the
                        gradient is not finite), zero the gradients
    new_optimizer       a second AdamW (the SFT warm start's, so that the RL optimizer starts clean)
    weights_for_broadcast, full_model   the weights to publish, the model to evaluate
    write_weights / snapshot_meta / load_snapshot   model + optimizer in a trainer snapshot (the rest of
                        the snapshot -- step, pools, queued groups, RNG -- is the Trainer's, node/trainer/state.py)
    close, abort        release what the runner holds beyond memory (another process's ranks)

Two implementations: `LocalRunner` (this process, one device; the default) and `FSDPRunner`
(node/trainer/distributed.py: the model sharded with FSDP2 over local ranks, which execute the same calls
as collective commands). Both share the micro-batch loss body below, so the loss is computed in one place.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from node.trainer import lora
from node.trainer.config import TrainerConfig
from node.trainer.forward import micro_batch_logprobs
from node.trainer.loss import LossInputs, LossOutputs, loss_mask_tensor, resolve_loss
from node.trainer.model import load_model
from node.trainer.packing import MicroBatch, TrainSample, build_micro_batches
from node.trainer.state import FORMAT, TrainerStateError, flatten_optimizer, read_json, unflatten_optimizer, write_json
from node.trainer.types import Group

LossFn = Callable[[LossInputs], LossOutputs]

# Per-token metrics that loss functions report as fractions/means of a sequence; summed weighted by tokens.
TOKEN_WEIGHTED = ("masked_frac", "clipped_frac", "mean_ratio", "kl", "nll", "teacher_kl")


@dataclass
class LossTally:
    """What back-propagation has added up since the window began: the gradient's divisor (`loss_tokens`)
    and the loss metrics of the step."""

    loss_sum: float = 0.0
    loss_tokens: int = 0
    nonfinite: int = 0
    tokens_processed: int = 0  # padded tokens through the model
    weighted: dict[str, float] = field(default_factory=dict)  # TOKEN_WEIGHTED metric -> sum of value * tokens

    def record(self, out: LossOutputs, n: int) -> None:
        self.loss_sum += float(out.loss.detach())
        self.loss_tokens += n
        self.nonfinite += int(out.metrics.get("nonfinite", 0))
        for k in TOKEN_WEIGHTED:
            if k in out.metrics:
                self.weighted[k] = self.weighted.get(k, 0.0) + float(out.metrics[k]) * n


class StepResult(NamedTuple):
    grad_norm: float
    skipped: bool  # the gradient was empty or not finite: the weights did not move


def samples_of(groups: list[Group]) -> list[TrainSample]:
    """Every rollout of `groups` as a training sample, keyed (group index, rollout index)."""
    return [TrainSample(g.prompt_ids, r.completion_ids, r.inference_logprobs, g.advantages[j], r.teacher_logprobs,
                        key=(gi, j), loss_mask=r.loss_mask)
            for gi, g in enumerate(groups) for j, r in enumerate(g.rollouts)]


def micro_batch_loss(mb: MicroBatch, logprobs: list[torch.Tensor], loss_fn: LossFn,
                     tally: LossTally) -> torch.Tensor | None:
    """The summed loss of one micro-batch's samples given their logprobs (None for no sample), each
    sample's metrics tallied."""
    total = None
    for sl, lp in zip((s for row in mb.rows for s in row.slices), logprobs):
        s = sl.sample
        n = len(s.completion_ids)
        like: dict[str, Any] = dict(dtype=lp.dtype, device=lp.device)
        out = loss_fn(LossInputs(
            trainer_logprobs=lp,
            inference_logprobs=torch.tensor(s.inference_logprobs, **like),
            teacher_logprobs=None if s.teacher_logprobs is None else torch.tensor(s.teacher_logprobs, **like),
            advantages=torch.full((n,), float(s.advantage), **like),
            loss_mask=loss_mask_tensor(s, lp.device),
        ))
        total = out.loss if total is None else total + out.loss
        tally.record(out, n if s.loss_mask is None else sum(s.loss_mask))
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, tokens: int, grad_norm: float) -> bool:
    """The update on gradients already divided and clipped; True when skipped. A non-finite gradient (a
    custom loss gone wrong) must not poison the weights: the update is skipped, the gradients dropped."""
    skipped = not (tokens > 0 and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


def new_adamw(model: torch.nn.Module, lr: float, cfg: TrainerConfig) -> torch.optim.Optimizer:
    # foreach=False: the single-tensor path is bit-reproducible across save/resume. Only the trainable
    # parameters (all of them, but the adapters alone with trainer.lora): the optimizer state indexes them.
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, eps=1e-8, foreach=False)


def build_model(model_dir: str | Path, cfg: TrainerConfig, *, device: str, attn_implementation: str) -> Any:
    """The trainable fp32 model, loaded under the run's seed (every rank loads it the same way)."""
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, dtype="float32", attn_implementation=attn_implementation, device=device)
    model.train()
    return model


def broadcast_state(model: Any, cfg: TrainerConfig) -> dict[str, torch.Tensor]:
    """ModelRunner.weights_for_broadcast of a plain (unsharded) model: its state, with trainer.lora the merged one
    under the base names (lora.merged_state_dict), in cfg.broadcast_dtype, tied duplicates dropped. The
    LocalRunner's model, or an FSDPRunner's gathered copy on rank 0."""
    dtype = getattr(torch, cfg.broadcast_dtype)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    state = lora.merged_state_dict(model) if cfg.lora.enabled else model.state_dict()
    for name, t in state.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
    return out


def vocab_size_of(model: Any) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


class ModelRunner(ABC):
    """Owns the model and its optimizers for a Trainer (see the module docstring). Driven from one thread."""

    # a transformers causal LM (FSDP-wrapped on an FSDPRunner): Any, as load_model's, because torch types the
    # attributes of a Module (save_pretrained, config, the FSDP forward method) as Tensor | Module
    model: Any
    optimizer: torch.optim.Optimizer  # the RL optimizer (cfg.lr)
    loss_fn: LossFn  # the training loss of cfg.mode / cfg.loss (resolved once: its identity selects it)
    vocab_size: int

    @abstractmethod
    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, temperature: float = 1.0, device: str = "cpu",
                 attn_implementation: str = "sdpa") -> None:
        """Build the model from `model_dir` (build_model: under cfg.seed) and the RL optimizer; `temperature`
        is the sampler's, which the trainer's logprobs must match."""

    @abstractmethod
    def forward_backward(self, samples: list[TrainSample], loss_fn: LossFn, tally: LossTally) -> None:
        """Back-propagate the SUM of the samples' per-token losses into .grad (accumulating), tallied."""

    @abstractmethod
    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float, tokens: int) -> StepResult:
        """Divide the gradients by `tokens` (the batch's loss tokens), clip, step, zero the gradients."""

    @abstractmethod
    def new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """A fresh AdamW over the model, besides `optimizer` (step() takes either)."""

    @abstractmethod
    def weights_for_broadcast(self) -> dict[str, torch.Tensor]:
        """Model state in cfg.broadcast_dtype, contiguous on CPU, tied duplicates removed (as in
        save_pretrained), every tensor its own storage (safetensors refuses shared memory)."""

    def full_model(self) -> torch.nn.Module:
        """A plain (unsharded) model with the current weights, to evaluate."""
        return self.model

    def warm_start_scope(self) -> AbstractContextManager[None]:
        """What trains during the warm start (Trainer.sft): the model's trainable parameters, unchanged here."""
        return nullcontext()

    def adapter_for_broadcast(self) -> lora.BroadcastAdapter | None:
        """With trainer.lora, the adapter alone in cfg.broadcast_dtype (published as a `lora-adapter` checkpoint,
        node/coordinator/publisher.py); None without it."""
        return None

    @abstractmethod
    def snapshot_meta(self) -> dict[str, Any]:
        """trainer.json's first entries for a snapshot of this runner ("format" first)."""

    @abstractmethod
    def write_weights(self, tmp: Path) -> None:
        """Model and optimizer into a snapshot being written (`tmp/model/` for the model's directory)."""

    @abstractmethod
    def load_snapshot(self, snap: Path) -> None:
        """Model and optimizer from a snapshot this kind of runner wrote (the model directory it was built
        from is `model_dir_of_snapshot`'s)."""

    @classmethod
    @abstractmethod
    def model_dir_of_snapshot(cls, snap: Path, meta: dict[str, Any], model_dir: str | Path | None) -> Path:
        """The model directory a resume from `snap` builds the runner from; TrainerStateError when `snap`
        is not of this runner's format."""

    def close(self, timeout: float = 10.0) -> None:
        """Release what the runner holds beyond its memory, within about `timeout` seconds. Never raises."""

    def abort(self) -> None:
        """From any thread: make a call blocked on another process fail now (nothing to do in one process)."""


class LocalRunner(ModelRunner):
    """The model in this process, on one device. Snapshots: safetensors only (node/trainer/state.py's layout).

    With trainer.lora the model is wrapped with peft's LoRA (node/trainer/lora.py: base frozen, only the
    adapters train); `weights_for_broadcast` is the full merged model under the base names (published at step 0,
    replayed by verification), `adapter_for_broadcast` the adapter alone (published at every later step), a snapshot's
    model/ holds the frozen base (the model a resume builds from) with the adapter in lora.safetensors."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, temperature: float = 1.0, device: str = "cpu",
                 attn_implementation: str = "sdpa") -> None:
        self.cfg = cfg
        self.temperature = temperature
        self.model = build_model(model_dir, cfg, device=device, attn_implementation=attn_implementation)
        if cfg.lora.enabled:  # the adapters' init draws from the RNG build_model seeded
            self.model = lora.wrap(self.model, cfg.lora)
        self.vocab_size = vocab_size_of(self.model)
        self.optimizer = new_adamw(self.model, cfg.lr, cfg)
        self.loss_fn = resolve_loss(cfg.mode, cfg.loss)

    def forward_backward(self, samples: list[TrainSample], loss_fn: LossFn, tally: LossTally) -> None:
        for mb in build_micro_batches(samples, self.cfg.packing, self.cfg.micro_batch_tokens):
            total = micro_batch_loss(mb, micro_batch_logprobs(self.model, mb, self.temperature), loss_fn, tally)
            tally.tokens_processed += mb.padded_tokens
            if total is not None and total.requires_grad:
                total.backward()

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float, tokens: int) -> StepResult:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if tokens > 0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(tokens)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if tokens else 0.0
        return StepResult(grad_norm, optimizer_step(optimizer, tokens, grad_norm))

    def new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return new_adamw(self.model, lr, self.cfg)

    def warm_start_scope(self) -> AbstractContextManager[None]:
        # With trainer.lora the warm start trains the base and leaves the adapters at init (lora.base_trainable).
        return lora.base_trainable(self.model) if self.cfg.lora.enabled else nullcontext()

    def adapter_for_broadcast(self) -> lora.BroadcastAdapter | None:
        if not self.cfg.lora.enabled:
            return None
        return lora.adapter_for_broadcast(self.model, getattr(torch, self.cfg.broadcast_dtype))

    def weights_for_broadcast(self) -> dict[str, torch.Tensor]:
        return broadcast_state(self.model, self.cfg)

    def snapshot_meta(self) -> dict[str, Any]:
        if self.cfg.lora.enabled:
            return {"format": FORMAT, "lora": self.cfg.lora.model_dump()}
        return {"format": FORMAT}

    def write_weights(self, tmp: Path) -> None:
        from safetensors.torch import save_file

        if self.cfg.lora.enabled:  # model/ = the frozen base under its own names; the adapter beside it
            self.model.get_base_model().save_pretrained(str(tmp / "model"), state_dict=lora.base_state_dict(
                self.model), safe_serialization=True)
            save_file({n: p.detach().contiguous().cpu() for n, p in lora.adapter_state_dict(self.model).items()},
                      str(tmp / lora.ADAPTER_FILE))
        else:
            self.model.save_pretrained(str(tmp / "model"), safe_serialization=True)
        tensors, structure = flatten_optimizer(self.optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        write_json(tmp / "optimizer.json", structure)

    def load_snapshot(self, snap: Path) -> None:
        from safetensors.torch import load_file

        lora.check_snapshot(snap, read_json(snap / "trainer.json").get("lora"), self.cfg.lora)
        if self.cfg.lora.enabled:
            if not (snap / lora.ADAPTER_FILE).is_file():
                raise TrainerStateError(f"{snap / lora.ADAPTER_FILE} is missing")
            lora.load_adapter(self.model, load_file(str(snap / lora.ADAPTER_FILE)), snap)
        structure = read_json(snap / "optimizer.json")
        self.optimizer.load_state_dict(unflatten_optimizer(load_file(str(snap / "optimizer.safetensors")), structure))

    @classmethod
    def model_dir_of_snapshot(cls, snap: Path, meta: dict[str, Any], model_dir: str | Path | None) -> Path:
        if meta.get("format") != FORMAT:
            raise TrainerStateError(f"{snap}: not a prime-node trainer state ({meta.get('format')!r})")
        return snap / "model"  # the snapshot is a whole model directory: weights, config, tokenizer
