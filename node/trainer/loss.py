"""Per-sequence losses. Each returns the SUM over the sequence's loss tokens; the trainer divides the
batch's total by the batch's loss-token count (so long and short sequences weigh per token).

All inputs are 1-D tensors of one sequence's completion tokens. `trainer_logprobs` carries the
gradient; everything else is data. Tokens whose ratio is not finite are dropped from every term and
counted, and the inputs are sanitised *before* any exp/log so no NaN or inf can reach a gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from node.plugins import PluginError, import_object


@dataclass
class LossInputs:
    trainer_logprobs: torch.Tensor  # [T], requires grad
    inference_logprobs: torch.Tensor  # [T], what the sampler reported
    teacher_logprobs: torch.Tensor | None  # [T] in opd mode, else None
    advantages: torch.Tensor  # [T], the sequence's advantage broadcast per token
    loss_mask: torch.Tensor  # [T] bool, True where the token is trained on


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar: sum over loss tokens
    metrics: dict[str, float] = field(default_factory=dict)


LossFn = Callable[..., LossOutputs]


def loss_mask_tensor(sample, device) -> torch.Tensor:
    """A TrainSample's loss mask: all its completion tokens, or only the model's in a multi-turn episode."""
    if sample.loss_mask is None:
        return torch.ones(len(sample.completion_ids), dtype=torch.bool, device=device)
    return torch.tensor(sample.loss_mask, dtype=torch.bool, device=device)


def _ratio_parts(inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(log_ratio with invalid tokens zeroed, valid mask, count of non-finite tokens among loss tokens)."""
    mask = inputs.loss_mask.bool()
    raw = inputs.trainer_logprobs - inputs.inference_logprobs
    with torch.no_grad():
        finite = torch.isfinite(raw) & torch.isfinite(torch.exp(raw.detach()))
    valid = mask & finite
    # torch.where keeps the gradient of the chosen branch only; the zero branch is safe to exp().
    log_ratio = torch.where(valid, raw, torch.zeros_like(raw))
    return log_ratio, valid, int((mask & ~finite).sum())


def _surrogate(log_ratio: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """A term whose value is `coeff` and whose gradient is `coeff · ∇log π`.

    exp(x − sg(x)) is 1 in value with gradient ∇x, so coeff·exp(log r − sg(log r)) evaluates to the
    importance-weighted term and differentiates like the policy gradient weighted by the *clamped*
    ratio. (Differentiating min(r, c) directly would give zero gradient to every clamped token.)
    """
    return coeff.detach() * torch.exp(log_ratio - log_ratio.detach())


def _base_metrics(valid: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, nonfinite: int) -> dict[str, float]:
    n = int(valid.sum())
    return {
        "loss_tokens": float(int(mask.sum())),
        "mean_ratio": float(ratio[valid].mean()) if n else 1.0,
        "nonfinite": float(nonfinite),
    }


def default_loss(inputs: LossInputs, *, dppo_mask_low: float = 0.2, dppo_mask_high: float = 0.2,
                 adv_tau: float = 1.0, kl_tau: float = 1e-3, is_clip: float = 4.0) -> LossOutputs:
    """DPPO probability-difference masking + clamped importance ratio + squared-log-ratio KL."""
    mask = inputs.loss_mask.bool()
    log_ratio, valid, nonfinite = _ratio_parts(inputs)
    ratio = torch.exp(log_ratio.detach())
    adv = inputs.advantages.to(log_ratio.dtype)
    with torch.no_grad():
        # Δp compares probabilities, not log-probabilities: a change of 0.2 in the probability of a
        # token is "too far" from the sampler in either direction, whatever its magnitude in logs.
        p_trainer = torch.exp(torch.where(valid, inputs.trainer_logprobs.detach(), torch.zeros_like(ratio)))
        p_infer = torch.exp(torch.where(valid, inputs.inference_logprobs, torch.zeros_like(ratio)))
        delta_p = p_trainer - p_infer
        dppo_masked = valid & (((adv > 0) & (delta_p > dppo_mask_high)) | ((adv <= 0) & (delta_p < -dppo_mask_low)))
        pg_tokens = valid & ~dppo_masked
        clipped = valid & (ratio > is_clip)
    pg = -adv_tau * _surrogate(log_ratio, torch.clamp(ratio, max=is_clip) * adv)
    kl = kl_tau * log_ratio.pow(2)
    zero = torch.zeros_like(pg)
    loss = torch.where(pg_tokens, pg, zero).sum() + torch.where(valid, kl, zero).sum()
    metrics = _base_metrics(valid, mask, ratio, nonfinite)
    n_mask = max(int(mask.sum()), 1)
    metrics.update(masked_frac=int(dppo_masked.sum()) / n_mask, clipped_frac=int(clipped.sum()) / n_mask,
                   kl=float(kl.detach()[valid].sum()) / n_mask)
    return LossOutputs(loss=loss, metrics=metrics)


def aipo_loss(inputs: LossInputs, *, delta: float = 4.0) -> LossOutputs:
    """Token-level AIPO: −min(r, δ)·A with the truncated ratio as the gradient weight; no KL, no mask."""
    mask = inputs.loss_mask.bool()
    log_ratio, valid, nonfinite = _ratio_parts(inputs)
    ratio = torch.exp(log_ratio.detach())
    adv = inputs.advantages.to(log_ratio.dtype)
    pg = -_surrogate(log_ratio, torch.clamp(ratio, max=delta) * adv)
    loss = torch.where(valid, pg, torch.zeros_like(pg)).sum()
    metrics = _base_metrics(valid, mask, ratio, nonfinite)
    metrics["clipped_frac"] = int((valid & (ratio > delta)).sum()) / max(int(mask.sum()), 1)
    return LossOutputs(loss=loss, metrics=metrics)


def sft_loss(inputs: LossInputs) -> LossOutputs:
    """Token negative log-likelihood of the given completion (advantages and sampler logprobs unused)."""
    mask = inputs.loss_mask.bool() & torch.isfinite(inputs.trainer_logprobs.detach())
    lp = torch.where(mask, inputs.trainer_logprobs, torch.zeros_like(inputs.trainer_logprobs))
    loss = -lp.sum()
    n = max(int(mask.sum()), 1)
    return LossOutputs(loss=loss, metrics={"loss_tokens": float(int(inputs.loss_mask.bool().sum())),
                                           "nll": float(loss.detach()) / n})


def opd_loss(inputs: LossInputs, *, is_clip: float = 4.0) -> LossOutputs:
    """On-policy distillation: reverse KL to the teacher, estimated on the sampled tokens.

    ∇ KL(π‖π_T) = E_π[(log π − log π_T) ∇log π]; the samples came from the inference policy, so each
    token is importance-weighted by the clamped ratio r = π/π_inference.
    """
    if inputs.teacher_logprobs is None:
        raise ValueError("opd_loss needs teacher_logprobs")
    mask = inputs.loss_mask.bool()
    log_ratio, valid, nonfinite = _ratio_parts(inputs)
    valid = valid & torch.isfinite(inputs.teacher_logprobs)
    ratio = torch.exp(log_ratio.detach())
    teacher = torch.where(valid, inputs.teacher_logprobs, torch.zeros_like(ratio))
    trainer_lp = torch.where(valid, inputs.trainer_logprobs.detach(), torch.zeros_like(ratio))
    gap = trainer_lp - teacher  # per-token log π − log π_T
    term = _surrogate(log_ratio, torch.clamp(ratio, max=is_clip) * gap)
    loss = torch.where(valid, term, torch.zeros_like(term)).sum()
    metrics = _base_metrics(valid, mask, ratio, nonfinite)
    metrics["teacher_kl"] = float(gap[valid].sum()) / max(int(mask.sum()), 1)
    return LossOutputs(loss=loss, metrics=metrics)


def resolve_loss(mode: str, cfg: Any) -> Callable[[LossInputs], LossOutputs]:
    """The loss for a trainer mode and `trainer.loss` config, with its keyword arguments bound."""
    if mode == "sft":
        return sft_loss
    if mode == "opd":
        return lambda inputs: opd_loss(inputs, is_clip=cfg.is_clip)
    if cfg.type == "default":
        kw = dict(dppo_mask_low=cfg.dppo_mask_low, dppo_mask_high=cfg.dppo_mask_high, adv_tau=cfg.adv_tau,
                  kl_tau=cfg.kl_tau, is_clip=cfg.is_clip)
        return lambda inputs: default_loss(inputs, **kw)
    if cfg.type == "aipo":
        return lambda inputs: aipo_loss(inputs, delta=cfg.aipo_delta)

    fn = import_object(cfg.import_path)
    if not callable(fn):
        raise PluginError(f"loss {cfg.import_path!r} is not callable")
    kwargs = dict(cfg.kwargs)
    return lambda inputs: fn(inputs, **kwargs)
