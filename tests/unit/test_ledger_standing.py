"""Ledger.standing: the per-request check of a signed request's node (node/coordinator/ledger.py), served from
memory after its first read; every write to the nodes table must show in it at once."""
import ast
import re
import threading
from pathlib import Path

from node.coordinator.ledger import Ledger
from node.coordinator.records import Liveness, Rejection

LEDGER_PY = Path(__file__).resolve().parents[2] / "node/coordinator/ledger.py"


def test_standing_follows_joins_bans_and_liveness(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    key = "ab" * 32
    assert ledger.standing(key) is None  # never joined
    ledger.upsert_node(key, 1.0, {"backend": "sim"})
    s = ledger.standing(key)
    assert s is not None and (s.node_id, s.banned, s.policy_step) == (key, False, None)
    assert ledger.standing(key) is s  # the second read is the cached one
    ledger.record_liveness([Liveness(key, 1, 7, 10.0, "idle")])
    assert ledger.standing(key).policy_step == 7
    ledger.record_liveness([Liveness(key, 2, None, None, None)])  # says nothing of its step: kept
    assert ledger.standing(key).policy_step == 7 == ledger.node(key).policy_step
    ledger.ban_and_void(key, None, [Rejection("forged")])
    assert ledger.standing(key).banned is True
    assert ledger.node(key).banned is True  # the same answer as the whole row
    ledger.close()


def test_every_ban_path_shows_at_once(tmp_path):
    """Each ledger method that can ban a node, after the standing was cached unbanned."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    keys = [f"{i:02x}" * 32 for i in range(4)]
    for k in keys:
        ledger.upsert_node(k, 0.0, {})
        assert ledger.standing(k).banned is False
    ledger.expire_assignment("a0", keys[0], [], penalty=1.0, ban_below=-0.5)
    ledger.decline_assignment("a1", keys[1], [], reason="late", penalty=1.0, ban_below=-0.5, hold_until_ms=0)
    ledger.void_submission("a2", keys[2], [Rejection("forged")], reputation=-1.0, banned=True)
    ledger.ban_and_void(keys[3], None, [])
    assert [ledger.standing(k).banned for k in keys] == [True] * 4
    assert ledger.forget_idle_nodes(seen_before_ms=2**62) == 0  # banned keys are kept, and still banned
    assert [ledger.standing(k).banned for k in keys] == [True] * 4
    ledger.close()


def test_forgotten_key_is_not_served_from_memory(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    key = "cd" * 32
    ledger.upsert_node(key, 1.0, {})
    assert ledger.standing(key) is not None
    assert ledger.forget_idle_nodes(seen_before_ms=2**62) == 1
    assert ledger.standing(key) is None  # must join (and pay admission) again
    ledger.close()


def test_a_read_that_raced_a_ban_is_not_cached(tmp_path):
    """The SELECT returns the row as it was; a ban commits before the result is stored: that answer is given
    once (it was true when read) but must not be cached, or the ban would never show."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    key = "ef" * 32
    ledger.upsert_node(key, 1.0, {})
    real_reader = ledger._reader

    class BanAfterRead:
        def __init__(self, conn):
            self.conn = conn

        def execute(self, sql, args):
            row = self.conn.execute(sql, args).fetchone()  # the pre-ban row
            t = threading.Thread(target=ledger.ban_and_void, args=(key, None, []))  # another thread, as intake
            t.start()
            t.join(10)
            assert not t.is_alive(), "ban_and_void did not finish within 10 s"
            return type("Cur", (), {"fetchone": lambda _self: row})()

    ledger._reader = lambda: BanAfterRead(real_reader())
    assert ledger.standing(key).banned is False  # as read
    ledger._reader = real_reader
    assert ledger.standing(key).banned is True
    ledger.close()


def test_every_method_that_writes_nodes_tells_the_cache():
    """A method of ledger.py whose SQL writes the nodes table must call _standing_changed (after its commit);
    a new writer that forgets would serve stale bans to every signed request."""
    tree = ast.parse(LEDGER_PY.read_text())
    writes = re.compile(r"(UPDATE nodes\b|INSERT (OR \w+ )?INTO nodes\b|DELETE FROM nodes\b)", re.I)
    writers, missing = [], []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        sql = [n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if not any(writes.search(s) for s in sql):
            continue
        writers.append(fn.name)
        calls = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        if "_standing_changed" not in calls:
            missing.append(fn.name)
    assert len(writers) >= 8, writers  # the scan finds the writers (upsert, liveness, bans, votes, ...)
    assert missing == [], f"these write the nodes table without _standing_changed: {missing}"


def test_checkpoints_run_off_the_commit_path(tmp_path):
    """The writer never checkpoints inside a COMMIT (wal_autocheckpoint off); the ledger's own thread copies the
    WAL into the database file: a copy of the database file alone, without its WAL, soon holds what was written."""
    import shutil
    import sqlite3
    import time

    ledger = Ledger(tmp_path / "ledger.sqlite")
    assert ledger._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    keys = [f"{i:064x}" for i in range(300)]
    for k in keys:
        ledger.upsert_node(k, 1.0, {"pad": "x" * 2000})  # ~600 KB of WAL
    deadline = time.monotonic() + 10.0
    while True:
        shutil.copy(tmp_path / "ledger.sqlite", tmp_path / "alone.sqlite")  # the main file only, no -wal
        db = sqlite3.connect(tmp_path / "alone.sqlite")
        try:
            have = db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
        except sqlite3.DatabaseError:
            have = 0  # not even the schema checkpointed yet
        db.close()
        if have == len(keys):
            break
        assert time.monotonic() < deadline, f"only {have} of {len(keys)} nodes in the database file after 10 s"
        time.sleep(0.2)
    ledger.close()
    assert not ledger._checkpointer.is_alive()
