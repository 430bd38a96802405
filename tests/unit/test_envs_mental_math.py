"""mental-math: deterministic problems with a system message, bare-number full credit, partial credit."""
from __future__ import annotations

import pytest

from node.envs import TaskError, encode_prompt, load_task
from node.envs.mental_math import last_number


def _operands(prompt: str) -> tuple[int, str, int]:
    a, op, b = prompt.removeprefix("What is ").removesuffix("?").split(" ")
    return int(a), op, int(b)


def test_problems_are_deterministic_and_correct():
    task = load_task("mental-math", {"min_value": 2, "max_value": 9, "ops": "+-*"})
    assert task.sample(5, 3) == load_task("mental-math", {"min_value": 2, "max_value": 9, "ops": "+-*"}).sample(5, 3)
    seen = set()
    for i in range(200):
        p = task.sample(0, i)
        a, op, b = _operands(p.prompt)
        seen.add(op)
        assert 2 <= a <= 9 and 2 <= b <= 9
        assert p.answer == str(a + b if op == "+" else a - b if op == "-" else a * b)
        assert int(p.answer) >= 0  # subtraction is ordered
        assert p.system == "Reply with only the final number." and p.prompt_id == f"mental-math:0:{i}"
        assert task.reference(p) == p.answer
    assert seen == {"+", "-", "*"}


def test_bare_number_full_credit_last_number_partial_else_zero():
    task = load_task("mental-math", {"partial": 0.3})
    p = task.sample(0, 0)
    a, op, b = _operands(p.prompt)
    right, wrong = p.answer, str(int(p.answer) + 1)
    assert task.score(p, right) == 1.0
    assert task.score(p, f"  {right}.\n") == 1.0  # whitespace and one final full stop are fine
    assert task.score(p, f"{a} {op} {b} = {right}") == pytest.approx(0.3)
    assert task.score(p, f"The answer is {right}.") == pytest.approx(0.3)
    assert task.score(p, f"{right} {wrong}") == 0.0  # the last number counts, not any number
    assert task.score(p, f"{a} {op} {b} = {wrong}") == 0.0
    assert task.score(p, wrong) == 0.0
    assert task.score(p, "") == 0.0 and task.score(p, "no idea") == 0.0
    assert task.score(p, right + "0") == 0.0
    # only the first 256 characters are read: a correct number after them is not seen
    assert task.score(p, "x" * 300 + right) == 0.0
    assert last_number("7 * 8 = 56, or -3") == "-3" and last_number("none") is None


def test_system_message_goes_through_a_chat_template():
    from node.trainer.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # its template has no system role: the system text is put before the user's
    task = load_task("mental-math", {"system": "only the number"})
    p = task.sample(0, 1)
    text = tok.decode(encode_prompt(tok, p))
    # (the character tokenizer has no capitals: "What" becomes "<unk>hat")
    assert "only the number" in text and p.prompt.split(" ", 1)[1] in text
    assert load_task("mental-math", {"system": None}).sample(0, 1).system is None


def test_bad_kwargs_are_clear_errors():
    with pytest.raises(TaskError, match="min_value"):
        load_task("mental-math", {"min_value": 10, "max_value": 2})
    with pytest.raises(TaskError, match="ops"):
        load_task("mental-math", {"ops": "/"})
    with pytest.raises(TaskError, match="partial"):
        load_task("mental-math", {"partial": 1.5})
