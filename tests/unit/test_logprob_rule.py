"""The verifier's logprob rule (verify/rollouts.py, Thresholds.logprob_verdict) on deviation profiles measured on
the real model (bench/verify_vllm_bf16.py): one honest bf16 outlier token (up to ~0.5 nats x T) must not fail a
short completion's mean, while a lie spread over the completion, or one token beyond the max limit, still fails."""
from __future__ import annotations

import pytest
import torch

from verify.rollouts import Thresholds

NEW, OLD = Thresholds(), Thresholds(mean_excludes_worst=False)


def bad(th: Thresholds, devs: list[float]) -> bool:
    return th.logprob_verdict(torch.tensor(devs))[2]


@pytest.mark.parametrize("devs", [
    [0.46] + [0.05] * 7,  # an 8-token answer with one outlier: mean 0.101 > 0.1 with it, 0.05 without
    [0.5],  # a 1-token answer: nothing beside its worst token, the max limit alone
    [0.3, 0.12],  # a 2-token answer ("6<|im_end|>") with an unlikely first token
    [0.05, 0.42, 0.05, 0.06],  # 0.145 > 0.1 x sqrt(8/4) with it
])
def test_one_honest_outlier_token_passes_but_failed_the_every_token_mean(devs):
    assert not bad(NEW, devs)
    assert bad(OLD, devs)


@pytest.mark.parametrize("devs", [
    [0.12] * 8,  # every token lied about by 0.12: the mean over the 7 left is 0.12 > 0.107
    [0.6] + [0.12] * 8,  # the same with one more token at the max limit: leaving it out hides nothing
    [0.2] * 3,  # a short completion lied about everywhere: 0.2 > 0.1 x sqrt(8/2)
    [0.61],  # one token beyond the max limit fails alone
    [0.05] * 30 + [0.7],
])
def test_spread_lies_and_tokens_beyond_the_max_still_fail(devs):
    assert bad(NEW, devs)


def test_the_checked_mean_leaves_only_the_worst_token_out():
    mean, worst, _ = NEW.logprob_verdict(torch.tensor([0.1, 0.4, 0.2]))
    assert worst == pytest.approx(0.4) and mean == pytest.approx(0.15)
    assert OLD.logprob_verdict(torch.tensor([0.1, 0.4, 0.2]))[0] == pytest.approx(0.7 / 3)
