"""Packed and shared-prompt layouts give the same logprobs and gradients as unpacked sequences."""
from __future__ import annotations

import random

import pytest
import torch

from node.trainer.forward import attention_mask_4d, micro_batch_logprobs, sequence_logprobs
from node.trainer.model import build_tiny_model_dir, load_model
from node.trainer.packing import TrainSample, build_micro_batches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=3)


def _samples(seed: int = 0, groups: int = 3, g: int = 4) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for gi in range(groups):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randint(2, 12))]
        for j in range(g):
            c = [rng.randrange(4, 50) for _ in range(rng.randint(1, 9))]
            out.append(TrainSample(prompt, c, [-1.0] * len(c), rng.uniform(-1, 1), key=(gi, j)))
    return out


def _packed_logprobs(model, samples, layout, limit):
    got = {}
    for mb in build_micro_batches(samples, layout, limit):
        slices = [s for r in mb.rows for s in r.slices]
        for sl, lp in zip(slices, micro_batch_logprobs(model, mb)):
            got[sl.sample.key] = lp
    return got


def test_shared_prompt_row_layout_mask_and_positions():
    a = TrainSample([10, 11], [20], [-1.0], 0.0, key=(0, 0))
    b = TrainSample([10, 11], [21, 22], [-1.0, -1.0], 0.0, key=(0, 1))
    (mb,) = build_micro_batches([a, b], "shared_prompt", 64)
    row = mb.rows[0]
    assert row.input_ids == [10, 11, 20, 21, 22]
    assert row.position_ids == [0, 1, 2, 2, 3]  # each completion continues from the prompt's end
    assert [s.pred_index for s in row.slices] == [[1], [1, 3]]
    allowed = attention_mask_4d(mb.rows, 5, "sdpa", torch.float32)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # completion 0 sees the prompt and itself
        [1, 1, 0, 1, 0],  # completion 1 does not see completion 0
        [1, 1, 0, 1, 1],
    ]
    eager = attention_mask_4d(mb.rows, 5, "eager", torch.float32)[0, 0]
    assert eager[3, 2] == torch.finfo(torch.float32).min and eager[3, 1] == 0


def test_packed_rows_are_block_diagonal_with_restarting_positions():
    a = TrainSample([10, 11], [20], [-1.0], 0.0)
    b = TrainSample([12], [21, 22], [-1.0, -1.0], 0.0)
    (mb,) = build_micro_batches([a, b], "packed", 64)
    assert mb.rows[0].position_ids == [0, 1, 2, 0, 1, 2]
    allowed = attention_mask_4d(mb.rows, 6, "sdpa", torch.float32)[0, 0]
    assert not allowed[3:, :3].any() and allowed[5, 3:].all()


def test_micro_batches_respect_the_token_limit_and_split_big_groups():
    samples = _samples(groups=2, g=8)
    for layout in ("packed", "shared_prompt"):
        for mb in build_micro_batches(samples, layout, 40):
            assert mb.tokens <= 40
        keys = [s.sample.key for mb in build_micro_batches(samples, layout, 40) for r in mb.rows for s in r.slices]
        assert sorted(keys) == sorted(s.key for s in samples)  # every sample exactly once
    for mb in build_micro_batches(samples, "padded", 60):
        assert mb.padded_tokens <= 60 or len(mb.rows) == 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_layouts_match_unpacked_logprobs(model_dir, attn, layout):
    model = load_model(model_dir, attn_implementation=attn)
    samples = _samples()
    with torch.no_grad():
        ref = {s.key: sequence_logprobs(model, s.prompt_ids, s.completion_ids) for s in samples}
        for limit in (48, 4096):  # several micro-batches, and everything in one row
            got = _packed_logprobs(model, samples, layout, limit)
            for s in samples:
                torch.testing.assert_close(got[s.key], ref[s.key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["packed", "shared_prompt"])
def test_packed_gradients_match_unpacked(model_dir, layout):
    model = load_model(model_dir)
    samples = _samples(seed=1)
    weights = {s.key: torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(hash(s.key) % 1000))
               for s in samples}

    def grads(compute) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        compute().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads(lambda: sum((sequence_logprobs(model, s.prompt_ids, s.completion_ids) * weights[s.key]).sum()
                            for s in samples))
    got = grads(lambda: sum((lp * weights[k]).sum() for k, lp in
                            _packed_logprobs(model, samples, layout, 64).items()))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=name)
