"""Tasks: deterministic sampling, scoring, plug-ins by import path, prompt encoding."""
from __future__ import annotations

import random

import pytest

from node.envs import BUILTIN_TASKS, Problem, Task, TaskError, TaskKwargs, decode_completion, encode_prompt, load_task
from node.envs.reverse_text import lcs_length


def test_sampling_is_deterministic_in_seed_and_index():
    task = load_task("reverse-text", {})
    assert task.sample(3, 7) == load_task("reverse-text", {}).sample(3, 7)
    assert task.sample(3, 7) != task.sample(3, 8)
    assert task.sample(3, 7) != task.sample(4, 7)
    p = task.sample(3, 7)
    assert p.prompt_id == "reverse-text:3:7" and p.answer == p.prompt[::-1]
    assert 3 <= len(p.prompt) <= 6


def test_reverse_text_knobs_and_lcs_ratio_score():
    task = load_task("reverse-text", {"min_len": 2, "max_len": 2, "alphabet": "ab"})
    for i in range(20):
        p = task.sample(0, i)
        assert len(p.prompt) == 2 and set(p.prompt) <= {"a", "b"}
    p = Problem("x", "abcd", "dcba")
    assert task.score(p, "dcba") == 1.0
    assert task.score(p, " dcba\n") == 1.0  # surrounding whitespace ignored
    assert task.score(p, "dca") == pytest.approx(3 / 4)
    assert task.score(p, "dcbaxxxx") == pytest.approx(4 / 8)  # extra characters cost
    assert task.score(p, "") == 0.0
    assert lcs_length("abcbdab", "bdcaba") == 4


def _lcs_reference(a: str, b: str) -> int:
    """The classic dynamic programme, which lcs_length replaced by its bit-parallel form."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_lcs_length_is_the_dynamic_programmes_answer():
    rng = random.Random(5)
    for _ in range(500):
        alphabet = rng.choice(["ab", "abc", "abcdefgh", "ab \n\u00e9\u4e2d"])
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 70)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        assert lcs_length(a, b) == lcs_length(b, a) == _lcs_reference(a, b), (a, b)
    assert lcs_length("x" * 256, "x" * 6) == 6 and lcs_length("", "abc") == 0


def test_arithmetic_exact_match():
    task = load_task("arithmetic", {"max_value": 5, "ops": "*"})
    p = task.sample(1, 2)
    a, b = p.prompt.rstrip("=").split("*")
    assert p.answer == str(int(a) * int(b))
    assert task.score(p, p.answer) == 1.0 and task.score(p, p.answer + "0") == 0.0
    assert task.reference(p) == p.answer


def test_bad_kwargs_and_unknown_tasks_are_clear_errors():
    with pytest.raises(TaskError, match="min_len"):
        load_task("reverse-text", {"min_len": 9, "max_len": 2})
    with pytest.raises(TaskError, match="unexpected|Extra"):
        load_task("reverse-text", {"colour": "red"})
    with pytest.raises(TaskError, match="unknown task"):
        load_task("no-such-task", {})
    with pytest.raises(TaskError, match="cannot import"):
        load_task("no_such_pkg.mod:Task", {})
    with pytest.raises(TaskError, match="no attribute"):
        load_task("tests.unit.test_envs:Missing", {})
    with pytest.raises(TaskError, match="not an import path"):
        load_task("../evil.py:Task", {})
    assert set(BUILTIN_TASKS) == {"reverse-text", "arithmetic", "guess-number", "mental-math"}


class CountLetters(Task):
    """A custom task for the import-path test: how many times does a letter occur?"""

    name = "count-letters"

    class Kwargs(TaskKwargs):
        letter: str = "a"

    def make_problem(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice("ab") for _ in range(5))
        return f"{self.kwargs.letter}?{text}", str(text.count(self.kwargs.letter))

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)


def test_custom_task_by_import_path():
    task = load_task("tests.unit.test_envs:CountLetters", {"letter": "b"})
    p = task.sample(0, 0)
    assert p.prompt.startswith("b?") and task.score(p, p.answer) == 1.0
    with pytest.raises(TaskError, match="invalid arguments"):
        load_task("tests.unit.test_envs:CountLetters", {"letter": 3})


def test_encode_prompt_applies_chat_template_and_round_trips(tmp_path):
    from node.trainer import build_tiny_model_dir, load_tokenizer

    tok = load_tokenizer(build_tiny_model_dir(tmp_path / "m", hidden_size=16, layers=1, heads=2))
    p = load_task("reverse-text", {}).sample(0, 0)
    ids = encode_prompt(tok, p)
    assert tok.decode(ids) == f"<|user|>{p.prompt}<|assistant|>"
    completion = tok(p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert decode_completion(tok, completion) == p.answer
