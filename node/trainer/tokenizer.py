"""A local character-level tokenizer, saved as a normal Hugging Face tokenizer directory.

One token per character keeps the vocabulary tiny (so a small model explores it quickly) and makes
every task's text round-trip exactly. Nothing is downloaded: the `tokenizers` library builds it here.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Iterable

PAD, UNK, USER, ASSISTANT, EOS = "<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, UNK, USER, ASSISTANT, EOS]
# Enough for the built-in tasks (letters, digits, arithmetic) and short English prompts.
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " +-*=?.,:'!()/"

# A single-turn template: the assistant's turn ends with EOS, so the sampler stops on EOS.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS +
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A `PreTrainedTokenizerFast` with special tokens first (ids 0..4), then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet))  # de-duplicate, keep order
    if any(len(c) != 1 for c in chars) or not chars:
        raise ValueError("alphabet must be a non-empty string of characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; special tokens are matched before this split.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return _hf_tokenizer(tok)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (the GPT-2 / Llama 3 kind) trained here on `texts`, with the same special
    tokens (ids 0..4) and chat template as the character tokenizer. Its size is what a real model's
    is (100k+ tokens make a tokenizer.json of several MB) as long as `texts` holds enough distinct
    words for that many merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return _hf_tokenizer(tok)


def _hf_tokenizer(tok):
    """A `tokenizers.Tokenizer` whose first ids are SPECIAL_TOKENS, as a Hugging Face tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer saved beside a model (local files only, never the Hub)."""
    from transformers import AutoTokenizer

    from node.trainer.model_dir import ModelLoadError, check_model_dir

    path = check_model_dir(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from None


def eos_token_ids(tokenizer, model_config=None) -> list[int]:
    """Every id the sampler should stop on: the tokenizer's EOS plus any the model's config lists."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    extra = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    for x in extra if isinstance(extra, (list, tuple)) else [extra]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    return ids
