"""node/trainer/light_tokenizer.py against transformers' AutoTokenizer, on the same model directories: every id
the coordinator hands out or checks (prompts of every built-in task, environment turns of multi-turn episodes),
every text its rewards see (decoded completions), and the EOS and padding ids, on the character tokenizer, a
byte-level BPE and (marked `real`) SmolLM2-135M-Instruct's. Then the directories it refuses: a chat template that
tries to leave jinja's sandbox, a malformed or oversized tokenizer.json, a layout only transformers loads."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from jinja2 import TemplateError

from node.envs import encode_prompt
from node.envs.base import Problem
from node.envs.episode import EnvThenModel, ModelTurn, check_episode, env_turn_ids, max_turns_of, next_env_ids
from node.envs.prompt import decode_completion
from node.envs.registry import BUILTIN_TASKS, load_task
from node.trainer.light_tokenizer import LightTokenizer, UnsupportedTokenizer, load_light_tokenizer
from node.trainer.model_dir import ModelLoadError
from node.trainer.tokenizer import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer

UNICODE = ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 done", "tab\tand\nnewline", "  leading and trailing  ",
           "<|end|> inside text", "<|im_end|><|im_start|>user", "ÅÄÖ åäö ß ﬁ", "", " ", "12+34=?", "a" * 300]
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
    for _ in range(300):  # what a reward sees of any completion, incl. EOS, padding and broken UTF-8 byte runs
        ids = [rng.randrange(vocab) if rng.random() < 0.85 else rng.choice(specials) for _ in range(rng.randrange(40))]
        assert decode_completion(light, ids) == decode_completion(hf, ids), ids
        assert light.decode(ids) == hf.decode(ids), ids

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
    {"config": {"model_type": "qwen2"}},  # transformers puts its own Qwen2 class on such a directory
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
    one = load_run_model(load_config(repo / "configs/local.toml", sets), tmp_path)
    two = load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=true"]), tmp_path)
    assert not isinstance(one.tokenizer, LightTokenizer) and isinstance(two.tokenizer, LightTokenizer)
    assert two.eos_token_id == one.eos_token_id
    f = d / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="server.engine_process = false"):
        load_run_model(load_config(repo / "configs/local.toml", sets + ["server.engine_process=true"]), tmp_path)


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
