"""Losses on hand-computed inputs: values, gradients, masking on both sides, clamp, KL, non-finite."""
from __future__ import annotations

import math

import pytest
import torch

from node.trainer.config import LossConfig
from node.trainer.loss import LossInputs, LossOutputs, aipo_loss, default_loss, opd_loss, resolve_loss, sft_loss


def _inputs(trainer, inference, adv, mask=None, teacher=None):
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    n = len(trainer)
    return LossInputs(
        trainer_logprobs=lp,
        inference_logprobs=torch.tensor(inference, dtype=torch.float64),
        teacher_logprobs=None if teacher is None else torch.tensor(teacher, dtype=torch.float64),
        advantages=torch.tensor(adv if isinstance(adv, list) else [adv] * n, dtype=torch.float64),
        loss_mask=torch.tensor(mask if mask is not None else [True] * n),
    )


def _grad(out: LossOutputs, inputs: LossInputs) -> list[float]:
    out.loss.backward()
    return inputs.trainer_logprobs.grad.tolist()


def test_default_loss_plain_tokens_value_and_gradient():
    # Two tokens, small ratio changes, positive advantage: no masking, no clamp.
    lt, li, a = [math.log(0.5), math.log(0.3)], [math.log(0.45), math.log(0.32)], 0.5
    inp = _inputs(lt, li, a)
    out = default_loss(inp, kl_tau=0.01)
    r = [0.5 / 0.45, 0.3 / 0.32]
    expected = sum(-a * ri + 0.01 * math.log(ri) ** 2 for ri in r)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    # d/dlp of −A·r is −A·r (r = exp(lp − lp_inf)); of τ(log r)² is 2τ·log r.
    assert _grad(out, inp) == pytest.approx([-a * ri + 2 * 0.01 * math.log(ri) for ri in r], rel=1e-12)
    assert out.metrics["masked_frac"] == 0 and out.metrics["clipped_frac"] == 0
    assert out.metrics["mean_ratio"] == pytest.approx(sum(r) / 2)
    assert out.metrics["nonfinite"] == 0


def test_dppo_masks_positive_advantage_when_probability_rose_too_far():
    # p: 0.2 -> 0.5 (Δp = +0.3 > 0.2) with A > 0: PG masked, KL stays.
    inp = _inputs([math.log(0.5)], [math.log(0.2)], 1.0)
    out = default_loss(inp, kl_tau=0.1)
    lr = math.log(0.5 / 0.2)
    assert out.loss.item() == pytest.approx(0.1 * lr * lr)
    assert _grad(out, inp) == pytest.approx([2 * 0.1 * lr])
    assert out.metrics["masked_frac"] == 1.0
    # The same move with A ≤ 0 is not masked (it is the direction being pushed back).
    inp2 = _inputs([math.log(0.5)], [math.log(0.2)], -1.0)
    out2 = default_loss(inp2, kl_tau=0.0)
    assert out2.metrics["masked_frac"] == 0.0
    assert out2.loss.item() == pytest.approx(0.5 / 0.2)  # −(−1)·min(2.5, 4)


def test_dppo_masks_nonpositive_advantage_when_probability_fell_too_far():
    inp = _inputs([math.log(0.1)], [math.log(0.6)], 0.0)  # Δp = −0.5 < −0.2 with A = 0
    out = default_loss(inp, kl_tau=0.0)
    assert out.metrics["masked_frac"] == 1.0
    assert out.loss.item() == 0.0
    inp2 = _inputs([math.log(0.1)], [math.log(0.6)], 2.0)  # A > 0: not masked
    out2 = default_loss(inp2, kl_tau=0.0)
    assert out2.metrics["masked_frac"] == 0.0
    assert out2.loss.item() == pytest.approx(-2.0 * 0.1 / 0.6)


def test_mask_thresholds_are_configurable():
    inp = _inputs([math.log(0.5)], [math.log(0.2)], 1.0)
    assert default_loss(inp, dppo_mask_high=0.5).metrics["masked_frac"] == 0.0


def test_importance_ratio_clamp_keeps_truncated_gradient():
    # Tiny probabilities: Δp is small (no DPPO mask) but the ratio is 10 > is_clip = 4.
    inp = _inputs([math.log(1e-3)], [math.log(1e-4)], 0.5)
    out = default_loss(inp, kl_tau=0.0, is_clip=4.0)
    assert out.loss.item() == pytest.approx(-0.5 * 4.0)
    # Truncated IS: gradient −A·min(r, c), not zero (min(r, c) differentiated directly would be 0).
    assert _grad(out, inp) == pytest.approx([-0.5 * 4.0])
    assert out.metrics["clipped_frac"] == 1.0 and out.metrics["masked_frac"] == 0.0


def test_loss_mask_excludes_tokens_entirely():
    inp = _inputs([math.log(0.5), math.log(0.4)], [math.log(0.45), math.log(0.1)], 1.0, mask=[True, False])
    out = default_loss(inp, kl_tau=0.05)
    r = 0.5 / 0.45
    assert out.loss.item() == pytest.approx(-r + 0.05 * math.log(r) ** 2)
    assert _grad(out, inp)[1] == 0.0
    assert out.metrics["loss_tokens"] == 1


def test_non_finite_ratios_are_masked_counted_and_never_reach_the_gradient():
    inp = _inputs([math.log(0.5), -math.inf, 0.0, math.log(0.3)],
                  [math.log(0.5), math.log(0.5), -2000.0, math.nan], 1.0)
    out = default_loss(inp, kl_tau=0.1)
    assert out.metrics["nonfinite"] == 3
    assert torch.isfinite(out.loss)
    g = _grad(out, inp)
    assert all(math.isfinite(x) for x in g)
    assert g[1:] == [0.0, 0.0, 0.0]
    assert out.loss.item() == pytest.approx(-1.0)  # only token 0: r = 1, log r = 0


def test_aipo_is_truncated_importance_weighted_pg_without_kl_or_mask():
    inp = _inputs([math.log(0.5), math.log(1e-3)], [math.log(0.2), math.log(1e-4)], [1.0, -1.0])
    out = aipo_loss(inp, delta=4.0)
    assert out.loss.item() == pytest.approx(-(2.5 * 1.0) - (4.0 * -1.0))  # no DPPO mask on token 0
    assert _grad(out, inp) == pytest.approx([-2.5, 4.0])
    assert out.metrics["clipped_frac"] == 0.5


def test_sft_loss_is_token_nll():
    inp = _inputs([math.log(0.5), math.log(0.25)], [0.0, 0.0], 0.0)
    out = sft_loss(inp)
    assert out.loss.item() == pytest.approx(math.log(2) + math.log(4))
    assert _grad(out, inp) == pytest.approx([-1.0, -1.0])
    assert out.metrics["nll"] == pytest.approx((math.log(2) + math.log(4)) / 2)


def test_opd_loss_gradient_is_reverse_kl_estimator():
    # Sampled on-policy (r = 1): grad = (log π − log π_T) per token.
    lt, teacher = [math.log(0.5), math.log(0.1)], [math.log(0.25), math.log(0.4)]
    inp = _inputs(lt, lt, 0.0, teacher=teacher)
    out = opd_loss(inp)
    gaps = [math.log(2), math.log(0.25)]
    assert out.loss.item() == pytest.approx(sum(gaps))
    assert _grad(out, inp) == pytest.approx(gaps)
    assert out.metrics["teacher_kl"] == pytest.approx(sum(gaps) / 2)
    with pytest.raises(ValueError):
        opd_loss(_inputs(lt, lt, 0.0))


def test_resolve_loss_by_mode_type_and_custom_import_path():
    inp = _inputs([math.log(0.5)], [math.log(0.45)], 1.0)
    assert resolve_loss("sft", LossConfig())(inp).metrics["nll"] == pytest.approx(math.log(2))
    assert "masked_frac" in resolve_loss("rl", LossConfig())(inp).metrics
    assert "masked_frac" not in resolve_loss("rl", LossConfig(type="aipo"))(inp).metrics
    custom = resolve_loss("rl", LossConfig(type="custom", import_path="tests.unit.test_loss:scaled_nll",
                                           kwargs={"scale": 3.0}))
    assert custom(inp).loss.item() == pytest.approx(3.0 * math.log(2))


def test_custom_loss_without_path_is_a_config_error():
    with pytest.raises(ValueError):
        LossConfig(type="custom")


def scaled_nll(inputs: LossInputs, *, scale: float) -> LossOutputs:
    """A custom loss for the import-path test."""
    return LossOutputs(loss=-scale * inputs.trainer_logprobs[inputs.loss_mask].sum())
