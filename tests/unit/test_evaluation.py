"""Evaluation during training: batched greedy decoding, the held-out prompt stream, the persisted curve,
and the eval config section."""
from __future__ import annotations

import json

import pytest
import torch

from node.config import ConfigError, load_config
from node.coordinator.evaluation import EVAL_FILE, Evaluator, eval_seed, greedy_decode, warm_start_seed
from node.envs import encode_prompt, load_task
from node.trainer import build_tiny_model_dir, load_tokenizer
from node.trainer.model import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_model_dir(tmp_path_factory.mktemp("m") / "model", hidden_size=32, layers=2, heads=2, seed=3)
    return load_model(d), load_tokenizer(d)


def naive_greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            t = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == eos:
                break
    return out


def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(tiny):
    model, tok = tiny
    task = load_task("reverse-text", {"min_len": 1, "max_len": 9})
    prompts = [encode_prompt(tok, task.sample(0, i)) for i in range(12)]
    assert len({len(p) for p in prompts}) > 2  # really padded
    model.train()
    got = greedy_decode(model, prompts, max_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                        batch_size=5)
    assert model.training  # mode restored
    model.eval()
    assert got == [naive_greedy(model, p, 6, tok.eos_token_id) for p in prompts]


def test_eval_prompts_are_a_stream_training_never_draws(tiny):
    _, tok = tiny
    task = load_task("reverse-text", {})
    for run_seed in (0, 1, 7, 10_000, -5):
        assert eval_seed(run_seed) != run_seed and warm_start_seed(run_seed) not in (run_seed, eval_seed(run_seed))
    ev = Evaluator(task=task, tokenizer=tok, run_seed=0, prompts=16, every_steps=2, max_tokens=4, batch_size=8)
    assert [p.prompt_id for p in ev.problems] == [f"reverse-text:{eval_seed(0)}:{i}" for i in range(16)]
    training_ids = {task.sample(0, i).prompt_id for i in range(1000)}
    assert not training_ids & {p.prompt_id for p in ev.problems}


def test_curve_is_persisted_and_cut_back_to_the_resumed_step(tiny, tmp_path):
    model, tok = tiny
    task = load_task("reverse-text", {"min_len": 2, "max_len": 3})

    def make():
        return Evaluator(task=task, tokenizer=tok, run_seed=0, prompts=4, every_steps=2, max_tokens=4, batch_size=4,
                         root=tmp_path)

    ev = make()
    ev.restore(0)
    assert ev.due(0) and not ev.due(1)
    for step in (0, 2, 4):
        row = ev.run(model, step)
        assert row["n"] == 4 and 0.0 <= row["reward"] <= 1.0
        assert not ev.due(step)
    assert [r["step"] for r in ev.curve] == [0, 2, 4]
    with open(tmp_path / EVAL_FILE, "a") as f:
        f.write('{"step": 6, "rew')  # a line cut short by a crash
    again = make()
    again.restore(2)  # the ledger's newest step: step 4's evaluation is redone
    assert [r["step"] for r in again.curve] == [0, 2]
    assert again.due(4)
    assert [json.loads(x)["step"] for x in (tmp_path / EVAL_FILE).read_text().splitlines()] == [0, 2]


def test_eval_config_section():
    cfg = load_config(None, ["eval.every_steps=5", "eval.prompts=32"])
    assert (cfg.eval.every_steps, cfg.eval.prompts) == (5, 32)
    assert load_config(None).eval.every_steps == 0  # off by default
    for bad in ("eval.every_steps=-1", "eval.prompts=0", "eval.prompts=100000", "eval.batch_size=0", "eval.what=1"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])


def test_the_last_step_of_a_run_is_evaluated_off_the_grid(tiny):
    """A run of 7 steps with an evaluation every 5 ends with the policy of step 7: its curve must end there
    (make demo-real's summary reads the last point as the trained policy's score)."""
    _, tok = tiny
    task = load_task("reverse-text", {})
    ev = Evaluator(task=task, tokenizer=tok, run_seed=0, prompts=2, every_steps=5, max_tokens=4, batch_size=2,
                   final_step=7)
    assert [s for s in range(9) if ev.due(s)] == [0, 5, 7]
    open_ended = Evaluator(task=task, tokenizer=tok, run_seed=0, prompts=2, every_steps=5, max_tokens=4,
                           batch_size=2)  # run.max_steps = 0: no last step
    assert [s for s in range(11) if open_ended.due(s)] == [0, 5, 10]
