"""The trainer: model, losses, advantages, filters, buffer, training step, trainer checkpoints.

Coordinator-facing API (torch is imported lazily: `import node.trainer` is cheap)::

    from node.trainer import Trainer, Rollout, Group
    trainer = Trainer(model_dir, cfg.trainer, batch_prompts=8, state_dir=Path(...),
                      stream=False, temperature=cfg.sampling.temperature)
    # or: Trainer.resume(state_dir, cfg.trainer, batch_prompts=8, ...)
    # FSDP2 over local ranks: runner=FSDPRunner (node.trainer.distributed; `launch` starts the ranks)
    ok = trainer.add_group(Group(prompt_id="p1", prompt_ids=[...], rollouts=[
        Rollout(completion_ids=[...], inference_logprobs=[...], reward=0.7, policy_step=3,
                finish_reason="stop", teacher_logprobs=None), ...]))   # False: filtered out
    trainer.batch_complete          # enough kept groups for the next step
    metrics = trainer.step()        # dict: loss, reward_mean, masked_frac, clipped_frac, grad_norm, ...
    trainer.weights_for_broadcast() # dict[str, Tensor]: broadcast dtype (bf16 default), contiguous CPU
    trainer.save_state(); trainer.step_count; trainer.keep_rate   # oversample prompts by 1 / keep_rate
    trainer.pools.counts()                                          # difficulty pools (easy/hard)

The model, its optimizers and the arithmetic on them are the Trainer's model runner's
(node.trainer.runner: LocalRunner, or FSDPRunner); the Trainer itself is one class for both.

Streaming (`stream=True`, k = 0 periodic asynchrony): add_group back-propagates at once, step() only
applies the optimizer; the result equals training on the full batch.

Models: `build_tiny_model_dir(out_dir, hidden_size=.., layers=.., heads=.., seed=..)` (Llama config +
character tokenizer, safetensors), `load_model(dir, dtype=...)`, `load_tokenizer(dir)`,
`eos_token_ids(tokenizer, model.config)` (ids a sampler stops on).
Warm start: `sft_warm_start(trainer, task, tokenizer, steps=...)` before RL step 1.
Losses (`node.trainer.loss`): default (DPPO mask + clamped IS + KL), aipo, sft, opd, custom by import path.
"""
from __future__ import annotations

import importlib
from typing import Any

from node.trainer.types import Group, Rollout, RolloutError

_LAZY = {
    "Trainer": "node.trainer.trainer",
    "TrainerError": "node.trainer.trainer",
    "build_tiny_model_dir": "node.trainer.model",
    "load_model": "node.trainer.model",
    "ModelLoadError": "node.trainer.model_dir",
    "load_tokenizer": "node.trainer.tokenizer",
    "eos_token_ids": "node.trainer.tokenizer",
    "sft_warm_start": "node.trainer.warm_start",
    "sequence_logprobs": "node.trainer.forward",
}

__all__ = ["Group", "Rollout", "RolloutError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'node.trainer' has no attribute {name!r}")
