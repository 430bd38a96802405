"""The run's tokenizer without transformers (and so without torch): for the API process of
`server.engine_process = true`, which never imports torch (docs/ARCHITECTURE.md, "Processes").

transformers 5 imports torch as soon as it loads any tokenizer. What the coordinator does with its tokenizer is
small (node/envs/prompt.py, node/envs/episode.py, node/trainer/warm_start.py): render the chat template, encode
text without special tokens, decode with special tokens skipped, and know the EOS and padding ids. This class
does exactly that on the `tokenizers` library (the same Rust tokenizer transformers' fast tokenizers wrap) and
jinja2, loading a model directory the way transformers' AutoTokenizer does for the layouts it knows, and refusing
every other one with a ModelLoadError rather than tokenizing differently: tests/unit/test_light_tokenizer.py checks
it id for id and string for string (and the whole Rust pipeline, serialized) against transformers. It knows two
`model_type`s: llama, where AutoTokenizer loads tokenizer.json as it is (`TokenizersBackend`), and qwen2 (Qwen2,
Qwen2.5), where it puts transformers' own Qwen2Tokenizer on the directory, which keeps only the file's vocabulary,
merges and post-processor and rebuilds the rest (NFC, Qwen2's split regex, byte-level) - `_qwen2_backend` does
the same, step by step.

The chat template is rendered as transformers renders it (transformers/utils/chat_template_utils.py): an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loopcontrols extension, the globals
`raise_exception` and `strftime_now`, its own `tojson`, and the named special tokens as variables. A template
that reads an attribute or key starting with "_" (the way out of a sandbox: `''.__class__.__mro__`) is refused
when the directory is loaded, before anything of it runs.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from node.trainer.model_dir import ModelLoadError, check_model_dir

# Bounds on the files read: a real model's tokenizer.json is a few MB (SmolLM2 3.5 MB, Llama 3 9 MB, Gemma 3
# 33 MB), its tokenizer_config.json and chat template kilobytes.
MAX_TOKENIZER_JSON_BYTES = 64 << 20
MAX_CONFIG_BYTES = 4 << 20
MAX_TEMPLATE_CHARS = 256 << 10

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): what a template sees.
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json classes that AutoTokenizer loads as the plain `TokenizersBackend` (the same class under its
# v4 name): tokenizer.json as it is. Any other class may rebuild or patch the tokenizer in Python.
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# config.json model types whose tokenizer loads here, each proven id for id against AutoTokenizer by the parity
# tests: llama (the tiny model, SmolLM2), for which AutoTokenizer keeps the directory's class, and qwen2 (Qwen2,
# Qwen2.5), for which it puts transformers' own Qwen2Tokenizer on the directory whatever tokenizer_config.json says
# (models/auto/tokenization_auto.py, MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS). Any other type may get a class
# that rebuilds the tokenizer in Python in a way not mirrored here, so it is refused.
MODEL_TYPES = ("llama", "qwen2")
# What transformers' Qwen2Tokenizer.__init__ (models/qwen2/tokenization_qwen2.py) builds around tokenizer.json's
# vocabulary and merges, whatever the file's own normalizer, pre-tokenizer and decoder say.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_CLASSES = PLAIN_CLASSES + ("Qwen2Tokenizer", "Qwen2TokenizerFast")
# Qwen2Tokenizer's keyword defaults, for a tokenizer_config.json that leaves the key out (null is kept as None).
QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
# tokenizer_config.json keys read here, or known not to change tokenization, decoding or rendering.
KNOWN_KEYS = set(SPECIAL_TOKENS_ATTRIBUTES) | {
    "tokenizer_class", "backend", "chat_template", "clean_up_tokenization_spaces", "model_max_length",
    "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens", "add_bos_token", "add_eos_token",
    "add_prefix_space", "is_local", "local_files_only", "name_or_path", "padding_side", "truncation_side",
    "model_input_names", "split_special_tokens", "legacy", "spaces_between_special_tokens", "use_default_system_prompt",
    "errors", "do_lower_case", "pad_token_type_id", "vocab_file", "merges_file", "tokenizer_file",
}


class UnsupportedTokenizer(ModelLoadError):
    """A model directory whose tokenizer this module cannot load exactly as transformers would."""


def _read_json(path: Path, limit: int) -> Any:
    if path.stat().st_size > limit:
        raise ModelLoadError(f"{path} is larger than {limit} bytes")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def _token_content(value: Any, where: str) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken as a dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{where}: a special token must be a string or an AddedToken object, not {value!r:.100}")


def _compile_template(source: str):
    """The template compiled as transformers compiles it, after refusing any read of a private attribute."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: jinja's escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        # transformers' `{% generation %}` tag (assistant masks) is not supported here
        raise UnsupportedTokenizer(f"chat template does not parse here: {e}") from None
    # Reads computed at render time are left to the sandbox, which refuses them too (as in transformers).
    for node in ast.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        name: Any = None
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = getattr(node.arg, "value", None)
        elif isinstance(node, nodes.Filter) and node.name == "attr" and node.args:  # `x|attr('__class__')`
            name = getattr(node.args[0], "value", None)
        if isinstance(name, str) and name.startswith("_"):
            raise ModelLoadError(f"chat template line {node.lineno} reads {name!r}: private attributes are refused "
                                 "(the way out of jinja's sandbox)")
    return env.from_string(source)


class LightTokenizer:
    """What the coordinator uses of a transformers tokenizer, loaded by `load_light_tokenizer`."""

    def __init__(self, backend, special: dict[str, str], chat_template: str | None):
        self._backend = backend
        self.special_tokens_map = special  # attribute -> token, as transformers' `special_tokens_map`
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._backend.token_to_id(token)
        return self.unk_token_id if i is None and token != self.unk_token else i

    def __getattr__(self, name: str):
        # bos_token, eos_token_id, pad_token, ...: None where the directory names no such token
        for attr in SPECIAL_TOKENS_ATTRIBUTES:
            if name == attr:
                return self.special_tokens_map.get(attr)
            if name == attr + "_id":
                return self._id(self.special_tokens_map.get(attr))
        raise AttributeError(name)

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if not isinstance(text, str):
            raise TypeError("LightTokenizer encodes one string at a time")
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        """`decode` of each sequence, by the Rust tokenizer's decode_batch (no GIL held while it decodes)."""
        return self._backend.decode_batch([[int(i) for i in ids] for ids in sequences],
                                          skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **template_kwargs):
        """transformers' `apply_chat_template` for one conversation: rendered, then encoded without special
        tokens (the template writes them)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation[0], (list, tuple)):
            raise TypeError("LightTokenizer renders one conversation at a time")
        text = self._template.render(messages=conversation, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **template_kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def load_light_tokenizer(model_dir: str | Path) -> LightTokenizer:
    """The tokenizer saved beside a model, as transformers' AutoTokenizer would load it, or ModelLoadError
    (UnsupportedTokenizer where the directory is fine but needs more of transformers than this module has)."""
    path = check_model_dir(model_dir)
    model_type = _read_json(path / "config.json", MAX_CONFIG_BYTES)
    model_type = model_type.get("model_type") if isinstance(model_type, dict) else None
    if model_type not in MODEL_TYPES:
        raise UnsupportedTokenizer(f"{path}: model_type {model_type!r} is not one whose tokenizer loads here "
                                   f"(only {', '.join(MODEL_TYPES)})")
    tj, tc = path / "tokenizer.json", path / "tokenizer_config.json"
    if not tj.is_file() or not tc.is_file():
        raise UnsupportedTokenizer(f"{path} has no tokenizer.json and tokenizer_config.json")
    for legacy in ("added_tokens.json", "chat_templates"):
        if (path / legacy).exists():
            raise UnsupportedTokenizer(f"{path}/{legacy} is not supported here")
    config = _read_json(tc, MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{tc} is not a JSON object")
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise UnsupportedTokenizer(f"{tc}: keys not supported here: {', '.join(unknown)[:300]}")
    classes = QWEN2_CLASSES if model_type == "qwen2" else PLAIN_CLASSES
    if config.get("tokenizer_class") not in classes:
        raise UnsupportedTokenizer(f"{tc}: tokenizer_class {config.get('tokenizer_class')!r} is not "
                                   f"one of {', '.join(classes)}")
    if config.get("split_special_tokens"):
        raise UnsupportedTokenizer(f"{tc}: split_special_tokens is not supported here")
    if model_type == "qwen2":
        backend, special = _qwen2_backend(path, config)
    else:
        backend, special = _plain_backend(path, config)
    return LightTokenizer(backend, special, _chat_template(path, config))


def _plain_backend(path: Path, config: dict) -> tuple[Any, dict[str, str]]:
    """tokenizer.json as it is, with the named and extra special tokens added as TokenizersBackend adds them."""
    from tokenizers import AddedToken, Tokenizer, processors

    tj, tc = path / "tokenizer.json", path / "tokenizer_config.json"

    if tj.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
        raise ModelLoadError(f"{tj} is larger than {MAX_TOKENIZER_JSON_BYTES} bytes")
    try:
        backend = Tokenizer.from_str(tj.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust parser's errors are plain Exceptions
        raise ModelLoadError(f"{tj} is not a tokenizer: {str(e)[:300]}") from None
    # transformers pads and truncates only when asked to (the project never asks)
    backend.no_truncation()
    backend.no_padding()
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        # transformers 5 skips the clean-up for a BPE model (it would strip real spaces); Qwen2's is always one
        raise UnsupportedTokenizer(f"{tc}: clean_up_tokenization_spaces is not supported here")

    # The named special tokens: tokenizer_config.json, or the legacy special_tokens_map.json where the config has
    # no added_tokens_decoder (transformers' `_from_pretrained`).
    named: dict[str, Any] = {k: config[k] for k in SPECIAL_TOKENS_ATTRIBUTES if config.get(k) is not None}
    extras = list(config.get("extra_special_tokens") or config.get("additional_special_tokens") or [])
    stm = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and stm.is_file():
        legacy_map = _read_json(stm, MAX_CONFIG_BYTES)
        if not isinstance(legacy_map, dict):
            raise ModelLoadError(f"{stm} is not a JSON object")
        for key, value in legacy_map.items():
            if key in SPECIAL_TOKENS_ATTRIBUTES:
                named[key] = value
            elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                extras += [v for v in value if v not in extras]
            else:
                raise UnsupportedTokenizer(f"{stm}: key {key!r} is not supported here")
    if not isinstance(extras, list):
        raise UnsupportedTokenizer(f"{tc}: extra_special_tokens must be a list here")
    special = {k: _token_content(v, f"{tc} {k}") for k, v in named.items()}
    extra_contents = [_token_content(v, f"{tc} extra_special_tokens") for v in extras]

    present = {int(i): t for i, t in backend.get_added_tokens_decoder().items()}
    for idx, tok in (config.get("added_tokens_decoder") or {}).items():
        have = present.get(int(idx)) if str(idx).isdigit() else None
        if not isinstance(tok, dict) or have is None or have.content != tok.get("content") \
                or bool(have.special) != bool(tok.get("special")):
            raise UnsupportedTokenizer(f"{tc}: added_tokens_decoder entry {idx} differs from tokenizer.json")

    def added(value: Any, content: str) -> AddedToken:
        if isinstance(value, dict):
            flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
            return AddedToken(content, special=True, **flags)
        return AddedToken(content, special=True, normalized=False)

    # As TokenizersBackend.__init__ and _post_init do: special tokens missing from the backend are added, then
    # every named and extra one is (re-)added as special.
    tokens = [added(v, c) for v, c in zip(list(named.values()) + extras, list(special.values()) + extra_contents)]
    have_contents = {t.content for t in present.values()}
    missing = [t for t in tokens if t.content not in have_contents]
    if missing:
        backend.add_tokens(missing)
    if tokens:
        backend.add_special_tokens(tokens)
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return backend, special


def _qwen2_backend(path: Path, config: dict) -> tuple[Any, dict[str, str]]:
    """What AutoTokenizer builds for a `model_type: qwen2` directory, step by step as transformers 5.19 does
    it: Qwen2Tokenizer takes only the vocabulary, merges and post-processor of tokenizer.json
    (TokenizersBackend.convert_to_native_format: a class with its own __init__ rebuilds the rest), puts NFC,
    Qwen2's split regex and byte-level around them, then adds the added tokens of tokenizer_config.json (else of
    tokenizer.json) in id order, then the named and extra special tokens (TokenizersBackend.__init__, the end of
    Qwen2Tokenizer.__init__, then _post_init). Layouts beyond what real Qwen2 checkpoints and transformers' own
    save_pretrained write (AddedToken objects as named tokens, special_tokens_map.json) are refused."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tj, tc = path / "tokenizer.json", path / "tokenizer_config.json"
    data = _read_json(tj, MAX_TOKENIZER_JSON_BYTES)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"{tj}: a qwen2 tokenizer.json must hold a BPE model here")
    vocab, merges = model.get("vocab"), model.get("merges") or []
    if isinstance(vocab, list):  # as convert_to_native_format reads a list vocabulary
        vocab = {t[0] if isinstance(t, list) else t: i for i, t in enumerate(vocab)}
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise ModelLoadError(f"{tj}: the BPE model has no vocabulary and merges")
    try:
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                byte_fallback=False))
        # the file's post-processor, read as transformers reads it: from the file without its vocabulary
        minimal = {**data, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}
        post_processor = Tokenizer.from_str(json.dumps(minimal)).post_processor
    except Exception as e:  # the Rust side's errors are plain Exceptions
        raise ModelLoadError(f"{tj} is not a tokenizer: {str(e)[:300]}") from None
    add_prefix_space = config.get("add_prefix_space")
    if add_prefix_space is not None and not isinstance(add_prefix_space, bool):
        raise ModelLoadError(f"{tc}: add_prefix_space must be true, false or null")
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(add_prefix_space), use_regex=False)])
    if post_processor is not None:
        backend.post_processor = post_processor

    # Named tokens: the config's (null stays None), else Qwen2Tokenizer's defaults; `additional_special_tokens`
    # is the v4 name of `extra_special_tokens`.
    named: dict[str, str] = {}
    for key in SPECIAL_TOKENS_ATTRIBUTES:
        value = config[key] if key in config else QWEN2_DEFAULTS.get(key)
        if value is not None and not isinstance(value, str):
            raise UnsupportedTokenizer(f"{tc}: {key} must be a string or null here")
        if value is not None:
            named[key] = value
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if not isinstance(extras, list) or not all(isinstance(t, str) for t in extras):
        raise UnsupportedTokenizer(f"{tc}: extra_special_tokens must be a list of strings here")
    if "added_tokens_decoder" not in config and (path / "special_tokens_map.json").exists():
        raise UnsupportedTokenizer(f"{path}/special_tokens_map.json is not supported here for qwen2")

    flags = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
    raw = config.get("added_tokens_decoder")
    if raw is None:
        raw = {str(t.get("id")): {k: v for k, v in t.items() if k != "id"} if isinstance(t, dict) else t
               for t in (data.get("added_tokens") or [])}
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{tc}: added_tokens_decoder must be an object")
    decoder: dict[int, Any] = {}
    for idx, tok in raw.items():
        if not str(idx).isdigit() or not isinstance(tok, dict) or not isinstance(tok.get("content"), str) \
                or set(tok) - set(flags) or not all(isinstance(tok[k], bool) for k in tok if k != "content"):
            raise UnsupportedTokenizer(f"{tc}: added token {idx!r} is not supported here: {tok!r:.200}")
        decoder[int(idx)] = AddedToken(**tok)
    by_content = {t.content: t for t in decoder.values()}
    named_tokens = {k: by_content.get(v, v) for k, v in named.items()}  # `_from_pretrained` maps them

    # TokenizersBackend.__init__: the added tokens in id order, then named and extra tokens not among them
    to_add: list[Any] = [t for _, t in sorted(decoder.items())]
    have = {t.content for t in to_add}
    for value in list(named_tokens.values()) + extras:
        if str(value) not in have and str(value) not in [str(t) for t in to_add]:
            to_add.append(value)
    named_contents = set(named.values())
    tokens = []
    for t in to_add:
        if isinstance(t, str):
            t = AddedToken(t, special=True)
        elif not t.special and t.content in named_contents:
            t.special = True  # transformers flips the same object (it is also the named token)
        tokens.append(t)
    if tokens:
        backend.add_tokens(tokens)
    # Qwen2Tokenizer.__init__'s last line: every special token (named, then extra, each once) re-added
    all_special = list(dict.fromkeys(list(named.values()) + extras))
    if all_special:
        backend.add_tokens([AddedToken(t, special=True) for t in all_special])
    # _post_init: the named and extra tokens added as special
    post = [v if isinstance(v, AddedToken) else AddedToken(v, special=True, normalized=False)
            for v in named_tokens.values()]
    post += [AddedToken(t, special=True, normalized=False) for t in extras]
    if post:
        backend.add_special_tokens(post)
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    # transformers gives an added token the next free id, whatever id the files name: where that is not the
    # file's id (a gap in the ids), AutoTokenizer tokenizes unlike the model was trained, so refuse
    for idx, tok in decoder.items():
        if backend.token_to_id(tok.content) != idx:
            raise UnsupportedTokenizer(f"{tc}: added token {tok.content!r} would get id "
                                       f"{backend.token_to_id(tok.content)}, not its {idx}")
    return backend, named


def _chat_template(path: Path, config: dict) -> str | None:
    tc = path / "tokenizer_config.json"
    template: Any = config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():  # transformers: the separate file wins over the config's entry
        if jinja_file.stat().st_size > MAX_TEMPLATE_CHARS * 4:
            raise ModelLoadError(f"{jinja_file} is too large")
        template = jinja_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise UnsupportedTokenizer(f"{tc}: only a single chat template is supported here")
    if template is not None and len(template) > MAX_TEMPLATE_CHARS:
        raise ModelLoadError(f"chat template of {path} is longer than {MAX_TEMPLATE_CHARS} characters")
    return template or None
