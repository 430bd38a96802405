"""The run's tokenizer without transformers (and so without torch): for the API process of
`server.engine_process = true`, which never imports torch (docs/ARCHITECTURE.md, "Processes").

transformers 5 imports torch as soon as it loads any tokenizer. What the coordinator does with its tokenizer is
small (node/envs/prompt.py, node/envs/episode.py, node/trainer/warm_start.py): render the chat template, encode
text without special tokens, decode with special tokens skipped, and know the EOS and padding ids. This class
does exactly that on the `tokenizers` library (the same Rust tokenizer transformers' fast tokenizers wrap) and
jinja2, loading a model directory the way transformers' `TokenizersBackend.from_pretrained` does for the layouts
it knows, and refusing every other one with a ModelLoadError rather than tokenizing differently:
tests/unit/test_light_tokenizer.py checks it id for id and string for string against transformers.

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
# config.json model types for which AutoTokenizer keeps the directory's class (some, e.g. qwen2, get transformers'
# own class instead, whatever tokenizer_config.json says); llama is what the tiny model and SmolLM2 are, and what the
# parity tests cover.
MODEL_TYPES = ("llama",)
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
    from tokenizers import AddedToken, Tokenizer, processors

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
    if config.get("tokenizer_class") not in PLAIN_CLASSES:
        raise UnsupportedTokenizer(f"{tc}: tokenizer_class {config.get('tokenizer_class')!r} is not "
                                   f"one of {', '.join(PLAIN_CLASSES)}")
    if config.get("split_special_tokens"):
        raise UnsupportedTokenizer(f"{tc}: split_special_tokens is not supported here")

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
    return LightTokenizer(backend, special, template or None)
