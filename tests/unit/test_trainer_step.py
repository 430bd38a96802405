"""The training step: micro-batching = full batch, streaming = batch mode, filters, modes, broadcast."""
from __future__ import annotations

import random

import pytest
import torch

from node.trainer import Group, Rollout, RolloutError, Trainer
from node.trainer.config import BufferConfig, FiltersConfig, TrainerConfig
from node.trainer.model import build_tiny_model_dir
from node.trainer.trainer import TrainerError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=5)


def make_groups(n: int, g: int = 4, seed: int = 0, teacher: bool = False) -> list[Group]:
    """Synthetic rollouts with mixed rewards (never all 0 / all 1, so none is difficulty-filtered)."""
    rng = random.Random(seed)
    groups = []
    for i in range(n):
        prompt = [rng.randrange(5, 40) for _ in range(rng.randint(2, 10))]
        rollouts = []
        for j in range(g):
            c = [rng.randrange(4, 40) for _ in range(rng.randint(1, 8))]
            rollouts.append(Rollout(c, [-rng.uniform(2.5, 4.5) for _ in c], reward=float(j % 2) * rng.uniform(0.5, 1),
                                    teacher_logprobs=[-rng.uniform(1, 5) for _ in c] if teacher else None))
        groups.append(Group(f"p{seed}-{i}", prompt, rollouts))
    return groups


def train_batches(trainer: Trainer, batches: list[list[Group]]) -> list[dict]:
    """One trainer step per batch of groups; the steps' metrics."""
    out = []
    for batch in batches:
        for g in batch:
            trainer.add_group(g)
        out.append(trainer.step())
    return out


def straight_and_resumed(model_dir, cfg: TrainerConfig, state_dir, batches: list[list[Group]], *,
                         saved_after: int = 2):
    """One trainer through every batch; another through the first `saved_after`, saved to `state_dir`; a third
    resumed from that snapshot through the rest. Returns (straight, resumed, the snapshot's directory)."""
    straight = Trainer(model_dir, cfg, batch_prompts=2)
    train_batches(straight, batches)
    first = Trainer(model_dir, cfg, batch_prompts=2, state_dir=state_dir)
    train_batches(first, batches[:saved_after])
    snap = first.save_state()
    del first
    resumed = Trainer.resume(state_dir, cfg, batch_prompts=2)
    assert resumed.step_count == saved_after
    train_batches(resumed, batches[saved_after:])
    return straight, resumed, snap


def assert_same_weights_and_moments(straight: Trainer, resumed: Trainer) -> None:
    """Bit-identical weights and optimizer moments (the same parameters indexed)."""
    for name, p in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], p), name
    s_opt, r_opt = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert set(s_opt) == set(r_opt)
    for idx in s_opt:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s_opt[idx][key], r_opt[idx][key])


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _selected(trainer: Trainer, groups: list[Group]) -> list[Group]:
    return [trainer._rl_select(g, [r.reward for r in g.rollouts]) for g in groups]


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_micro_batched_gradient_equals_full_batch(model_dir, layout):
    full = Trainer(model_dir, TrainerConfig(micro_batch_tokens=100_000, packing=layout), batch_prompts=4)
    micro = Trainer(model_dir, TrainerConfig(micro_batch_tokens=64, packing=layout), batch_prompts=4)
    groups = make_groups(4)
    for t in (full, micro):
        t.forward_backward(_selected(t, groups), t.loss_fn)
    assert full.tally.loss_tokens == micro.tally.loss_tokens
    g_full, g_micro = _grads(full), _grads(micro)
    assert set(g_full) == set(g_micro) and g_full
    for name in g_full:
        torch.testing.assert_close(g_micro[name], g_full[name], atol=1e-6, rtol=1e-5, msg=name)


def test_all_layouts_give_the_same_step(model_dir):
    weights = []
    for layout in ("padded", "packed", "shared_prompt"):
        t = Trainer(model_dir, TrainerConfig(packing=layout, micro_batch_tokens=64), batch_prompts=3)
        for g in make_groups(3, seed=2):
            t.add_group(g)
        t.step()
        weights.append(t.model.state_dict())
    # Adam divides by sqrt(v): float summation-order noise in a near-zero gradient element becomes a
    # visible (still tiny) weight difference, hence atol 1e-5 on weights (the gradients match to 1e-6).
    for other in weights[1:]:
        for name in weights[0]:
            torch.testing.assert_close(other[name], weights[0][name], atol=1e-5, rtol=1e-5)


def test_streaming_equals_training_on_the_whole_batch(model_dir):
    batch = Trainer(model_dir, TrainerConfig(), batch_prompts=3)
    stream = Trainer(model_dir, TrainerConfig(), batch_prompts=3, stream=True)
    groups = make_groups(5, seed=4)
    for t in (batch, stream):
        for g in groups[:3]:
            assert t.add_group(g)
    assert stream.accumulated and not stream.pending  # already back-propagated on arrival
    assert batch.pending and not batch.accumulated
    assert stream.batch_complete and batch.batch_complete
    m_batch, m_stream = batch.step(), stream.step()
    assert m_batch["loss"] == pytest.approx(m_stream["loss"], rel=1e-5)
    for name, p in batch.model.state_dict().items():
        torch.testing.assert_close(stream.model.state_dict()[name], p, atol=1e-5, rtol=1e-5)
    # Groups beyond a full batch wait, then start the next batch after the step.
    for g in groups[3:]:
        stream.add_group(g)
    assert len(stream.accumulated) == 2 and not stream.pending


def test_step_metrics_and_incomplete_batch(model_dir):
    t = Trainer(model_dir, TrainerConfig(), batch_prompts=2)
    with pytest.raises(TrainerError, match="incomplete"):
        t.step()
    g1, g2, g3 = make_groups(3, seed=6)
    t.add_group(g1)
    assert not t.batch_complete
    t.add_group(g2)
    t.add_group(g3)  # a third group waits for the next batch
    m = t.step()
    assert t.step_count == 1 and m["step"] == 1 and m["groups"] == 2 and len(t.pending) == 1
    for key in ("loss", "reward_mean", "masked_frac", "clipped_frac", "mean_ratio", "grad_norm", "keep_rate",
                "nonfinite", "loss_tokens", "staleness_mean", "seconds"):
        assert key in m, key
    assert m["grad_norm"] > 0 and m["loss_tokens"] == sum(len(r.completion_ids) for g in (g1, g2) for r in g.rollouts)
    assert t.step(force=True)["groups"] == 1


def test_online_difficulty_filtering_drops_flat_groups_and_lowers_keep_rate(model_dir):
    t = Trainer(model_dir, TrainerConfig(), batch_prompts=2)
    zero = make_groups(1, seed=7)[0]
    for r in zero.rollouts:
        r.reward = 0.0
    assert t.add_group(zero) is False
    assert t.pools.pool_of(zero.prompt_id) == "hard"
    assert t.add_group(make_groups(1, seed=8)[0]) is True
    assert t.keep_rate == pytest.approx(0.5)
    off = Trainer(model_dir, TrainerConfig(buffer=BufferConfig(online_difficulty_filtering=False),
                                           filters=FiltersConfig(enabled=[])), batch_prompts=2)
    assert off.add_group(zero) is True


def test_filtered_rollouts_are_counted(model_dir):
    t = Trainer(model_dir, TrainerConfig(filters=FiltersConfig(enabled=["zero_advantage", "gibberish"],
                                                               gibberish_min_mean_logprob=-4.0)), batch_prompts=1)
    g = make_groups(1, seed=9)[0]
    g.rollouts[0].inference_logprobs = [-4.9] * len(g.rollouts[0].completion_ids)
    g.rollouts[0].reward = 0.7
    assert t.add_group(g)
    m = t.step()
    assert m["filtered"]["gibberish"] == 1 and m["samples"] == 3


def test_malformed_groups_are_rejected_with_a_clear_error(model_dir):
    t = Trainer(model_dir, TrainerConfig(), batch_prompts=1)
    g = make_groups(1)[0]
    g.rollouts[0].completion_ids = [10_000]
    with pytest.raises(RolloutError, match="outside the vocabulary"):
        t.add_group(g)
    g = make_groups(1)[0]
    g.rollouts[1].inference_logprobs = g.rollouts[1].inference_logprobs[:-1] + [float("nan")]
    with pytest.raises(RolloutError, match="finite"):
        t.add_group(g)
    g = make_groups(1)[0]
    g.rollouts[2].inference_logprobs.append(-1.0)
    with pytest.raises(RolloutError, match="logprobs for"):
        t.add_group(g)
    g = make_groups(1)[0]
    g.rollouts[0].finish_reason = "tired"
    with pytest.raises(RolloutError, match="finish_reason"):
        t.add_group(g)
    g = make_groups(1)[0]
    g.rollouts = g.rollouts * 300
    with pytest.raises(RolloutError, match="more than"):
        t.add_group(g)
    with pytest.raises(RolloutError, match="empty prompt"):
        t.add_group(Group("p", [], [Rollout([6], [-1.0], 1.0)]))
    short = Trainer(model_dir, TrainerConfig(), batch_prompts=1, max_sequence_tokens=8)
    with pytest.raises(RolloutError, match="longer than"):
        short.add_group(Group("p", [5] * 6, [Rollout([6] * 3, [-1.0] * 3, 1.0)]))


def test_sft_mode_lowers_nll(model_dir):
    t = Trainer(model_dir, TrainerConfig(mode="sft", lr=1e-2), batch_prompts=2)
    groups = [Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [], 1.0) for r in g.rollouts[:1]])
              for g in make_groups(2, seed=10)]
    nll = []
    for _ in range(4):
        for g in groups:
            t.add_group(g)
        nll.append(t.step()["nll"])
    assert nll[-1] < nll[0]


def test_sft_steps_use_their_own_optimizer_and_leave_the_rl_state_clean(model_dir):
    """Trainer.sft (what the warm start runs): its NLL falls, step_count stays 0, the RL optimizer has taken no
    step (no AdamW moments) and the next RL step's window starts empty."""
    t = Trainer(model_dir, TrainerConfig(lr=1e-3), batch_prompts=2)
    groups = [Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [0.0] * len(r.completion_ids), 1.0)
                                               for r in g.rollouts[:1]], [0.0]) for g in make_groups(2, seed=11)]
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    nll = t.sft([groups] * 4, lr=1e-2)
    assert len(nll) == 4 and nll[-1] < nll[0]
    assert t.step_count == 0 and not t.optimizer.state and t.tally.loss_tokens == 0
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())


def test_opd_mode_needs_teacher_and_moves_towards_it(model_dir):
    from node.trainer.forward import sequence_logprobs

    t = Trainer(model_dir, TrainerConfig(mode="opd", lr=1e-2), batch_prompts=2)
    with pytest.raises(RolloutError, match="teacher"):
        t.add_group(make_groups(1)[0])
    groups = make_groups(2, seed=11, teacher=True)

    def gap() -> float:
        """Mean |log π − log π_teacher| over the tokens: what distillation should shrink."""
        with torch.no_grad():
            diffs = [(sequence_logprobs(t.model, g.prompt_ids, r.completion_ids)
                      - torch.tensor(r.teacher_logprobs)).abs() for g in groups for r in g.rollouts]
        return float(torch.cat(diffs).mean())

    before = gap()
    for _ in range(4):
        for g in groups:
            with torch.no_grad():  # on-policy: the sampler logprobs are the current model's (ratios 1)
                for r in g.rollouts:
                    r.inference_logprobs = sequence_logprobs(t.model, g.prompt_ids, r.completion_ids).tolist()
            t.add_group(g)
        assert "teacher_kl" in t.step()
    assert gap() < 0.8 * before


def test_weights_for_broadcast(model_dir):
    t = Trainer(model_dir, TrainerConfig(), batch_prompts=1)
    w = t.weights_for_broadcast()
    assert all(v.dtype == torch.bfloat16 and v.is_contiguous() and v.device.type == "cpu" for v in w.values())
    assert "lm_head.weight" not in w  # tied to the embeddings, as save_pretrained writes it
    assert len({v.data_ptr() for v in w.values()}) == len(w)
    emb = t.model.get_input_embeddings().weight
    assert torch.equal(w["model.embed_tokens.weight"], emb.detach().to(torch.bfloat16))
    w["model.embed_tokens.weight"].zero_()  # a copy: the model is untouched
    assert emb.abs().sum() > 0
    f32 = Trainer(model_dir, TrainerConfig(broadcast_dtype="float32"), batch_prompts=1).weights_for_broadcast()
    assert all(v.dtype == torch.float32 for v in f32.values())


def nan_loss(inputs, **kwargs):
    from node.trainer.loss import LossOutputs

    return LossOutputs(loss=inputs.trainer_logprobs.sum() * float("nan"))


def test_a_non_finite_gradient_skips_the_update_instead_of_poisoning_weights(model_dir):
    from node.trainer.config import LossConfig

    cfg = TrainerConfig(loss=LossConfig(type="custom", import_path="tests.unit.test_trainer_step:nan_loss"))
    t = Trainer(model_dir, cfg, batch_prompts=1)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.add_group(make_groups(1, seed=12)[0])
    assert t.step()["optimizer_skipped"] is True
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in t.model.parameters())


@pytest.mark.gpu
def test_training_step_on_cuda_matches_cpu(model_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    groups = make_groups(2, seed=13)
    cpu = Trainer(model_dir, TrainerConfig(), batch_prompts=2)
    gpu = Trainer(model_dir, TrainerConfig(), batch_prompts=2, device="cuda")
    for t in (cpu, gpu):
        for g in groups:
            t.add_group(g)
    m_cpu, m_gpu = cpu.step(), gpu.step()
    assert m_gpu["loss"] == pytest.approx(m_cpu["loss"], rel=1e-3, abs=1e-5)
    w = gpu.weights_for_broadcast()
    assert all(v.device.type == "cpu" for v in w.values())
    for name, v in cpu.weights_for_broadcast().items():
        torch.testing.assert_close(w[name].float(), v.float(), atol=1e-2, rtol=1e-2)


def test_a_multi_turn_episode_trains_on_the_model_tokens_only(model_dir):
    """The loss mask of a packed episode: what the environment said (any tokens, any logprobs there) changes
    the context the model's later tokens are trained in, but is never itself a loss token."""
    def episode_groups(env: list[int], env_lps: list[float]) -> list[Group]:
        groups = make_groups(2, seed=6)
        for g in groups:
            for r in g.rollouts:
                n = len(r.completion_ids)
                r.completion_ids = r.completion_ids + env + [7, 8]
                r.inference_logprobs = r.inference_logprobs + env_lps + [-3.0, -3.5]
                r.loss_mask = [True] * n + [False] * len(env) + [True, True]
                r.turns = 2
        return groups

    a, b = (Trainer(model_dir, TrainerConfig(), batch_prompts=2) for _ in range(2))
    a.forward_backward(_selected(a, episode_groups([2, 9, 10, 3], [0.0] * 4)), a.loss_fn)
    b.forward_backward(_selected(b, episode_groups([2, 9, 10, 3], [-9.0] * 4)), b.loss_fn)
    masked = sum(sum(r.loss_mask) for g in episode_groups([2, 9, 10, 3], [0.0] * 4) for r in g.rollouts)
    assert a.tally.loss_tokens == b.tally.loss_tokens == masked
    for name, grad in _grads(a).items():  # the environment's logprobs play no part
        torch.testing.assert_close(_grads(b)[name], grad, atol=0, rtol=0, msg=name)
    with pytest.raises(RolloutError, match="loss_mask"):
        bad = make_groups(1, seed=7)[0]
        bad.rollouts[0].loss_mask = [False] * len(bad.rollouts[0].completion_ids)
        a.add_group(bad)
