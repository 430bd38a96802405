"""Hugging Face causal LMs: load a local directory, or build the tiny demo model (nothing downloaded)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from node.model_loading import MODEL_LOADS
from node.trainer.model_dir import ModelLoadError, check_model_dir

_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    import torch

    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)})")
    return getattr(torch, name)


def load_model(model_dir: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
               device: str = "cpu"):
    """Load a causal LM from safetensors weights only (pickled .bin checkpoints are refused)."""
    from transformers import AutoModelForCausalLM

    path = check_model_dir(model_dir)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (pickle checkpoints are not loaded)")
    try:
        with MODEL_LOADS:  # from_pretrained swaps process-wide state: one load at a time (node/model_loading.py)
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype(dtype), attn_implementation=attn_implementation,
                local_files_only=True, trust_remote_code=False, use_safetensors=True,
            )
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a model from {path}: {e}") from None
    # transformers wraps PreTrainedModel.to in functools.wraps, which typeshed types as unbound
    return model.to(device)  # type: ignore[arg-type]


def build_tiny_model_dir(out_dir: str | Path, *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                         seed: int = 0, intermediate_size: int | None = None, max_positions: int = 2048,
                         alphabet: str | None = None, init_std: float = 0.02, tokenizer=None,
                         **config_overrides: Any) -> Path:
    """Write a randomly initialised Llama-architecture model + tokenizer to `out_dir`.

    The tokenizer is the character one over `alphabet` unless `tokenizer` (a Hugging Face tokenizer
    with EOS and pad tokens, e.g. `node.trainer.tokenizer.build_bpe_tokenizer`) is given; the model's
    vocabulary, EOS and pad ids follow it.

    Llama rather than Qwen2: transformers 5 forces its own Qwen2 BPE tokenizer class onto any
    `qwen2` directory, which would discard the character tokenizer saved here.

    Deterministic in `seed`: the same arguments give bit-identical weights on every machine.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from node.trainer.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    if hidden_size % heads:
        raise ValueError("hidden_size must be a multiple of heads")
    if tokenizer is None:
        tokenizer = build_char_tokenizer(alphabet or DEFAULT_ALPHABET)
    elif tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs EOS and pad tokens")
    # a real model's vocabulary may be larger than its tokenizer's (Qwen2 pads 151,665 tokens to 151,936)
    vocab_size = max(len(tokenizer), int(config_overrides.pop("vocab_size", 0)))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config_overrides.pop("num_key_value_heads", heads)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_bias=bool(config_overrides.pop("attention_bias", False)),
        **config_overrides,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Seed a private generator state: building a model must not disturb the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out
