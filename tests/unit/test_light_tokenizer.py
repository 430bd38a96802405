"""node/trainer/light_tokenizer.py against transformers' AutoTokenizer, on the same model directories: every id
the coordinator hands out or checks (prompts of every built-in task, environment turns of multi-turn episodes),
every text its rewards see (decoded completions), and the EOS and padding ids, on the character tokenizer, a
byte-level BPE and (marked `real`) SmolLM2-135M-Instruct's, and on Qwen2 directories (`model_type: qwen2`, where
AutoTokenizer puts transformers' own Qwen2Tokenizer on the files): one saved by that class, one laid out file for
file as a real Qwen2.5-Instruct checkpoint is. Then the directories it refuses: a chat template that tries to leave
jinja's sandbox, a malformed or oversized tokenizer.json, a layout only transformers loads."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from jinja2 import TemplateError

from node.envs import encode_prompt
from node.envs.base import Problem
from node.envs.episode import EnvThenModel, ModelTurn, check_episode, env_turn_ids, max_turns_of, next_env_ids
from node.envs.prompt import decode_completion, decode_completions
from node.envs.registry import BUILTIN_TASKS, load_task
from node.trainer.light_tokenizer import LightTokenizer, UnsupportedTokenizer, load_light_tokenizer
from node.trainer.model_dir import ModelLoadError
from node.trainer.tokenizer import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer

UNICODE = ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 done", "tab\tand\nnewline", "  leading and trailing  ",
           "<|end|> inside text", "<|im_end|><|im_start|>user", "ÅÄÖ åäö ß ﬁ", "", " ", "12+34=?", "a" * 300,
           # NFC (Qwen2's normalizer): a combining accent, the Ångström sign, Hangul jamo; Qwen2's split regex:
           # digits one by one, case-blind contractions, runs of newlines and spaces, CR LF
           "e\u0301 \u212b \u1100\u1161", "1234567 x99", "I'LL DON'T it's", "a\n\n\n  b  \r\n\tc   ",
           "👩\u200d💻 \u00a0nbsp", "<tool_call>{\"a\": 1}</tool_call>", "<|endoftext|>tail"]
SYSTEM = Problem(prompt_id="sys", prompt="what is 3+4?", answer="7", system="You are a careful calculator. ✓")


def save_dir(tokenizer, path: Path) -> Path:
    tokenizer.save_pretrained(str(path))
    # AutoTokenizer reads config.json's model type; the run's directories are Llama ones (node/trainer/model.py)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(tokenizer)}))
    return path


def task_texts() -> list[str]:
    texts = []
    for name in BUILTIN_TASKS:
        task = load_task(name, {})
        for i in range(30):
            p = task.sample(5, i)
            texts += [p.prompt, str(p.answer)]
    return texts


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    return save_dir(build_char_tokenizer(), tmp_path_factory.mktemp("char"))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return save_dir(build_bpe_tokenizer(task_texts() + UNICODE * 3, 700), tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def smollm2_dir():
    from node.real_model import model_dir

    return model_dir()


def problems():
    out = [SYSTEM]
    for name in sorted(BUILTIN_TASKS):
        task = load_task(name, {})
        out += [task.sample(seed, i) for seed in (0, 7) for i in range(25)]
    return out


def assert_parity(model_dir: Path):
    hf, light = load_tokenizer(model_dir), load_light_tokenizer(model_dir)
    assert isinstance(light, LightTokenizer)
    # the whole Rust pipeline as transformers built it: model, normalizer, pre-tokenizer, decoder, post-processor,
    # every added token with its id and flags
    assert json.loads(light._backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    assert (light.eos_token_id, light.pad_token_id, light.eos_token) == (hf.eos_token_id, hf.pad_token_id, hf.eos_token)
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.chat_template == hf.chat_template
    assert len(light) == len(hf)

    for p in problems():  # every id a prompt hands out
        assert encode_prompt(light, p) == encode_prompt(hf, p), p
    for text in task_texts() + UNICODE:
        for special in (False, True):
            assert light(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        assert env_turn_ids(light, text) == env_turn_ids(hf, text), text
    for messages in ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                     [{"role": "user", "content": u} for u in UNICODE[:3]]):
        for gen in (False, True):
            assert light.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    rng = random.Random(3)
    vocab = len(hf)
    specials = [i for i in (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id, hf.unk_token_id) if i is not None]
    specials += list(hf.added_tokens_decoder)  # every added token, special or not (Qwen2.5's <tool_call> is not)
    batch = []
    for _ in range(300):  # what a reward sees of any completion, incl. EOS, padding and broken UTF-8 byte runs
        ids = [rng.randrange(vocab) if rng.random() < 0.85 else rng.choice(specials) for _ in range(rng.randrange(40))]
        assert decode_completion(light, ids) == decode_completion(hf, ids), ids
        assert light.decode(ids) == hf.decode(ids), ids
        batch.append(ids)
    # the intake decodes a submission's completions in one batch (the light tokenizer: the Rust decode_batch)
    assert decode_completions(light, batch) == decode_completions(hf, batch) == [decode_completion(hf, i) for i in batch]

    for name in sorted(BUILTIN_TASKS):  # multi-turn: the environment's turns as the coordinator checks them
        task = load_task(name, {})
        for i in range(10):
            p = task.sample(1, i)
            answers = ["50", "25", "hello", "🙂", str(p.answer), "0"]
            turns: list[list[int]] = []
            for a in answers[: max_turns_of(task)]:
                turns.append(hf(a, add_special_tokens=False)["input_ids"] + [hf.eos_token_id])
                want = next_env_ids(task, hf, p, turns, "stop")
                assert next_env_ids(task, light, p, turns, "stop") == want, (name, i, a)
                if want is None:
                    break
            first = ModelTurn(completion_ids=turns[0], logprobs=[0.0] * len(turns[0]), finish_reason="stop", commitment="")
            rest = [EnvThenModel(env_ids=next_env_ids(task, hf, p, turns[:k], "stop") or [],
                                 model=ModelTurn(completion_ids=t, logprobs=[0.0] * len(t), finish_reason="stop", commitment=""))
                    for k, t in enumerate(turns[1:], start=1)]
            assert check_episode(task, light, p, first, rest) == check_episode(task, hf, p, first, rest)


def test_char_tokenizer_matches_transformers(char_dir):
    assert_parity(char_dir)


def test_bpe_tokenizer_matches_transformers(bpe_dir):
    assert_parity(bpe_dir)


@pytest.mark.real
def test_smollm2_tokenizer_matches_transformers(smollm2_dir):
    """A real model's tokenizer: ChatML template with a system turn, byte-level BPE of 49k tokens."""
    assert_parity(smollm2_dir)


def test_loading_it_imports_neither_torch_nor_transformers(char_dir):
    import subprocess

    code = ("import json, sys\n"
            "from node.trainer.light_tokenizer import load_light_tokenizer\n"
            "from node.envs import load_task, encode_prompt\n"
            f"t = load_light_tokenizer({str(char_dir)!r})\n"
            "ids = encode_prompt(t, load_task('arithmetic', {}).sample(0, 0))\n"
            "print(json.dumps([len(ids), 'torch' in sys.modules, 'transformers' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    n, torch, transformers = json.loads(out.stdout.strip().splitlines()[-1])
    assert n > 0 and not torch and not transformers


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = messages.__class__ %}{{ x }}",
    "{{ cycler['__init__']['__globals__'] }}",
    "{{ (messages|attr('__class__')) }}",
    "{{ raise_exception('the template ran') }}{{ (messages|first).__class__ }}",
])
def test_a_sandbox_escape_in_the_chat_template_is_refused_before_it_runs(char_dir, tmp_path, template):
    d = copy_dir(char_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(ModelLoadError, match="private attributes are refused") as e:
        load_light_tokenizer(d)
    assert not isinstance(e.value, UnsupportedTokenizer)  # refused, not "try transformers instead"


def test_the_template_is_rendered_in_transformers_sandbox(char_dir, tmp_path):
    """What the static check lets through still runs sandboxed: an unsafe call fails at render as in transformers."""
    d = copy_dir(char_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages.append(1) }}{{ strftime_now('%Y') }}{{ messages|tojson }}")
    light = load_light_tokenizer(d)
    with pytest.raises(TemplateError):
        light.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    (d / "chat_template.jinja").write_text("{{ messages|tojson }}<{{ eos_token }}>")
    light = load_light_tokenizer(d)
    assert light.apply_chat_template([{"role": "user", "content": "é<"}], tokenize=False) == \
        '[{"role": "user", "content": "é<"}]<<|end|>>'


def test_a_malformed_or_huge_tokenizer_json_is_a_model_load_error(char_dir, tmp_path):
    d = copy_dir(char_dir, tmp_path / "bad")
    for junk in (b"{not json", b'{"model": {"type": "NoSuchModel"}}', b"\xff\xfe\x00", b"[]"):
        (d / "tokenizer.json").write_bytes(junk)
        with pytest.raises(ModelLoadError, match="tokenizer.json"):
            load_light_tokenizer(d)
    with open(d / "tokenizer.json", "wb") as f:  # sparse: 65 MB on paper, nothing read
        f.truncate(65 << 20)
    with pytest.raises(ModelLoadError, match="larger than"):
        load_light_tokenizer(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizer, match="no tokenizer.json"):
        load_light_tokenizer(d)
    d2 = copy_dir(char_dir, tmp_path / "badcfg")
    (d2 / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_light_tokenizer(d2)


@pytest.mark.parametrize("change", [
    {"config": {"model_type": "mistral"}},  # a type whose tokenizer class is not mirrored here
    {"config": {"model_type": "qwen2"}},  # Qwen2Tokenizer would turn this character vocabulary into a BPE one
    {"tokenizer_config": {"tokenizer_class": "LlamaTokenizer"}},
    {"tokenizer_config": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}},
    {"tokenizer_config": {"chat_template": [{"name": "default", "template": "x"}]}, "drop_jinja": True},
    {"tokenizer_config": {"split_special_tokens": True}},
])
def test_a_layout_only_transformers_loads_is_refused_as_unsupported(char_dir, tmp_path, change):
    d = copy_dir(char_dir, tmp_path / "m")
    for name, update in (("config", change.get("config")), ("tokenizer_config", change.get("tokenizer_config"))):
        if update:
            f = d / f"{name}.json"
            f.write_text(json.dumps({**json.loads(f.read_text()), **update}))
    if change.get("drop_jinja"):
        (d / "chat_template.jinja").unlink()
    with pytest.raises(UnsupportedTokenizer):
        load_light_tokenizer(d)


def test_the_run_model_takes_the_light_tokenizer_only_with_the_engine_process(char_dir, tmp_path):
    from node.config import load_config
    from node.coordinator.run_model import load_run_model

    repo = Path(__file__).resolve().parents[2]
    d = copy_dir(char_dir, tmp_path / "m")
    sets = [f"storage.dir={tmp_path}", f"model.path={d}"]
    one = load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=false"]), tmp_path)
    two = load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=true"]), tmp_path)
    assert not isinstance(one.tokenizer, LightTokenizer) and isinstance(two.tokenizer, LightTokenizer)
    assert two.eos_token_id == one.eos_token_id
    f = d / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "model_type": "mistral"}))
    with pytest.raises(ModelLoadError, match="server.engine_process = false"):
        load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=true"]), tmp_path)
    # a Qwen2.5 directory (configs/gpu-example.toml's kind) runs in both layouts
    q = qwen25_layout(tmp_path / "qwen")
    sets = [f"storage.dir={tmp_path}", f"model.path={q}", "task.name=arithmetic"]
    one = load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=false"]), tmp_path)
    two = load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=true"]), tmp_path)
    assert type(one.tokenizer).__name__ == "Qwen2Tokenizer" and isinstance(two.tokenizer, LightTokenizer)
    assert two.eos_token_id == one.eos_token_id == json.loads((q / "config.json").read_text())["eos_token_id"]
    p = one.task.sample(0, 0)
    assert encode_prompt(two.tokenizer, p) == encode_prompt(one.tokenizer, p)


# A template in the style of real ones (Llama 3, Qwen): block tags on their own indented lines (trim_blocks and
# lstrip_blocks decide the whitespace), loop controls, namespace, transformers' tojson and the special tokens.
STYLED_TEMPLATE = """{{ bos_token if bos_token else '' }}
{% set ns = namespace(system=none) %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = m['content'] %}
        {% continue %}
    {% endif %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
<|{{ m['role'] }}|>{% if ns.system and loop.index0 == 1 %}[{{ ns.system|tojson }}] {% endif %}{{ m['content'] | trim }}
    {% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}
    {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


def test_template_features_render_as_in_transformers(char_dir, tmp_path):
    d = copy_dir(char_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(STYLED_TEMPLATE)
    hf, light = load_tokenizer(d), load_light_tokenizer(d)
    chats = [[{"role": "system", "content": "sé \"quoted\" <b>"}, {"role": "user", "content": "  hi  "},
              {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}],
             [{"role": "user", "content": str(i)} for i in range(12)]]
    for chat in chats:
        for gen in (False, True):
            want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want
            assert light.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(TemplateError, match="unknown role tool") as want_err:
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError, match="unknown role tool") as got_err:
        light.apply_chat_template(bad, tokenize=False)
    assert type(got_err.value) is type(want_err.value)


# ---- Qwen2 (`model_type: qwen2`): AutoTokenizer loads transformers' Qwen2Tokenizer, which keeps only the
# vocabulary, merges and post-processor of tokenizer.json and builds NFC, its split regex and byte-level around them.

# Qwen2.5's added tokens in id order after the BPE vocabulary; the last eight are not special in its checkpoints
# (decoding with skip_special_tokens keeps them). Qwen2 (not 2.5) has the first three.
QWEN25_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN25_SPECIAL = 14

# Qwen's ChatML format, in the style of its checkpoints' templates (written here): `{%-` whitespace control, a
# default system turn, assistant tool calls as <tool_call> JSON through tojson, runs of tool results folded into
# one user turn by looking at the neighbouring messages, the generation prompt.
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. ✓"}, {"role": "user", "content": "  2+2?\n"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 日本?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "12°C"}, {"role": "tool", "content": "<|im_end|> rain"},
     {"role": "assistant", "content": "Cold."}, {"role": "user", "content": "<tool_call>x</tool_call>"}],
]


def qwen2_bpe():
    """A byte-level BPE trained here with Qwen2's normalizer and split regex (transformers' own constant)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(task_texts() + UNICODE * 3, trainers.BpeTrainer(
        vocab_size=900, min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def qwen2_config(path: Path, vocab_size: int, **extra) -> None:
    # as a real Qwen2.5 checkpoint's config.json (saved by transformers 4)
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                  "transformers_version": "4.43.1", "vocab_size": vocab_size, **extra}))


@pytest.fixture(scope="module")
def qwen2_saved_dir(tmp_path_factory):
    """Written by transformers 5's Qwen2Tokenizer.save_pretrained."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    model = json.loads(qwen2_bpe().to_str())["model"]
    kwargs: dict[str, Any] = dict(bos_token=None, eos_token="<|im_end|>", unk_token=None, errors="replace",
                                  split_special_tokens=False, extra_special_tokens=QWEN25_ADDED[1:QWEN25_SPECIAL],
                                  chat_template=QWEN_TEMPLATE, model_max_length=32768, clean_up_tokenization_spaces=False)
    merges: list[Any] = [tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, **kwargs)
    path = tmp_path_factory.mktemp("qwen2-saved")
    tok.save_pretrained(str(path))
    qwen2_config(path, len(tok))
    return path


def qwen25_layout(path: Path, eos: str = "<|im_end|>", added: list[str] = QWEN25_ADDED, drop: tuple = (),
                  **config_changes) -> Path:
    """File for file what a Qwen2.5-Instruct checkpoint holds (saved by transformers 4): tokenizer.json with a
    byte-level post-processor, the added tokens after the vocabulary, vocab.json and merges.txt beside it, and a
    tokenizer_config.json with added_tokens_decoder, additional_special_tokens, null bos and unk, the template."""
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors

    tok = qwen2_bpe()
    byte_level = dict(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([tok.pre_tokenizer[0], pre_tokenizers.ByteLevel(**byte_level)])
    tok.decoder = decoders.ByteLevel(**byte_level)
    tok.post_processor = processors.ByteLevel(**byte_level)
    n = tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=i < QWEN25_SPECIAL, normalized=False) for i, t in enumerate(added)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    tok.model.save(str(path))  # vocab.json, merges.txt (transformers reads tokenizer.json instead)
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(n + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": i < QWEN25_SPECIAL}
                                 for i, t in enumerate(added)},
        "additional_special_tokens": added[1:QWEN25_SPECIAL], "bos_token": None, "chat_template": QWEN_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eos_token": eos, "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None, **config_changes}
    config = {k: v for k, v in config.items() if k not in drop}
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    qwen2_config(path, n + len(added), bos_token_id=n, eos_token_id=n + added.index(eos))
    return path


def assert_qwen_chats(model_dir: Path):
    hf, light = load_tokenizer(model_dir), load_light_tokenizer(model_dir)
    for chat in QWEN_CHATS:
        for gen in (False, True):
            text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == text
            assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n" if gen else "\n")
            ids = hf.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
            assert light.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False) == ids
            for skip in (False, True):
                assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if "<tool_call>" in hf.get_added_vocab():
        assert "<tool_call>" in light.decode(ids, skip_special_tokens=True)  # not special in Qwen2.5: kept


def test_a_qwen2_tokenizer_saved_by_transformers_matches(qwen2_saved_dir):
    assert type(load_tokenizer(qwen2_saved_dir)).__name__ == "Qwen2Tokenizer"  # what the parity is against
    assert_parity(qwen2_saved_dir)
    assert_qwen_chats(qwen2_saved_dir)


@pytest.mark.parametrize("change", [
    {},  # Instruct
    {"eos": "<|endoftext|>"},  # base
    {"pad_token": "<|fim_pad|>"},  # a named token that the added tokens call not special: transformers makes it so
    {"drop": ("unk_token", "pad_token", "bos_token", "additional_special_tokens")},  # Qwen2Tokenizer's defaults
    {"add_prefix_space": True, "add_bos_token": True},  # the first is honoured, the second dropped
    {"added": QWEN25_ADDED[:3]},  # Qwen2 (not 2.5)
])
def test_a_qwen25_checkpoint_layout_matches(tmp_path, change):
    d = qwen25_layout(tmp_path / "m", **change)
    assert_parity(d)
    assert_qwen_chats(d)
    hf, light = load_tokenizer(d), load_light_tokenizer(d)
    assert (light.eos_token, light.pad_token, light.unk_token, light.bos_token) == \
        (hf.eos_token, hf.pad_token, hf.unk_token, hf.bos_token)


def test_qwen2_ignores_the_pipeline_written_in_tokenizer_json_as_transformers_does(tmp_path):
    """Qwen2Tokenizer keeps only the vocabulary, merges and post-processor of tokenizer.json: a file whose
    normalizer, pre-tokenizer and decoder say otherwise still tokenizes the Qwen2 way, here as in transformers
    (loading the file as it is, as for llama, would lower-case and split on whitespace)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    d = qwen25_layout(tmp_path / "m")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(d / "tokenizer.json"))
    hf, light = load_tokenizer(d), load_light_tokenizer(d)
    assert json.loads(light._backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    for text in UNICODE + ["Hello World", "e\u0301"]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert light.encode(text, add_special_tokens=False) == ids
        assert light.decode(ids) == hf.decode(ids)
    assert light.decode(light.encode("Hello World")) == "Hello World"


def test_qwen2_added_tokens_whose_ids_transformers_would_move_are_refused(tmp_path):
    """Qwen2Tokenizer gives each added token the next free id after the vocabulary, whatever id the files name:
    with a gap the ids AutoTokenizer hands out are not the model's, so the light tokenizer refuses the directory."""
    d = qwen25_layout(tmp_path / "m")
    f = d / "tokenizer_config.json"
    config = json.loads(f.read_text())
    config["added_tokens_decoder"] = {str(int(i) + 1): t for i, t in config["added_tokens_decoder"].items()}
    f.write_text(json.dumps(config))
    first = min(int(i) for i in config["added_tokens_decoder"])
    assert load_tokenizer(d).convert_tokens_to_ids("<|endoftext|>") == first - 1  # moved, not `first`
    with pytest.raises(UnsupportedTokenizer, match="would get id"):
        load_light_tokenizer(d)


@pytest.mark.parametrize("change", [
    {"eos_token": {"content": "<|im_end|>", "special": True}},  # an AddedToken object as a named token
    {"extra_special_tokens": {"think_token": "<|box_start|>"}},  # model-specific named tokens
    {"additional_special_tokens": [{"content": "<|im_start|>"}]},
    {"tokenizer_class": "LlamaTokenizer"},
    {"added_tokens_decoder": {"5": {"content": "x", "special": True, "weird": 1}}},
    {"add_prefix_space": "yes"},
])
def test_a_qwen2_layout_beyond_real_checkpoints_is_refused(tmp_path, change):
    d = qwen25_layout(tmp_path / "m", **change)
    with pytest.raises(ModelLoadError):
        load_light_tokenizer(d)


def test_a_qwen2_directory_with_a_legacy_special_tokens_map_or_a_broken_bpe_is_refused(tmp_path):
    d = qwen25_layout(tmp_path / "m", drop=("added_tokens_decoder",))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(UnsupportedTokenizer, match="special_tokens_map"):
        load_light_tokenizer(d)
    (d / "special_tokens_map.json").unlink()
    assert_qwen_chats(d)  # without it the added tokens come from tokenizer.json, as in transformers
    data = json.loads((d / "tokenizer.json").read_text())
    data["model"]["merges"] = ["a b c"]
    (d / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="is not a tokenizer"):
        load_light_tokenizer(d)
