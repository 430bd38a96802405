"""The tiny local model and character tokenizer, and loading Hugging Face directories safely."""
from __future__ import annotations

import pytest
import torch

from node.trainer import ModelLoadError, build_tiny_model_dir, eos_token_ids, load_model, load_tokenizer


def test_tiny_model_is_a_normal_hf_directory_and_deterministic(tmp_path):
    a = build_tiny_model_dir(tmp_path / "a", hidden_size=32, layers=2, heads=4, seed=1)
    b = build_tiny_model_dir(tmp_path / "b", hidden_size=32, layers=2, heads=4, seed=1)
    c = build_tiny_model_dir(tmp_path / "c", hidden_size=32, layers=2, heads=4, seed=2)
    names = {p.name for p in a.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    model = load_model(a)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.float32
    assert next(load_model(a, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_character_tokenizer_round_trips_and_stops_on_eos(tmp_path):
    d = build_tiny_model_dir(tmp_path / "m", hidden_size=16, layers=1, heads=2)
    tok = load_tokenizer(d)
    text = "hello world 12+3=15"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_token == "<|end|>"
    assert eos_token_ids(tok, load_model(d).config) == [tok.eos_token_id]
    chat = tok.apply_chat_template([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}],
                                   tokenize=False)
    assert chat == "<|user|>ab<|assistant|>ba<|end|>"


def test_loading_refuses_missing_dirs_and_pickle_only_checkpoints(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "empty")
    d = build_tiny_model_dir(tmp_path / "m", hidden_size=16, layers=1, heads=2)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(d)
    with pytest.raises(ModelLoadError, match="dtype"):
        from node.trainer.model import torch_dtype
        torch_dtype("float64")


def test_package_import_is_light():
    import subprocess
    import sys

    code = "import sys, node.trainer, node.envs; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
