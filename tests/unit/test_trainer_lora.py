"""trainer.lora (node/trainer/lora.py): only the adapters train, the base stays bit-identical, the published
weights are the merged model in the base model's own format, snapshots resume exactly; lora off is unchanged."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from node.trainer import Group, Rollout, Trainer
from node.trainer import lora
from node.trainer.config import LoraConfig, TrainerConfig
from node.trainer.model import build_tiny_model_dir, load_model
from node.trainer.state import TrainerStateError
from tests.unit.test_trainer_step import (assert_same_weights_and_moments, make_groups, straight_and_resumed,
                                          train_batches)

RANK, ALPHA = 4, 8
LORA = dict(rank=RANK, alpha=ALPHA)
CFG = TrainerConfig(lr=1e-2, weight_decay=0.01, lora=LORA)
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=11)


def _batches(n: int) -> list[list]:
    return [make_groups(2, seed=300 + i) for i in range(n)]


def _clone(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def test_only_the_adapters_train_and_the_base_stays_bit_identical(model_dir):
    t = Trainer(model_dir, CFG, batch_prompts=2)
    base0 = _clone(lora.base_state_dict(t.model))
    adapters0 = _clone(lora.adapter_state_dict(t.model))
    # 2 layers x 4 attention projections x (A, B); nothing else requires a gradient, nor is in the optimizer
    assert len(adapters0) == 2 * 4 * 2 and all(".lora_A." in n or ".lora_B." in n for n in adapters0)
    trainable = [p for p in t.model.parameters() if p.requires_grad]
    optimized = [p for g in t.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(trainable) == len(adapters0)
    assert all(any(p is q for q in trainable) for p in optimized)

    metrics = train_batches(t, _batches(3))
    assert all(not m["optimizer_skipped"] and m["grad_norm"] > 0 for m in metrics)
    t.weights_for_broadcast()  # merging for publication must not write into the training model
    for name, before in base0.items():
        assert torch.equal(lora.base_state_dict(t.model)[name], before), name
    after = lora.adapter_state_dict(t.model)
    for name, before in adapters0.items():
        assert not torch.equal(after[name], before), f"{name} did not move"
        assert after[name].grad is None  # step() zeroes (drops) them


def test_sft_warm_start_trains_the_base_and_leaves_the_adapters_at_init(model_dir):
    """The warm start builds the base that step 0 publishes in full (lora.base_trainable): the base trains as in
    full fine-tuning, the adapters stay at init (lora_B = 0), so RL's adapters are rank r from zero and only they
    train afterwards. Through the adapters alone it was 4.05 -> 3.60 in these 8 steps (the tied embedding, most of
    this tiny model's capacity, frozen) against 4.05 -> 1.74 at rank 0."""
    t = Trainer(model_dir, TrainerConfig(lora={**LORA, "target_modules": list(ALL_TARGETS)}), batch_prompts=2)
    full = Trainer(model_dir, TrainerConfig(), batch_prompts=2)
    base0, adapters0 = _clone(lora.base_state_dict(t.model)), _clone(lora.plain_adapter(t.model))
    trainable0 = {n for n, p in t.model.named_parameters() if p.requires_grad}
    # reference answers (as node/trainer/warm_start.py builds them): one rollout per group, advantage 0
    batch = [Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [0.0] * len(r.completion_ids), 1.0)
                                              for r in g.rollouts[:1]], [0.0]) for g in make_groups(2, seed=7)]
    nll, nll_full = t.sft([batch] * 8, lr=1e-2), full.sft([batch] * 8, lr=1e-2)
    assert all(b < a for a, b in zip(nll, nll[1:])) and nll[-1] < 0.6 * nll[0], nll
    assert abs(nll[-1] - nll_full[-1]) < 0.02 * nll_full[-1], (nll, nll_full)  # the same training as rank 0
    assert not all(torch.equal(lora.base_state_dict(t.model)[n], w) for n, w in base0.items())
    assert all(torch.equal(lora.plain_adapter(t.model)[n], w) for n, w in adapters0.items())
    assert not any(w.any() for n, w in lora.plain_adapter(t.model).items() if n.endswith(".lora_B"))
    # afterwards only the adapters train again, and RL steps move them and not the base
    assert {n for n, p in t.model.named_parameters() if p.requires_grad} == trainable0
    base1 = _clone(lora.base_state_dict(t.model))
    train_batches(t, _batches(1))
    assert all(torch.equal(lora.base_state_dict(t.model)[n], w) for n, w in base1.items())
    assert t.step_count == 1


def test_broadcast_is_the_base_plus_the_merged_adapter_in_the_base_format(model_dir):
    plain = Trainer(model_dir, TrainerConfig(broadcast_dtype="float32"), batch_prompts=2)
    t = Trainer(model_dir, CFG.model_copy(update={"broadcast_dtype": "float32"}), batch_prompts=2)
    train_batches(t, _batches(2))
    published, reference = t.weights_for_broadcast(), plain.weights_for_broadcast()
    # the same names, shapes and dtypes as full fine-tuning's: the checkpoint format does not change
    assert {k: (v.shape, v.dtype) for k, v in published.items()} == {k: (v.shape, v.dtype)
                                                                     for k, v in reference.items()}
    base = lora.base_state_dict(t.model)
    params = dict(t.model.named_parameters())
    targets = 0
    for name, w in published.items():
        layer = name.removesuffix(".weight")
        a_key = next((k for k in params if k.endswith(f"{layer}.lora_A.default.weight")), None)
        if a_key is None:
            assert torch.equal(w, base[name]), name
            continue
        targets += 1
        a, b = params[a_key], params[a_key.replace("lora_A", "lora_B")]
        torch.testing.assert_close(w, base[name] + (ALPHA / RANK) * (b @ a).detach(), rtol=1e-6, atol=1e-6)
        assert not torch.equal(w, base[name]), f"{name}: the adapter moved, the merged weight must too"
    assert targets == 2 * 4
    # A worker loading the published weights into a plain model computes what the trainer trained.
    worker = load_model(model_dir, dtype="float32")
    worker.load_state_dict(published, strict=False)
    ids = torch.tensor([[5, 9, 14, 22, 31, 7]])
    with torch.no_grad():
        torch.testing.assert_close(worker(input_ids=ids).logits, t.full_model()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_resume_is_bit_identical_to_never_stopping(model_dir, tmp_path):
    from safetensors.torch import load_file

    straight, resumed, snap = straight_and_resumed(model_dir, CFG, tmp_path / "state", _batches(4))
    # The snapshot's model/ is the base model, in the base model's own names: a resume builds from it.
    assert set(load_file(str(snap / "model" / "model.safetensors"))) == set(
        load_file(str(model_dir / "model.safetensors")))
    assert (snap / lora.ADAPTER_FILE).is_file()
    assert_same_weights_and_moments(straight, resumed)
    assert len(straight.optimizer.state_dict()["state"]) == 2 * 4 * 2  # the adapters only
    for name, w in straight.weights_for_broadcast().items():
        assert torch.equal(resumed.weights_for_broadcast()[name], w), name


def test_a_lora_snapshot_refuses_another_lora_config(model_dir, tmp_path):
    t = Trainer(model_dir, CFG, batch_prompts=2, state_dir=tmp_path / "s")
    train_batches(t, _batches(1))
    snap = t.save_state()
    with pytest.raises(TrainerStateError, match="trained with trainer.lora"):
        Trainer.resume(tmp_path / "s", TrainerConfig(lr=1e-2), batch_prompts=2)  # would drop the adapter
    with pytest.raises(TrainerStateError, match="the snapshot was trained with"):
        Trainer.resume(tmp_path / "s", CFG.model_copy(update={"lora": LoraConfig(rank=8, alpha=ALPHA)}),
                       batch_prompts=2)
    (snap / lora.ADAPTER_FILE).unlink()
    with pytest.raises(TrainerStateError, match="lora.safetensors is missing"):
        Trainer.resume(tmp_path / "s", CFG, batch_prompts=2)


def test_an_adapter_of_other_shapes_is_refused(model_dir, tmp_path):
    t = Trainer(model_dir, CFG, batch_prompts=2)
    wrong = {n: torch.zeros(p.shape[0] + 1, p.shape[1]) for n, p in lora.adapter_state_dict(t.model).items()}
    with pytest.raises(TrainerStateError, match="has shape"):
        lora.load_adapter(t.model, wrong, tmp_path)
    with pytest.raises(TrainerStateError, match="does not match"):
        lora.load_adapter(t.model, dict(list(wrong.items())[1:]), tmp_path)


@pytest.mark.parametrize("bad, match", [
    ({"rank": -1}, "greater than or equal"),
    ({"rank": 4096}, "less than or equal"),
    ({"rank": 8, "alpha": 0}, "greater than or equal"),
    ({"rank": 8, "alpha": 0.5}, "valid integer"),
    ({"rank": 8, "dropout": 1.0}, "less than"),
    ({"rank": 8, "target_modules": ["q_proj", "attn"]}, "q_proj"),
    ({"rank": 8, "target_modules": []}, "at least 1"),
    ({"rank": 8, "target_modules": ["q_proj", "q_proj"]}, "names a module twice"),
    ({"rank": 8, "rnak": 8}, "Extra inputs"),
])
def test_bad_lora_configs_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        TrainerConfig(lora=bad)


def test_lora_with_fsdp_ranks_is_accepted():
    """The FSDPRunner wraps its model with peft before sharding it (tests/unit/test_fsdp_lora.py)."""
    assert TrainerConfig(lora={"rank": 8}, ranks=2).lora.enabled
    assert TrainerConfig(lora={"rank": 0}, ranks=2).ranks == 2  # off: FSDP as before


def test_the_mlp_projections_can_be_targets(model_dir):
    t = Trainer(model_dir, TrainerConfig(lora={"rank": 2, "target_modules": list(ALL_TARGETS)}), batch_prompts=2)
    assert len(lora.adapter_state_dict(t.model)) == 2 * 7 * 2
    train_batches(t, _batches(1))
    assert set(t.weights_for_broadcast()) == set(Trainer(model_dir, batch_prompts=2).weights_for_broadcast())


def test_lora_off_is_full_fine_tuning_as_before(model_dir, tmp_path):
    """rank 0 (the default, or given) trains every parameter of a plain transformers model, and writes the
    snapshot it always wrote (no adapter file, no lora entry)."""
    default = Trainer(model_dir, TrainerConfig(lr=1e-2), batch_prompts=2, state_dir=tmp_path / "d")
    off = Trainer(model_dir, TrainerConfig(lr=1e-2, lora={"rank": 0, "alpha": 4}), batch_prompts=2)
    assert type(off.model) is type(load_model(model_dir))
    assert all(p.requires_grad for p in off.model.parameters())
    assert len([p for g in off.optimizer.param_groups for p in g["params"]]) == len(list(off.model.parameters()))
    batches = _batches(2)
    train_batches(default, batches)
    train_batches(off, batches)
    assert default.model.state_dict().keys() == off.model.state_dict().keys()
    for name, w in default.model.state_dict().items():
        assert torch.equal(off.model.state_dict()[name], w), name
    snap = default.save_state()
    assert not (snap / lora.ADAPTER_FILE).exists()
    from node.trainer.state import read_json
    assert "lora" not in read_json(snap / "trainer.json")
