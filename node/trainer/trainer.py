"""The training loop's core: groups in, optimizer steps out.

Gradient accumulation: every micro-batch back-propagates the SUM of its per-token losses; at step
time the summed gradients are divided by the batch's loss-token count. Gradients are linear, so this
is exactly the gradient of (batch loss sum / batch tokens) whatever the micro-batching or the order in
which groups arrived -- which is what makes streaming mode (k = 0 periodic asynchrony: back-propagate
each group as it arrives, step when the batch is full) identical to training on the whole batch.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

import torch

from node.trainer.advantages import resolve_advantage
from node.trainer.buffer import DifficultyPools, KeepRate, uninformative
from node.trainer.config import TrainerConfig
from node.trainer.filters import apply_filters, build_filters
from node.trainer.loss import sft_loss
from node.trainer.runner import LocalRunner, LossFn, LossTally, ModelRunner, samples_of
from node.trainer.state import latest_snapshot, read_json, read_snapshot_state, write_snapshot
from node.trainer.types import Group, validate_group
from protocol.errors import PrimeNodeError


class TrainerError(PrimeNodeError):
    pass


class Trainer:
    """Not thread-safe: call every method from one thread (the coordinator's trainer thread).

    The model, its optimizers and the arithmetic on them belong to the trainer's model runner
    (node/trainer/runner.py): `runner=LocalRunner` (the default) keeps them in this process,
    `runner=FSDPRunner` (node/trainer/distributed.py, inside a process group) shards them over local ranks.
    Everything else -- what is trained on, when a step is taken, the metrics, the snapshot's bookkeeping --
    is the Trainer's, the same for both."""
    def __init__(self, model_dir: str | Path, cfg: TrainerConfig | None = None, *, batch_prompts: int = 8,
                 state_dir: str | Path | None = None, stream: bool = False, temperature: float = 1.0,
                 max_sequence_tokens: int = 32768, device: str = "cpu", attn_implementation: str = "sdpa",
                 runner: type[ModelRunner] = LocalRunner) -> None:
        if batch_prompts < 1:
            raise TrainerError("batch_prompts must be at least 1")
        self.cfg = cfg or TrainerConfig()
        self.model_dir = Path(model_dir)
        self.batch_prompts = batch_prompts
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.stream = stream
        self.temperature = temperature
        self.max_sequence_tokens = max_sequence_tokens
        self.runner: ModelRunner = runner(self.model_dir, self.cfg, temperature=temperature, device=device,
                                          attn_implementation=attn_implementation)
        self.vocab_size = self.runner.vocab_size
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions:  # a longer sequence would index past the position table
            self.max_sequence_tokens = min(self.max_sequence_tokens, int(positions))
        self.loss_fn: LossFn = self.runner.loss_fn
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
    def resume(cls, state_dir: str | Path, cfg: TrainerConfig | None = None, *, lift_pools: bool = True,
               model_dir: str | Path | None = None, runner: type[ModelRunner] = LocalRunner,
               **kwargs: Any) -> "Trainer":
        """A Trainer continuing from the latest snapshot in `state_dir` (see node.trainer.state), which the
        same kind of runner wrote. Its model is built from the directory the runner names for the snapshot
        (LocalRunner: the snapshot's own model/; FSDPRunner: `model_dir`, default the base model the run
        started from), then the runner loads its weights and optimizer; the rest is the Trainer's."""
        state_dir = Path(state_dir)
        cfg = cfg or TrainerConfig()
        snap = latest_snapshot(state_dir)
        meta = read_json(snap / "trainer.json")
        base = runner.model_dir_of_snapshot(snap, meta, model_dir)
        kwargs.pop("state_dir", None)  # snapshots keep going to the directory resumed from
        trainer = cls(base, cfg, state_dir=state_dir, runner=runner, **kwargs)
        trainer.runner.load_snapshot(snap)
        restored = read_snapshot_state(snap, meta, cfg, lift_pools=lift_pools)
        trainer.step_count = restored.step
        trainer.pools = restored.pools
        trainer.keep.load_json(restored.keep_history)
        # Already selected and given advantages: straight into the queue. In stream mode this replays their
        # forward/backward (on every rank), and the window's loss-token count (the gradient divisor) includes
        # them again.
        for g in restored.queued_groups:
            trainer._enqueue(g)
        return trainer

    @property
    def model(self) -> Any:
        """The runner's model (FSDPRunner: rank 0's shard of it; to evaluate, use full_model())."""
        return self.runner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The RL optimizer (the warm start's is another, see sft())."""
        return self.runner.optimizer

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
        metrics = self._optimizer_step(self.optimizer)
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
        return self.runner.weights_for_broadcast()

    def adapter_for_broadcast(self):
        """With trainer.lora, the adapter to publish alone (node/trainer/lora.py BroadcastAdapter), else None."""
        return self.runner.adapter_for_broadcast()

    def full_model(self) -> torch.nn.Module:
        """A plain (unsharded) model holding the current weights, for evaluation: the model itself on a
        LocalRunner, rank 0's gathered copy on an FSDPRunner (node/coordinator/evaluation.py)."""
        return self.runner.full_model()

    def close(self, timeout: float = 10.0) -> None:
        """Release what this trainer holds beyond its memory (an FSDPRunner's ranks, within about `timeout`
        seconds). Never raises."""
        self.runner.close(timeout)

    def abort(self) -> None:
        """From any thread: make a call blocked on the trainer's other ranks fail now (FSDPRunner: kills
        them); close() afterwards only leaves the process group. Nothing to do on a LocalRunner."""
        self.runner.abort()

    def save_state(self) -> Path:
        if self.state_dir is None:
            raise TrainerError("this Trainer has no state_dir to save into")
        return write_snapshot(self, self.state_dir, self.runner.write_weights, **self.runner.snapshot_meta())

    def sft(self, batches: Iterable[list[Group]], lr: float | None = None) -> list[float]:
        """Supervised steps (sft_loss), one per batch of groups, with an AdamW of their own (`lr`, default
        cfg.warm_start_lr) so that the RL optimizer starts clean; `step_count` does not advance. Returns each
        step's per-token NLL. The warm start (node/trainer/warm_start.py) runs it before RL step 1."""
        losses = []
        with self.runner.warm_start_scope():  # with trainer.lora: the base trains, the adapters stay at init
            optimizer = self.runner.new_optimizer(lr or self.cfg.warm_start_lr)
            for groups in batches:
                self._reset_window()
                self.forward_backward(groups, sft_loss)
                losses.append(self.tally.loss_sum / max(self.tally.loss_tokens, 1))
                self._optimizer_step(optimizer)
        self._reset_window()
        return losses

    def forward_backward(self, groups: list[Group], loss_fn: LossFn) -> None:
        """Back-propagate the summed loss of `groups` into .grad (accumulating), tallied in `tally`. An
        FSDPRunner takes the trainer's own `loss_fn` or sft_loss only (its ranks resolve them by name)."""
        t0 = time.perf_counter()
        self.runner.forward_backward(samples_of(groups), loss_fn, self.tally)
        self._win["seconds"] += time.perf_counter() - t0

    # ----------------------------------------------------------------- training internals

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The runner's step on the window's gradients, and the step's metrics."""
        tokens = self.tally.loss_tokens
        grad_norm, skipped = self.runner.step(optimizer, self.cfg.max_grad_norm, tokens)
        return {"loss": self.tally.loss_sum / max(tokens, 1), "grad_norm": grad_norm,
                "loss_tokens": tokens, "lr": optimizer.param_groups[0]["lr"], "optimizer_skipped": skipped}

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
        # The step's offered groups and timing; `tally` is what back-propagation has added up (the gradient's
        # divisor, the loss metrics), which the runner accumulates into.
        self._win: dict[str, Any] = {
            "rewards": [], "staleness": [], "offered": 0, "difficulty_dropped": 0, "groups_emptied_by_filters": 0,
            "filtered": {}, "seconds": 0.0,
        }
        self.tally = LossTally()

    def _window_metrics(self, batch: list[Group]) -> dict[str, Any]:
        w, t = self._win, self.tally
        tokens = max(t.loss_tokens, 1)
        trained = [r for g in batch for r in g.rollouts]
        m: dict[str, Any] = {k: v / tokens for k, v in t.weighted.items()}
        m.update(
            reward_mean=sum(w["rewards"]) / len(w["rewards"]) if w["rewards"] else 0.0,
            reward_mean_trained=sum(r.reward for r in trained) / len(trained) if trained else 0.0,
            groups=len(batch), samples=len(trained), groups_offered=w["offered"],
            difficulty_dropped=w["difficulty_dropped"], filtered=dict(w["filtered"]),
            groups_emptied_by_filters=w["groups_emptied_by_filters"], nonfinite=t.nonfinite,
            completion_len_mean=sum(len(r.completion_ids) for r in trained) / max(len(trained), 1),
            staleness_mean=sum(w["staleness"]) / len(w["staleness"]) if w["staleness"] else 0.0,
            keep_rate=self.keep_rate, pools=self.pools.counts(), tokens_processed=t.tokens_processed,
        )
        return m
