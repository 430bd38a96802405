"""What a model directory is: a local Hugging Face directory (config.json, weights, tokenizer files). Both
node.trainer.model (the weights) and node.trainer.tokenizer (the tokenizer beside them) check one with
`check_model_dir`; it lives here, below both, so neither imports the other for it."""
from __future__ import annotations

from pathlib import Path

from protocol.errors import PrimeNodeError


class ModelLoadError(PrimeNodeError):
    pass


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
