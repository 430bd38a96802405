"""The coordinator's records (node/coordinator/records.py): typed, converted to and from rows by the ledger alone.

- round trips: record -> ledger row -> record gives the record back, and the row's JSON keeps the shape the
  ledger has always stored, so a ledger written before the records were typed loads (old rows inserted here
  with raw SQL, the way the old code wrote them);
- nothing in node/coordinator outside ledger.py indexes a record by a string key (an AST scan).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

from node.coordinator.ledger import Ledger
from node.coordinator.records import (AssignmentRow, GroupRow, Liveness, Rejection, StoredRollout, StoredTurn,
                                      SubmittedGroup)
from node.coordinator.scheduler import PromptSlot

REPO = Path(__file__).resolve().parents[2]
COORDINATOR = REPO / "node" / "coordinator"

# The keys of the records' stored JSON and columns: outside the ledger, none of them is a subscript or a .get().
# Left out: "reward" and "reward_mean", which are also keys of a step's metrics and of the eval curve (plain JSON
# documents); a record indexed by them fails the type checker anyway (a dataclass is not subscriptable).
RECORD_KEYS = {"assignment_id", "node_id", "batch_step", "min_policy_step", "created_ms", "deadline_ms", "state",
               "prompts", "prompt_id", "problem_index", "prompt_ids", "seeds",
               "group_id", "policy_step", "received_ms", "data", "consumed_step", "dropped", "verdict",
               "rollouts", "sample_index", "completion_ids", "logprobs", "finish_reason", "commitment",
               "turns", "env_ids", "reason"}


def slot(i: int, batch: int = 1) -> PromptSlot:
    return PromptSlot(f"{i}:p{i}", i, [1, 2, 3 + i], [100 + i, 200 + i], batch)


def assignment(aid: str = "a1", state: str = "open", prompts: tuple[PromptSlot, ...] = (slot(0), slot(1))) -> AssignmentRow:
    return AssignmentRow(assignment_id=aid, node_id="n" * 64, batch_step=1, min_policy_step=0, created_ms=1_000,
                         deadline_ms=61_000, state=state, prompts=prompts)  # type: ignore[arg-type]


def raw(ledger: Ledger, sql: str, args: tuple = ()) -> list[tuple]:
    return [tuple(r) for r in ledger._exec(sql, args).fetchall()]


def test_assignment_round_trip_and_stored_shape(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.upsert_node("n" * 64, 1.0, {})
    a = assignment()
    ledger.add_assignment(a, next_problem_index=2)
    assert ledger.assignment("a1") == a
    assert ledger.open_assignments() == [a]
    (prompts,), = raw(ledger, "SELECT prompts FROM assignments WHERE assignment_id='a1'")
    assert json.loads(prompts) == [{"prompt_id": "0:p0", "problem_index": 0, "prompt_ids": [1, 2, 3],
                                    "seeds": [100, 200], "batch_step": 1},
                                   {"prompt_id": "1:p1", "problem_index": 1, "prompt_ids": [1, 2, 4],
                                    "seeds": [101, 201], "batch_step": 1}]
    # expired: its prompts are queued again, typed, in order
    assert not ledger.expire_assignment("a1", "n" * 64, list(a.prompts), penalty=0.1, ban_below=-10)
    expired = ledger.assignment("a1")
    assert expired is not None and expired.state == "expired"
    assert ledger.requeued() == list(a.prompts)
    ledger.add_assignment(assignment("a2", prompts=(slot(1),)), next_problem_index=2)  # taking one leaves the other
    assert ledger.requeued() == [slot(0)]
    ledger.decline_assignment("a2", "n" * 64, [slot(1)], reason="stale_policy", penalty=0.1, ban_below=-10,
                              hold_until_ms=0)
    declined = ledger.assignment("a2")
    assert declined is not None and (declined.state, declined.prompts) == ("declined", ())
    ledger.close()


def test_assignment_written_by_the_old_code_loads(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    old = [{"prompt_id": "7:x", "problem_index": 7, "prompt_ids": [5, 6], "seeds": [1, 2, 3, 4], "batch_step": 3}]
    ledger._exec("INSERT INTO assignments(assignment_id, node_id, batch_step, min_policy_step, created_ms, "
                 "deadline_ms, state, prompts) VALUES(?,?,?,?,?,?, 'open', ?)",
                 ("old", "n" * 64, 3, 1, 5, 6, json.dumps(old)))
    ledger._exec("INSERT INTO requeued_prompts(prompt_id, queued, slot) VALUES(?,?,?)", ("7:x", 1, json.dumps(old[0])))
    a = ledger.assignment("old")
    assert a == AssignmentRow("old", "n" * 64, 3, 1, 5, 6, "open", (PromptSlot("7:x", 7, [5, 6], [1, 2, 3, 4], 3),))
    assert ledger.requeued() == list(a.prompts)
    ledger.close()


def group(prompt_id: str = "0:p0", *, turns: bool = False) -> SubmittedGroup:
    more = (StoredTurn([9, 9], [4, 2], [-0.5, -0.25], "stop", "c1"),) if turns else ()
    return SubmittedGroup(prompt_id=prompt_id, problem_index=0, batch_step=1, policy_step=0, reward_mean=0.5,
                          prompt_ids=[1, 2, 3],
                          rollouts=(StoredRollout(0, [7, 2], [-0.1, -0.2], 1.0, "stop", "c0", more),
                                    StoredRollout(1, [8, 8], [-1.0, -2.0], 0.0, "length", "c2")))


def test_group_round_trip_and_stored_shape(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.upsert_node("n" * 64, 1.0, {})
    ledger.add_assignment(assignment(), next_problem_index=2)
    g, h = group(turns=True), group("1:p1")
    ledger.record_submission("a1", "n" * 64, [g, h], [Rejection("too_long", "1:p1", 2)], [], reputation_delta=0.0,
                             reputation_cap=1.0, ban_below=-10)
    stored = ledger.submission_groups("a1")
    assert [(x.prompt_id, x.prompt_ids, x.rollouts, x.reward_mean, x.verdict) for x in stored] == \
        [(y.prompt_id, y.prompt_ids, y.rollouts, y.reward_mean, None) for y in (g, h)]
    assert stored[0].rollouts[0].turns[0].env_ids == [9, 9]
    (data,), = raw(ledger, "SELECT data FROM groups WHERE group_id=?", (stored[0].group_id,))
    assert json.loads(data) == {"prompt_ids": [1, 2, 3], "rollouts": [
        {"completion_ids": [7, 2], "logprobs": [-0.1, -0.2], "reward": 1.0, "finish_reason": "stop", "sample_index": 0,
         "commitment": "c0", "turns": [{"completion_ids": [4, 2], "logprobs": [-0.5, -0.25], "finish_reason": "stop",
                                        "commitment": "c1", "env_ids": [9, 9]}]},
        {"completion_ids": [8, 8], "logprobs": [-1.0, -2.0], "reward": 0.0, "finish_reason": "length",
         "sample_index": 1, "commitment": "c2"}]}
    assert list(json.loads(data)["rollouts"][1]) == ["completion_ids", "logprobs", "reward", "finish_reason",
                                                     "sample_index", "commitment"]  # the order always written
    assert [tuple(r) for r in raw(ledger, "SELECT prompt_id, sample_index, reason FROM rejections")] == \
        [("1:p1", 2, "too_long")]
    ledger.set_verdict("a1", "verified")
    assert [x.group_id for x in ledger.waiting_groups()] == [x.group_id for x in stored]
    assert ledger.ban_and_void("n" * 64, None, [Rejection("verify_near_tie_rate")]) == (4, {1: 2})
    assert {x.verdict for x in ledger.groups([x.group_id for x in stored])} == {"void"}
    ledger.close()


def test_group_written_by_the_old_code_loads(tmp_path: Path) -> None:
    """A group row as the old intake wrote it: its JSON built by hand (an older row may lack `commitment`)."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    data = {"prompt_ids": [5], "rollouts": [
        {"completion_ids": [1, 2], "logprobs": [-0.5, -0.5], "reward": 0.25, "finish_reason": "stop", "sample_index": 0},
        {"completion_ids": [3], "logprobs": [-1.5], "reward": 0.75, "finish_reason": "length", "sample_index": 1,
         "commitment": "cc", "turns": [{"completion_ids": [4], "logprobs": [-0.1], "finish_reason": "stop",
                                        "commitment": "dd", "env_ids": [6, 7]}]}]}
    ledger._exec("INSERT INTO groups(assignment_id, node_id, prompt_id, problem_index, batch_step, policy_step, "
                 "received_ms, data, reward_mean, consumed_step, dropped, verdict) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)",
                 ("old", "n" * 64, "5:x", 5, 2, 1, 99, json.dumps(data), 0.5, 3, "filtered", "unchecked"))
    (g,) = ledger.groups([1])
    assert g == GroupRow(1, "old", "n" * 64, "5:x", 5, 2, 1, 99, [5], (
        StoredRollout(0, [1, 2], [-0.5, -0.5], 0.25, "stop", ""),
        StoredRollout(1, [3], [-1.5], 0.75, "length", "cc", (StoredTurn([6, 7], [4], [-0.1], "stop", "dd"),))),
        0.5, 3, "filtered", "unchecked")
    ledger.close()


def test_liveness_reaches_the_node_row_and_none_keeps_the_stored_value(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    a, b = "a" * 64, "b" * 64
    for n in (a, b):
        ledger.upsert_node(n, 1.0, {})
    ledger.record_liveness([Liveness(a, 10**13, 3, 250.0, "generating"), Liveness(b, 10**13, 1, None, None)])
    ledger.record_liveness([Liveness(a, 10**13 + 5, None, None, None)])
    na, nb = ledger.node(a), ledger.node(b)
    assert na is not None and nb is not None
    assert (na.last_seen_ms, na.policy_step, na.tokens_per_s, na.state) == (10**13 + 5, 3, 250.0, "generating")
    assert (nb.policy_step, nb.tokens_per_s, nb.state) == (1, 0.0, "joined")
    ledger.close()


def string_key_uses(tree: ast.AST, keys: set[str]) -> list[tuple[int, str]]:
    """x["key"] and x.get("key") with a record key, as (line, key); a type's `Literal["key"]` is not a read."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            continue
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in keys:
            found.append((node.lineno, node.slice.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys):
            found.append((node.lineno, node.args[0].value))
    return found


def test_scan_finds_string_keyed_records() -> None:
    """The scan itself: it sees the old code's ways of reading a record."""
    old = ('seeds = {p["prompt_id"]: p["seeds"] for p in a.prompts}\nx = r.get("sample_index")\nok = d["other"]\n'
           'kind: Literal["seeds"] = "seeds"\n')
    assert sorted(string_key_uses(ast.parse(old), RECORD_KEYS)) == [(1, "prompt_id"), (1, "seeds"), (2, "sample_index")]


def without_slot_json(tree: ast.Module) -> ast.Module:
    """scheduler.py less PromptSlot.from_json: a prompt slot's own JSON form, which only the ledger calls (below)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "PromptSlot":
            node.body = [f for f in node.body if not (isinstance(f, ast.FunctionDef) and f.name == "from_json")]
    return tree


def test_no_record_is_indexed_by_string_outside_the_ledger() -> None:
    offenders = {}
    for path in sorted(COORDINATOR.glob("*.py")):
        if path.name in ("ledger.py", "records.py"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        found = string_key_uses(without_slot_json(tree) if path.name == "scheduler.py" else tree, RECORD_KEYS)
        if found:
            offenders[path.name] = found
    assert not offenders, f"records read by string key outside node/coordinator/ledger.py: {offenders}"


def test_only_the_ledger_converts_records() -> None:
    """Rows and JSON become records (and back) in ledger.py only: nothing else calls a slot's to_json/from_json."""
    callers = {}
    for path in sorted(COORDINATOR.glob("*.py")):
        calls = [n.lineno for n in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in ("to_json", "from_json")]
        if calls and path.name != "ledger.py":
            callers[path.name] = calls
    assert not callers, f"record conversions outside node/coordinator/ledger.py: {callers}"
