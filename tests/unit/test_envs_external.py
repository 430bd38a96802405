"""reasoning-gym datasets and verifiers environments as tasks (the `envs` extra), with the real libraries.

Nothing is downloaded: reasoning-gym generates its problems, and the verifiers environments are the
local ones in tests/vf_envs.
"""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from node.envs import Problem, TaskError, encode_prompt, load_task
from node.envs.reasoning_gym_task import (AUDITED_VERSION, PROCESS_DEPENDENT, UNSAFE_SCORERS, ReasoningGymTask,
                                          dataset_seed)

REPO = Path(__file__).resolve().parents[2]
RG = "reasoning-gym:basic_arithmetic"
RG_KWARGS = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
             "allow_parentheses": False, "allow_negation": False}
VF = "verifiers:tests.vf_envs.prime_node_arith"

pytestmark = pytest.mark.timeout(240)


# -- reasoning-gym ---------------------------------------------------------------------------------
def test_reasoning_gym_prompts_are_deterministic_and_vary_with_the_index():
    a, b = load_task(RG, RG_KWARGS), load_task(RG, dict(RG_KWARGS))
    assert isinstance(a, ReasoningGymTask)
    first = [a.sample(11, i) for i in range(40)]
    assert first == [b.sample(11, i) for i in range(40)]  # a second load, same problems
    assert [a.sample(11, i) for i in range(40)] == first  # and the same again (cached or not)
    assert first[0].prompt_id == "reasoning-gym:basic_arithmetic:11:0"
    assert first[0].prompt.startswith("Calculate ") and first[0].prompt != first[1].prompt
    assert len({p.prompt for p in first}) >= 30  # different indices, different problems
    assert [p.prompt for p in first] != [a.sample(12, i).prompt for i in range(40)]
    # reasoning-gym draws item i from Random(seed + i); the derived chunk seeds keep seed s's problem
    # i+1 from being seed s+1's problem i.
    assert sum(a.sample(11, i + 1).prompt == a.sample(12, i).prompt for i in range(40)) <= 3


def test_reasoning_gym_problem_is_the_dataset_item_of_its_chunk():
    import reasoning_gym

    task = load_task(RG, {**RG_KWARGS, "size": 5})
    assert task.size == 5
    for index in (0, 4, 5, 13):
        chunk, pos = divmod(index, 5)
        ds = reasoning_gym.create_dataset("basic_arithmetic", **RG_KWARGS, size=5,
                                          seed=dataset_seed("basic_arithmetic", 3, chunk))
        item = ds[pos]
        p = task.sample(3, index)
        assert p.prompt == item["question"] and p.answer["answer"] == item["answer"]
    assert dataset_seed("basic_arithmetic", 3, 1) != dataset_seed("basic_arithmetic", 3, 0)


def test_reasoning_gym_prompts_match_across_processes_and_hash_seeds():
    code = ("import json; from node.envs import load_task; "
            f"t = load_task({RG!r}, {RG_KWARGS!r}); "
            "print(json.dumps([[p.prompt, p.answer] for p in (t.sample(5, i) for i in range(25))]))")
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    here = load_task(RG, RG_KWARGS)
    assert outs[0] == json.loads(json.dumps([[p.prompt, p.answer] for p in (here.sample(5, i) for i in range(25))]))


def test_reasoning_gym_reward_is_the_datasets_own_scorer():
    import reasoning_gym

    task = load_task(RG, RG_KWARGS)
    for i in range(10):
        p = task.sample(0, i)
        right = p.answer["answer"]
        wrong = str(int(right) + 1)
        assert task.score(p, right) == 1.0
        assert task.score(p, f" {right}\n") == 1.0
        assert task.score(p, f"let me think <answer>{right}</answer>") == 1.0  # reasoning-gym's answer tags
        assert task.score(p, wrong) == 0.0
        assert task.score(p, f"<answer>{wrong}</answer>") == 0.0
        assert task.score(p, "") == 0.0
        assert task.reference(p) == right
    # A dataset with a scorer of its own (partial credit) gives exactly what that scorer gives.
    spell = load_task("reasoning-gym:spell_backward", {})
    p = spell.sample(1, 0)
    entry = {"question": p.prompt, **p.answer}
    scorer = reasoning_gym.create_dataset("spell_backward", seed=dataset_seed("spell_backward", 1, 0),
                                          size=spell.size)
    for completion in (p.answer["answer"], p.answer["answer"][:-1], "zzz"):
        assert spell.score(p, completion) == pytest.approx(scorer.score_answer(completion, entry))
    assert spell.score(p, p.answer["answer"]) == 1.0 and spell.score(p, "zzz") < 0.5


def test_reasoning_gym_bad_names_and_kwargs_are_task_errors():
    cases = [
        ("reasoning-gym:no_such_dataset", {}, "unknown reasoning-gym dataset 'no_such_dataset'"),
        ("reasoning-gym:", {}, "names nothing"),
        (RG, {"colour": "red"}, "invalid kwargs.*colour.*config fields"),
        (RG, {"min_terms": 0}, "min_terms must be positive"),
        (RG, {"operators": ["%"]}, "unsupported operator"),
        (RG, {"seed": 3}, "must not set 'seed'"),
        (RG, {"size": 0}, "'size' must be an integer"),
        ("reasoning-gym:string_insertion", {}, "refused: its scorer calls eval"),
        ("reasoning-gym:countdown", {}, "refused: its scorer parses the completion with sympy"),
        ("reasoning-gym:word_ladder", {}, "refused: its problems depend on PYTHONHASHSEED"),
        ("reasoning-gym:composite", {}, "not supported"),
    ]
    for name, kwargs, match in cases:
        with pytest.raises(TaskError, match=match):
            load_task(name, kwargs)


# Calls reachable from score_answer that run the completion as code. A few are reviewed and safe:
# bitwise_arithmetic and number_sorting eval the generated problem/oracle (coordinator data), and
# propositional_logic's `parse_expr` is its own recursive parser.
_DANGEROUS = {"eval", "exec", "compile", "parse_expr", "sympify", "parse_latex", "latex2sympy", "__import__"}
_REVIEWED_SAFE = {"bitwise_arithmetic", "number_sorting", "propositional_logic"}


def _reaches_dangerous_call(cls) -> bool:
    seen, stack = set(), [("method", cls, "score_answer")]
    while stack:
        kind, owner, name = stack.pop()
        if kind == "method":
            fn = next((vars(k)[name] for k in owner.__mro__ if name in vars(k)), None)
        else:
            fn = owner
        if fn is None or id(fn) in seen or not inspect.isfunction(fn):
            continue
        seen.add(id(fn))
        module = sys.modules[fn.__module__]
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name):
                if f.id in _DANGEROUS:
                    return True
                target = getattr(module, f.id, None)
                if inspect.isfunction(target) and target.__module__.startswith("reasoning_gym"):
                    stack.append(("function", target, None))
            elif isinstance(f, ast.Attribute):
                if f.attr in _DANGEROUS:
                    return True
                if isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"):
                    stack.append(("method", cls, f.attr))
    return False


def test_audit_of_scorers_that_evaluate_completions_is_current():
    from importlib.metadata import version

    from reasoning_gym.factory import DATASETS

    assert version("reasoning-gym") == AUDITED_VERSION  # re-audit (this test, PROCESS_DEPENDENT) on upgrade
    flagged = {name for name, (cls, _) in DATASETS.items() if _reaches_dangerous_call(cls)}
    assert flagged - _REVIEWED_SAFE == set(UNSAFE_SCORERS)
    assert set(UNSAFE_SCORERS) <= set(DATASETS) and PROCESS_DEPENDENT <= set(DATASETS)


@pytest.mark.parametrize("name,module", [(RG, "reasoning_gym"), (VF, "verifiers")])
def test_missing_library_is_a_task_error_with_the_install_hint(name, module):
    # A real interpreter in which the library cannot be imported (None in sys.modules blocks it).
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from node.envs import TaskError, load_task\n"
            f"try:\n    load_task({name!r}, {{}})\nexcept TaskError as e:\n    print('TaskError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TaskError:" in r.stdout and "install prime-node's `envs` extra" in r.stdout, r.stdout


# -- verifiers -------------------------------------------------------------------------------------
def test_verifiers_rows_are_problems_deterministic_by_seed_and_index():
    a, b = load_task(VF, {"rows": 12}), load_task(VF, {"rows": 12})
    probs = [a.sample(4, i) for i in range(36)]
    assert probs == [b.sample(4, i) for i in range(36)]
    assert probs[0].prompt_id == f"{VF}:4:0"
    rows = [p.answer["row"] for p in probs]
    for epoch in range(3):  # each epoch is a permutation of the 12 rows
        assert sorted(rows[12 * epoch:12 * epoch + 12]) == list(range(12))
    assert rows[:12] != rows[12:24] and rows[:12] != list(range(12))
    assert [p.answer["row"] for p in (a.sample(5, i) for i in range(12))] != rows[:12]
    assert probs[0].prompt != probs[1].prompt or rows[0] != rows[1]
    for p in probs[:12]:
        assert p.prompt == a._tasks[p.answer["row"]].data.prompt and p.system is None


def test_verifiers_reward_is_the_environments_rubric_run_to_completion():
    task = load_task(VF, {"rows": 8})
    for i in range(8):
        p = task.sample(0, i)
        answer = task.reference(p)
        a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
        assert answer == str(a + b)
        assert task.score(p, answer) == 1.0
        assert task.score(p, f"  {answer}\n") == 1.0  # trace.last_reply is stripped by verifiers
        assert task.score(p, str(a + b + 1)) == 0.0
        assert task.score(p, "") == 0.0


async def test_verifiers_scoring_works_from_inside_a_running_event_loop():
    task = load_task(VF, {"rows": 4})
    p = task.sample(1, 2)
    assert asyncio.get_running_loop() is not None
    assert task.score(p, task.reference(p)) == 1.0 and task.score(p, "no") == 0.0
    # and from worker threads at once, as the coordinator's intake calls it
    results = await asyncio.gather(*(asyncio.to_thread(task.score, p, task.reference(p)) for _ in range(8)))
    assert results == [1.0] * 8


def test_verifiers_environment_by_id_through_verifiers_own_loader(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests" / "vf_envs"))  # installs the package "prime_node_arith"
    task = load_task("verifiers:prime-node-arith", {"rows": 5, "instructions": "answer with digits only"})
    p = task.sample(0, 3)
    assert p.system == "answer with digits only" and p.prompt.endswith("=")
    assert task.score(p, task.reference(p)) == 1.0
    with pytest.raises(TaskError, match="unknown verifiers environment 'no-such-env'"):
        load_task("verifiers:no-such-env", {})


def test_system_prompt_is_a_system_turn_or_goes_before_the_user_text():
    from node.trainer.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # its chat template has no system role: the text is folded in
    folded = encode_prompt(tok, Problem("x", "1+2=", "3", system="add"))
    assert folded == encode_prompt(tok, Problem("x", "add\n\n1+2=", "3"))
    assert folded != encode_prompt(tok, Problem("x", "1+2=", "3"))
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}/{% endfor %}"
    assert tok.decode(encode_prompt(tok, Problem("x", "1+2=", "3", system="add"))) == "system:add/user:1+2=/"


MULTI_TURN = r"multi-turn verifiers environments are refused \(the coordinator cannot re-run their turns"


@pytest.mark.parametrize("name,match", [
    (f"{VF}:ToolTaskset", f"{MULTI_TURN}.*gives the model tools"),
    (f"{VF}:ConversationTaskset", f"{MULTI_TURN}.*conversation as its prompt"),
    ("verifiers:tests.vf_envs.two_agents", f"{MULTI_TURN}.*TwiceEnv"),
])
def test_multi_turn_verifiers_environments_are_refused(name, match):
    with pytest.raises(TaskError, match=match):
        load_task(name, {})


@pytest.mark.parametrize("name,kwargs,match", [
    (VF, {"task": {"judges": [{"id": "reference"}]}}, "LLM judges.*need the network"),
    (f"{VF}:SandboxTaskset", {}, "file_written needs a runtime"),
    (f"{VF}:EmptyTaskset", {}, "has no rows"),
    (f"{VF}:ArithTask", {}, "not a verifiers Taskset subclass"),
    (VF, {"colour": "red"}, "invalid kwargs.*colour"),
    (VF, {"rows": "many"}, "invalid kwargs.*rows"),
    (VF, {"id": "x"}, "must not set 'id'"),
    ("verifiers:no_such_pkg.env", {}, "cannot import verifiers environment module 'no_such_pkg.env'"),
    ("verifiers:", {}, "names nothing"),
])
def test_verifiers_bad_environments_and_kwargs_are_task_errors(name, kwargs, match):
    with pytest.raises(TaskError, match=match):
        load_task(name, kwargs)
