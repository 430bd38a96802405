"""Trainer snapshots: resuming gives exactly the weights of never stopping; no pickle; atomic LATEST."""
from __future__ import annotations

import pytest
import torch

from node.trainer import Trainer
from node.trainer.config import BufferConfig, TrainerConfig
from node.trainer.model import build_tiny_model_dir
from node.trainer.state import TrainerStateError
from tests.unit.test_trainer_step import (
    assert_same_weights_and_moments,
    make_groups,
    straight_and_resumed,
    train_batches,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=9)


CFG = TrainerConfig(lr=1e-2, weight_decay=0.01)


def _batches(n: int) -> list[list]:
    return [make_groups(2, seed=100 + i) for i in range(n)]


def test_resume_is_bit_identical_to_never_stopping(model_dir, tmp_path):
    straight, resumed, _ = straight_and_resumed(model_dir, CFG, tmp_path / "state", _batches(4))
    assert resumed.step_count == 4
    assert_same_weights_and_moments(straight, resumed)  # the optimizer moments too, not just the weights


def test_stream_mode_resume_replays_groups_already_back_propagated(model_dir, tmp_path):
    batches = _batches(2)
    straight = Trainer(model_dir, CFG, batch_prompts=2, stream=True)
    train_batches(straight, batches)

    first = Trainer(model_dir, CFG, batch_prompts=2, stream=True, state_dir=tmp_path / "s")
    train_batches(first, batches[:1])
    first.add_group(batches[1][0])  # half of the next batch is already in .grad
    first.save_state()
    resumed = Trainer.resume(tmp_path / "s", CFG, batch_prompts=2, stream=True)
    assert len(resumed.accumulated) == 1
    resumed.add_group(batches[1][1])
    resumed.step()
    for name, p in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], p), name


def test_snapshot_holds_no_pickle_and_keeps_pools_and_rng(model_dir, tmp_path):
    t = Trainer(model_dir, CFG, batch_prompts=2, state_dir=tmp_path / "st")
    flat = make_groups(1, seed=55)[0]
    for r in flat.rollouts:
        r.reward = 1.0
    t.add_group(flat)  # goes to the easy pool
    train_batches(t, _batches(1))
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    snap = t.save_state()
    suffixes = {p.suffix for p in snap.rglob("*") if p.is_file()}
    assert suffixes <= {".json", ".safetensors", ".jinja"}, suffixes
    torch.manual_seed(0)
    resumed = Trainer.resume(tmp_path / "st", CFG, batch_prompts=2)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert resumed.pools.pool_of(flat.prompt_id) == "easy"
    assert resumed.keep_rate == t.keep_rate
    # easy_fraction = 1 lifts every easy problem back to normal on resume
    lifted = Trainer.resume(tmp_path / "st", TrainerConfig(lr=1e-2, weight_decay=0.01,
                                                           buffer=BufferConfig(easy_fraction=1.0)), batch_prompts=2)
    assert lifted.pools.pool_of(flat.prompt_id) == "normal"
    # the snapshot is a loadable model directory (tokenizer included) for anyone else
    from node.trainer import load_tokenizer

    assert load_tokenizer(snap / "model").eos_token_id == 4


def test_latest_is_replaced_and_old_snapshots_pruned(model_dir, tmp_path):
    t = Trainer(model_dir, TrainerConfig(keep_states=2), batch_prompts=2, state_dir=tmp_path / "st")
    for batch in _batches(3):
        train_batches(t, [batch])
        t.save_state()
    names = sorted(p.name for p in (tmp_path / "st").iterdir())
    assert names == ["LATEST", "step-00000002", "step-00000003"]
    assert (tmp_path / "st" / "LATEST").read_text().strip() == "step-00000003"


def test_bad_state_dirs_give_clear_errors(model_dir, tmp_path):
    with pytest.raises(TrainerStateError, match="no trainer state"):
        Trainer.resume(tmp_path / "nothing", CFG, batch_prompts=2)
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "LATEST").write_text("../../etc")
    with pytest.raises(TrainerStateError, match="not a snapshot name"):
        Trainer.resume(tmp_path / "evil", CFG, batch_prompts=2)
    t = Trainer(model_dir, CFG, batch_prompts=2, state_dir=tmp_path / "ok")
    snap = t.save_state()
    (snap / "trainer.json").write_text("{not json")
    with pytest.raises(TrainerStateError, match="not valid JSON"):
        Trainer.resume(tmp_path / "ok", CFG, batch_prompts=2)
    with pytest.raises(Exception, match="no state_dir"):
        Trainer(model_dir, CFG, batch_prompts=2).save_state()
