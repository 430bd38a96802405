"""The training loop's core: groups in, optimizer steps out.

Gradient accumulation: every micro-batch back-propagates the SUM of its per-token losses; at step
time the summed gradients are divided by the batch's loss-token count. Gradients are linear, so this
is exactly the gradient of (batch loss sum / batch tokens) whatever the micro-batching or the order in
which groups arrived -- which is what makes streaming mode (k = 0 periodic asynchrony: back-propagate
each group as it arrives, step when the batch is full) identical to training on the whole batch.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from node.trainer.advantages import resolve_advantage
from node.trainer.buffer import DifficultyPools, KeepRate, uninformative
from node.trainer.config import TrainerConfig
from node.trainer.filters import apply_filters, build_filters
from node.trainer.forward import micro_batch_logprobs
from node.trainer.loss import LossInputs, LossOutputs, loss_mask_tensor, resolve_loss, sft_loss
from node.trainer.model import load_model
from node.trainer.packing import TrainSample, build_micro_batches
from node.trainer.state import load_state, save_state
from node.trainer.types import Group, validate_group
from protocol.errors import PrimeNodeError


class TrainerError(PrimeNodeError):
    pass


# Per-token metrics that loss functions report as fractions/means of a sequence; averaged by tokens.
_TOKEN_WEIGHTED = ("masked_frac", "clipped_frac", "mean_ratio", "kl", "nll", "teacher_kl")


class Trainer:
    """Not thread-safe: call every method from one thread (the coordinator's trainer thread)."""
    def __init__(self, model_dir: str | Path, cfg: TrainerConfig | None = None, *, batch_prompts: int = 8,
                 state_dir: str | Path | None = None, stream: bool = False, temperature: float = 1.0,
                 max_sequence_tokens: int = 32768, device: str = "cpu", attn_implementation: str = "sdpa") -> None:
        if batch_prompts < 1:
            raise TrainerError("batch_prompts must be at least 1")
        self.cfg = cfg or TrainerConfig()
        self.model_dir = Path(model_dir)
        self.batch_prompts = batch_prompts
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.stream = stream
        self.temperature = temperature
        self.max_sequence_tokens = max_sequence_tokens
        torch.manual_seed(self.cfg.seed)
        self.model = load_model(model_dir, dtype="float32", attn_implementation=attn_implementation, device=device)
        self.model.train()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions:  # a longer sequence would index past the position table
            self.max_sequence_tokens = min(self.max_sequence_tokens, int(positions))
        self.optimizer = self._new_optimizer(self.cfg.lr)
        self.loss_fn = resolve_loss(self.cfg.mode, self.cfg.loss)
        self.advantage_fn = resolve_advantage(self.cfg.advantage)
        self.filters = build_filters(self.cfg.filters)
        self.pools = DifficultyPools(self.cfg.buffer.easy_threshold, self.cfg.buffer.hard_threshold)
        self.keep = KeepRate(self.cfg.buffer.keep_rate_window)
        self.step_count = 0
        self.pending: list[Group] = []  # accepted, not yet back-propagated (or beyond the current batch)
        self.accumulated: list[Group] = []  # stream mode: back-propagated into .grad, awaiting step()
        self._reset_window()

    # ----------------------------------------------------------------- public API

    @classmethod
    def resume(cls, state_dir: str | Path, cfg: TrainerConfig | None = None, **kwargs: Any) -> "Trainer":
        """A Trainer continuing from the latest snapshot in `state_dir` (see node.trainer.state)."""
        return load_state(cls, Path(state_dir), cfg or TrainerConfig(), **kwargs)

    @property
    def batch_complete(self) -> bool:
        have = len(self.accumulated) if self.stream else len(self.pending)
        return have >= self.batch_prompts

    @property
    def keep_rate(self) -> float:
        """Share of recently offered groups kept for training; oversample prompts by 1 / keep_rate."""
        return self.keep.value

    def add_group(self, group: Group) -> bool:
        """Offer one prompt's rollouts. True when the group will be trained on, False when filtered out."""
        self._validate(group)
        rewards = [float(r.reward) for r in group.rollouts]
        self._win["rewards"] += rewards
        self._win["offered"] += 1
        self._win["staleness"] += [self.step_count + 1 - r.policy_step for r in group.rollouts]
        if self.cfg.mode == "rl":
            kept = self._rl_select(group, rewards)
            if kept is None:
                self.keep.record(False)
                return False
            group = kept
        else:
            group = Group(group.prompt_id, list(group.prompt_ids), list(group.rollouts), [0.0] * len(group.rollouts))
        self.keep.record(True)
        self._enqueue(group)
        return True

    def step(self, *, force: bool = False) -> dict[str, Any]:
        """Apply one optimizer step on the current batch; returns metrics. `force` steps on a partial batch."""
        if not self.batch_complete and not (force and (self.pending or self.accumulated)):
            have = len(self.accumulated) if self.stream else len(self.pending)
            raise TrainerError(f"batch incomplete: {have} of {self.batch_prompts} groups")
        if self.stream:
            if force and len(self.accumulated) < self.batch_prompts:
                self._drain_pending_into_stream()
            batch, self.accumulated = self.accumulated, []
        else:
            batch, self.pending = self.pending[: self.batch_prompts], self.pending[self.batch_prompts:]
            self.forward_backward(batch, self.loss_fn)
        t0 = time.perf_counter()
        metrics = self._apply_gradients(self.optimizer, self.cfg.max_grad_norm)
        self.step_count += 1
        metrics.update(self._window_metrics(batch))
        metrics["step"] = self.step_count
        # forward/backward time (spread over add_group calls in stream mode) + the optimizer update
        metrics["seconds"] = self._win["seconds"] + time.perf_counter() - t0
        self._reset_window()
        if self.stream:  # groups that arrived while the batch was full start the next one now
            self._drain_pending_into_stream()
        return metrics

    def weights_for_broadcast(self) -> dict[str, torch.Tensor]:
        """Model state in the broadcast dtype, contiguous on CPU, tied duplicates removed (as in
        save_pretrained), every tensor its own storage (safetensors refuses shared memory)."""
        dtype = getattr(torch, self.cfg.broadcast_dtype)
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Release what this trainer holds beyond its memory (nothing here; a DistributedTrainer's ranks,
        within about `timeout` seconds)."""

    def save_state(self) -> Path:
        if self.state_dir is None:
            raise TrainerError("this Trainer has no state_dir to save into")
        return save_state(self, self.state_dir)

    def sft(self, batches: Iterable[list[Group]], lr: float | None = None) -> list[float]:
        """Supervised steps (sft_loss), one per batch of groups, with an AdamW of their own (`lr`, default
        cfg.warm_start_lr) so that the RL optimizer starts clean; `step_count` does not advance. Returns each
        step's per-token NLL. The warm start (node/trainer/warm_start.py) runs it before RL step 1."""
        optimizer = self._new_optimizer(lr or self.cfg.warm_start_lr)
        losses = []
        for groups in batches:
            self._reset_window()
            self.forward_backward(groups, sft_loss)
            losses.append(self._win["loss_sum"] / max(self._win["loss_tokens"], 1))
            self._apply_gradients(optimizer, self.cfg.max_grad_norm)
        self._reset_window()
        return losses

    # ----------------------------------------------------------------- training internals

    def forward_backward(self, groups: list[Group], loss_fn: Callable[[LossInputs], LossOutputs]) -> None:
        """Back-propagate the summed loss of `groups` into .grad (accumulating), tracking metrics."""
        t0 = time.perf_counter()
        samples = [
            TrainSample(g.prompt_ids, r.completion_ids, r.inference_logprobs, g.advantages[j],
                        r.teacher_logprobs, key=(gi, j), loss_mask=r.loss_mask)
            for gi, g in enumerate(groups) for j, r in enumerate(g.rollouts)
        ]
        for mb in build_micro_batches(samples, self.cfg.packing, self.cfg.micro_batch_tokens):
            slices = [s for row in mb.rows for s in row.slices]
            logprobs = micro_batch_logprobs(self.model, mb, self.temperature)
            total = None
            for sl, lp in zip(slices, logprobs):
                s = sl.sample
                n = len(s.completion_ids)
                like: dict[str, Any] = dict(dtype=lp.dtype, device=lp.device)
                inputs = LossInputs(
                    trainer_logprobs=lp,
                    inference_logprobs=torch.tensor(s.inference_logprobs, **like),
                    teacher_logprobs=None if s.teacher_logprobs is None else torch.tensor(s.teacher_logprobs, **like),
                    advantages=torch.full((n,), float(s.advantage), **like),
                    loss_mask=loss_mask_tensor(s, lp.device),
                )
                out = loss_fn(inputs)
                total = out.loss if total is None else total + out.loss
                self._record_loss_metrics(out, n if s.loss_mask is None else sum(s.loss_mask))
            self._win["tokens_processed"] += mb.padded_tokens
            if total is not None and total.requires_grad:
                total.backward()
        self._win["seconds"] += time.perf_counter() - t0

    def _apply_gradients(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> dict[str, Any]:
        tokens = self._win["loss_tokens"]
        params = [p for p in self.model.parameters() if p.requires_grad]
        if tokens > 0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(tokens)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if tokens else 0.0
        return self._apply_update(optimizer, tokens, grad_norm)

    def _apply_update(self, optimizer, tokens: int, grad_norm: float) -> dict:
        """The optimizer step on gradients already divided and clipped, and the step's metrics. A
        non-finite gradient (a custom loss gone wrong) must not poison the weights: the update is skipped."""
        skipped = not (tokens > 0 and math.isfinite(grad_norm))
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": self._win["loss_sum"] / max(tokens, 1), "grad_norm": grad_norm,
                "loss_tokens": tokens, "lr": optimizer.param_groups[0]["lr"], "optimizer_skipped": skipped}

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        # foreach=False: the single-tensor path is bit-reproducible across save/resume.
        return torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(self.cfg.beta1, self.cfg.beta2),
                                 weight_decay=self.cfg.weight_decay, eps=1e-8, foreach=False)

    def _validate(self, group: Group) -> None:
        if self.cfg.mode == "sft":  # reference completions carry no sampler logprobs
            for r in group.rollouts:
                if not r.inference_logprobs:
                    r.inference_logprobs = [0.0] * len(r.completion_ids)
        validate_group(group, vocab_size=self.vocab_size, max_tokens=self.max_sequence_tokens,
                       need_teacher=self.cfg.mode == "opd")

    def _rl_select(self, group: Group, rewards: list[float]) -> Group | None:
        """Advantages, difficulty bookkeeping, online difficulty filtering, rollout filters."""
        self.pools.update(group.prompt_id, sum(rewards) / len(rewards))
        if self.cfg.buffer.online_difficulty_filtering and uninformative(rewards):
            self._win["difficulty_dropped"] += 1
            return None
        advantages = self.advantage_fn(group.rollouts)
        kept, dropped = apply_filters(self.filters, group.rollouts, advantages)
        for name, n in dropped.items():
            self._win["filtered"][name] = self._win["filtered"].get(name, 0) + n
        if not kept:
            self._win["groups_emptied_by_filters"] += 1
            return None
        return Group(group.prompt_id, list(group.prompt_ids), [group.rollouts[i] for i in kept],
                     [advantages[i] for i in kept])

    def _enqueue(self, group: Group) -> None:
        if self.stream and not self.pending and len(self.accumulated) < self.batch_prompts:
            self.forward_backward([group], self.loss_fn)
            self.accumulated.append(group)
        else:
            self.pending.append(group)

    def _drain_pending_into_stream(self) -> None:
        while self.pending and len(self.accumulated) < self.batch_prompts:
            group = self.pending.pop(0)
            self.forward_backward([group], self.loss_fn)
            self.accumulated.append(group)

    # ----------------------------------------------------------------- metrics

    def _reset_window(self) -> None:
        self._win: dict[str, Any] = {
            "rewards": [], "staleness": [], "offered": 0, "difficulty_dropped": 0, "groups_emptied_by_filters": 0,
            "filtered": {}, "loss_sum": 0.0, "loss_tokens": 0, "nonfinite": 0, "weighted": {},
            "tokens_processed": 0, "seconds": 0.0,
        }

    def _record_loss_metrics(self, out: LossOutputs, n: int) -> None:
        self._win["loss_sum"] += float(out.loss.detach())
        self._win["loss_tokens"] += n
        self._win["nonfinite"] += int(out.metrics.get("nonfinite", 0))
        for k in _TOKEN_WEIGHTED:
            if k in out.metrics:
                self._win["weighted"][k] = self._win["weighted"].get(k, 0.0) + float(out.metrics[k]) * n

    def _window_metrics(self, batch: list[Group]) -> dict[str, Any]:
        w = self._win
        tokens = max(w["loss_tokens"], 1)
        trained = [r for g in batch for r in g.rollouts]
        m: dict[str, Any] = {k: v / tokens for k, v in w["weighted"].items()}
        m.update(
            reward_mean=sum(w["rewards"]) / len(w["rewards"]) if w["rewards"] else 0.0,
            reward_mean_trained=sum(r.reward for r in trained) / len(trained) if trained else 0.0,
            groups=len(batch), samples=len(trained), groups_offered=w["offered"],
            difficulty_dropped=w["difficulty_dropped"], filtered=dict(w["filtered"]),
            groups_emptied_by_filters=w["groups_emptied_by_filters"], nonfinite=w["nonfinite"],
            completion_len_mean=sum(len(r.completion_ids) for r in trained) / max(len(trained), 1),
            staleness_mean=sum(w["staleness"]) / len(w["staleness"]) if w["staleness"] else 0.0,
            keep_rate=self.keep_rate, pools=self.pools.counts(), tokens_processed=w["tokens_processed"],
        )
        return m

