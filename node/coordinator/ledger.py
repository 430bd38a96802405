"""The coordinator's durable record: SQLite in WAL mode.

Everything a node is told ("accepted") is committed here first, so a SIGKILL at any moment loses
nothing that was acknowledged. The published step is the single source of truth for resuming:
a step row, the rollouts it consumed and the trainer state it produced are committed together.
Only the coordinator's event loop thread writes; the training thread goes through the same lock (with
server.engine_process it is another process, its own Ledger on the same file: SQLite's lock orders them).
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable

import pydantic_core

from node.coordinator.records import (AssignmentRow, AssignmentState, DropReason, GroupRow, Liveness, Rejection,
                                      StoredRollout, StoredTurn, SubmittedGroup, Verdict)
from node.coordinator.scheduler import PromptSlot

log = logging.getLogger(__name__)
CHECKPOINT_EVERY_S = 1.0  # the ledger's WAL is copied into the database file this often (Ledger._checkpoint_loop)
STANDING_CACHE_MAX = 100_000  # nodes whose standing (Ledger.standing) is kept in memory; more empties it

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    joined_ms INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL,
    reputation REAL NOT NULL,
    banned INTEGER NOT NULL DEFAULT 0,
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    policy_step INTEGER,
    tokens_per_s REAL NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'joined',
    info TEXT NOT NULL DEFAULT '{}',
    submissions INTEGER NOT NULL DEFAULT 0,   -- recorded submissions (new nodes are verified more)
    verified_tokens INTEGER NOT NULL DEFAULT 0,  -- completion tokens replayed by the verifier
    near_ties INTEGER NOT NULL DEFAULT 0      -- of those, tokens that were not the sampler's first choice
);
CREATE TABLE IF NOT EXISTS assignments (
    assignment_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    batch_step INTEGER NOT NULL,
    min_policy_step INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    deadline_ms INTEGER NOT NULL,
    state TEXT NOT NULL,             -- open | submitted | expired | declined
    prompts TEXT NOT NULL            -- JSON: [{prompt_id, problem_index, prompt_ids, seeds}] ([] once declined)
);
CREATE INDEX IF NOT EXISTS assignments_state ON assignments(state);
CREATE INDEX IF NOT EXISTS assignments_node ON assignments(node_id, state);
CREATE TABLE IF NOT EXISTS groups (
    group_id INTEGER PRIMARY KEY AUTOINCREMENT,
    assignment_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    problem_index INTEGER NOT NULL,
    batch_step INTEGER NOT NULL,
    policy_step INTEGER NOT NULL,
    received_ms INTEGER NOT NULL,
    data TEXT NOT NULL,              -- JSON: prompt_ids + rollouts (completion, logprobs, reward, ...)
    reward_mean REAL NOT NULL,
    consumed_step INTEGER,           -- the trainer step that used it (NULL = waiting)
    dropped TEXT,                    -- why it was not used (stale, filtered), NULL otherwise
    verdict TEXT                     -- NULL = not decided yet; verified | unchecked (passed over) | void
);
CREATE INDEX IF NOT EXISTS groups_waiting ON groups(consumed_step, dropped);
CREATE INDEX IF NOT EXISTS groups_assignment ON groups(assignment_id);
CREATE UNIQUE INDEX IF NOT EXISTS groups_unique ON groups(assignment_id, prompt_id);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    assignment_id TEXT,
    prompt_id TEXT,
    sample_index INTEGER,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rejection_totals (  -- rejections pruned from `rejections`, still counted
    reason TEXT PRIMARY KEY,
    n INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    published_ms INTEGER NOT NULL,
    manifest_hash TEXT NOT NULL,
    encoding TEXT NOT NULL,
    base_step INTEGER,
    compressed_bytes INTEGER NOT NULL,
    metrics TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requeued_prompts (  -- prompts to hand out again (expired, or not accepted)
    prompt_id TEXT PRIMARY KEY,
    queued INTEGER NOT NULL,          -- order
    slot TEXT NOT NULL                -- JSON PromptSlot
);
CREATE TABLE IF NOT EXISTS join_tokens (
    token_hash TEXT PRIMARY KEY,     -- the token's identity (protocol.admission.check_join_token): one new key each
    node_id TEXT NOT NULL,
    used_ms INTEGER NOT NULL
);
"""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    joined_ms: int
    last_seen_ms: int
    reputation: float
    banned: bool
    accepted: int  # rollouts accepted (less those voided later)
    rejected: int
    policy_step: int | None  # the step the node last said it holds
    tokens_per_s: float
    state: str
    info: dict  # what the node said about itself at join (JSON)
    submissions: int  # recorded submissions (new nodes are verified more)
    verified_tokens: int  # completion tokens replayed by the verifier
    near_ties: int  # of those, tokens that were not the sampler's first choice

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "NodeRow":
        return cls(**{**dict(row), "banned": bool(row["banned"]), "info": json.loads(row["info"])})


@dataclass(frozen=True)
class NodeStanding:
    """What every signed request needs of its node (Ledger.standing): two columns, no JSON to decode."""
    node_id: str
    banned: bool
    policy_step: int | None  # the step the node last said it holds (ledger copy; newer liveness may be in memory)


@dataclass(frozen=True)
class UndecidedHead:
    """What the verdict queue decides on (Ledger.undecided_head): the submitter and claimed step of a submission's
    first undecided group, read without its rollouts (decoding a 1.3 MB submission's data took ~25 ms)."""
    node_id: str
    policy_step: int


@dataclass(frozen=True)
class RejectionRow:
    id: int
    at_ms: int
    node_id: str
    assignment_id: str | None
    prompt_id: str | None
    sample_index: int | None
    reason: str


@dataclass
class StepRow:
    step: int
    published_ms: int
    manifest_hash: str
    encoding: str
    base_step: int | None
    compressed_bytes: int
    metrics: dict


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # timeout: SQLite's busy wait for the write lock. With server.engine_process the engine process writes
        # too (published steps, node/coordinator/engine.py): a writer then waits out the other's transaction
        # (milliseconds) instead of failing after sqlite3's default 5 s under a loaded disk.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: in WAL mode a commit survives the process being killed; `durable` transactions (what a
        # node was told it got: accepted rollouts, bans, published steps) also survive power loss (FULL).
        self._db.execute("PRAGMA synchronous=NORMAL")
        # WAL checkpoints off the commit path: SQLite's automatic one runs inside the COMMIT that takes the WAL
        # past 1,000 pages (a gpu-example submission writes ~330), i.e. in whichever thread commits then, under
        # the ledger's lock, copying and fsyncing the database file while the event loop's next write waits for
        # that lock. A thread of the ledger checkpoints instead (_checkpoint_loop: PASSIVE, which never waits for
        # or blocks a reader or writer). Durability is unchanged: a commit is durable in the WAL (FULL) or
        # survives a process crash there (NORMAL), and the WAL is replayed when the ledger is opened.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.executescript(SCHEMA)
        # Reads go through one connection per thread and never wait on the writer's lock, so the event
        # loop is not held up by a commit (an fsync) running in another thread.
        self._readers = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        # Every signed request checks its node's standing (ban, claimed step): served from memory. Only this
        # process writes the nodes table (the engine process writes published steps and reads groups:
        # node/coordinator/engine.py), and every method that writes it calls _standing_changed after its commit
        # (tests/unit/test_ledger_standing.py checks both). `_standing_gen` counts those changes: a read that
        # raced one is not cached (the row it read may predate the change).
        self._standing: dict[str, NodeStanding] = {}
        self._standing_gen = 0
        self._standing_lock = threading.Lock()
        self._migrate()
        self._closing = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="ledger-checkpoint", daemon=True)
        self._checkpointer.start()

    def _checkpoint_loop(self) -> None:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            while not self._closing.wait(CHECKPOINT_EVERY_S):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as e:  # e.g. the disk is full: the next turn tries again; the WAL holds it
                    log.warning("ledger checkpoint failed: %s", e)
        finally:
            conn.close()

    def _migrate(self) -> None:
        """Columns added after a ledger was first written (CREATE TABLE IF NOT EXISTS keeps old tables)."""
        added = {"nodes": [("submissions", "INTEGER NOT NULL DEFAULT 0"),
                           ("verified_tokens", "INTEGER NOT NULL DEFAULT 0"),
                           ("near_ties", "INTEGER NOT NULL DEFAULT 0")],
                 # groups recorded before verdicts existed were verified before they were recorded
                 "groups": [("verdict", "TEXT DEFAULT 'verified'")]}
        for table, columns in added.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns:
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not threading.current_thread():
            self._checkpointer.join(10)
        with self._lock:
            for conn in self._reader_conns:
                conn.close()
            self._db.close()

    # -- plumbing --------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._readers, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA query_only=1")
            self._readers.conn = conn
            with self._lock:
                self._reader_conns.append(conn)
        return conn

    def _exec(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        if sql.lstrip()[:6].upper() == "SELECT":
            return self._reader().execute(sql, tuple(args))
        with self._lock:
            return self._db.execute(sql, tuple(args))

    def transaction(self, *, durable: bool = False):
        """`with ledger.transaction() as db:` one atomic write; `durable`: fsync'd before it returns."""
        ledger = self

        class _Tx:
            def __enter__(self):
                ledger._lock.acquire()
                if durable:
                    ledger._db.execute("PRAGMA synchronous=FULL")
                ledger._db.execute("BEGIN IMMEDIATE")
                return ledger._db

            def __exit__(self, exc_type, exc, tb):
                try:
                    ledger._db.execute("ROLLBACK" if exc_type else "COMMIT")
                finally:
                    if durable:
                        ledger._db.execute("PRAGMA synchronous=NORMAL")
                    ledger._lock.release()
                return False

        return _Tx()

    def get(self, key: str, default: Any = None) -> Any:
        row = self._exec("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, key: str, value: Any, db: sqlite3.Connection | None = None) -> None:
        """Set a small JSON value; pass `db` to write inside an open transaction."""
        sql = "INSERT INTO kv(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
        if db is not None:
            db.execute(sql, (key, json.dumps(value)))
        else:
            self._exec(sql, (key, json.dumps(value)))

    # -- nodes -----------------------------------------------------------------------------------
    def upsert_node(self, node_id: str, reputation: float, info: dict) -> NodeRow:
        t = now_ms()
        self._exec(
            "INSERT INTO nodes(node_id, joined_ms, last_seen_ms, reputation, info) VALUES(?,?,?,?,?) "
            "ON CONFLICT(node_id) DO UPDATE SET last_seen_ms=excluded.last_seen_ms, info=excluded.info",
            (node_id, t, t, reputation, json.dumps(info)),
        )
        self._standing_changed([node_id])
        node = self.node(node_id)
        assert node is not None  # upserted just now
        return node

    def node(self, node_id: str) -> NodeRow | None:
        row = self._exec("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return NodeRow.from_row(row) if row else None

    def standing(self, node_id: str) -> NodeStanding | None:
        """The node's ban and claimed step, or None if it never joined (or was forgotten): the per-request check.
        A third to a fifth of the cost of `node()` (whole row, its `info` JSON), which each signed request paid
        twice. Served from memory after the first read (`_standing`): 2-3 us instead of ~50 us of SQLite on
        this box's event loop, two per /v1/work (bench/load.py --py-spy)."""
        hit = self._standing.get(node_id)
        if hit is not None:
            return hit
        gen = self._standing_gen
        row = self._reader().execute("SELECT banned, policy_step FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        if row is None:  # not cached: a key that has not joined yet may join any moment
            return None
        got = NodeStanding(node_id, bool(row[0]), row[1])
        with self._standing_lock:
            if gen == self._standing_gen:  # no write to the nodes table since before the read
                if len(self._standing) >= STANDING_CACHE_MAX:  # bounded: strangers' keys come and go
                    self._standing.clear()
                self._standing[node_id] = got
        return got

    def _standing_changed(self, node_ids: Iterable[str] | None, steps: dict[str, int] | None = None) -> None:
        """After a commit that wrote these nodes' rows (None: any number of them): their cached standing goes;
        `steps`: nodes whose only change was their claimed step, now this one."""
        with self._standing_lock:
            self._standing_gen += 1
            if node_ids is None:
                self._standing.clear()
            else:
                for node_id in node_ids:
                    self._standing.pop(node_id, None)
            for node_id, step in (steps or {}).items():
                if (old := self._standing.get(node_id)) is not None and old.policy_step != step:
                    self._standing[node_id] = NodeStanding(node_id, old.banned, step)

    def nodes(self) -> list[NodeRow]:
        return [NodeRow.from_row(r) for r in self._exec("SELECT * FROM nodes ORDER BY joined_ms").fetchall()]

    def recent_nodes(self, since_ms: int, limit: int) -> list[NodeRow]:
        """Nodes that have done work or were seen since `since_ms`, most recently seen first."""
        rows = self._exec("SELECT * FROM nodes WHERE submissions > 0 OR last_seen_ms >= ? "
                          "ORDER BY last_seen_ms DESC LIMIT ?", (since_ms, limit)).fetchall()
        return [NodeRow.from_row(r) for r in rows]

    def node_summary(self, online_since_ms: int, newest_step: int) -> dict:
        """Counts over every node in one pass: by state, on the newest step, and their throughput."""
        rows = self._exec(
            "SELECT CASE WHEN banned THEN 'banned' WHEN last_seen_ms < ? THEN 'offline' "
            "ELSE COALESCE(NULLIF(state, ''), 'online') END AS s, COUNT(*), "
            "SUM(CASE WHEN policy_step = ? AND NOT banned THEN 1 ELSE 0 END), SUM(tokens_per_s) "
            "FROM nodes GROUP BY s", (online_since_ms, newest_step)).fetchall()
        by_state = {r[0]: r[1] for r in rows}
        return {"by_state": by_state, "total": sum(by_state.values()), "with_newest": sum(r[2] for r in rows),
                "tokens_per_s": sum(r[3] or 0.0 for r in rows if r[0] not in ("offline", "banned"))}

    def forget_idle_nodes(self, seen_before_ms: int) -> int:
        """Keys that joined and never submitted anything, not seen since `seen_before_ms`: dropped (a new
        join costs them the admission price again). Banned keys are kept: the ban must stick."""
        cur = self._exec("DELETE FROM nodes WHERE submissions = 0 AND NOT banned AND last_seen_ms < ? AND node_id NOT "
                         "IN (SELECT node_id FROM assignments WHERE state = 'open')", (seen_before_ms,))
        self._standing_changed(None)
        return cur.rowcount

    def record_liveness(self, seen: list[Liveness]) -> None:
        """Batched node liveness (last seen, policy step, tokens/s, state): heartbeats and work requests are
        kept in memory and written here every few seconds in one transaction (a per-request fsync was
        half of the event loop's time at 1,000 nodes; bench/load.py). None keeps the stored value."""
        with self.transaction() as db:
            db.executemany(
                "UPDATE nodes SET last_seen_ms=MAX(last_seen_ms, ?), policy_step=COALESCE(?, policy_step), "
                "tokens_per_s=COALESCE(?, tokens_per_s), state=COALESCE(?, state) WHERE node_id=?",
                [(s.last_seen_ms, s.policy_step, s.tokens_per_s, s.state, s.node_id) for s in seen])
        # only the claimed step changed (policy_step=COALESCE): the cached standings take it in place, so the
        # flush every few seconds does not empty the cache of every node that asked for work meanwhile
        self._standing_changed([], steps={s.node_id: s.policy_step for s in seen if s.policy_step is not None})

    def use_join_token(self, token_hash: str, node_id: str) -> bool:
        """Record that `node_id` joined with this token; False if another key already used it."""
        self._exec("INSERT OR IGNORE INTO join_tokens(token_hash, node_id, used_ms) VALUES(?,?,?)",
                   (token_hash, node_id, now_ms()))
        row = self._exec("SELECT node_id FROM join_tokens WHERE token_hash=?", (token_hash,)).fetchone()
        return row[0] == node_id

    # -- assignments -----------------------------------------------------------------------------
    def add_assignment(self, a: AssignmentRow, next_problem_index: int) -> None:
        """The assignment, its prompts leaving the re-issue queue (those that came from it) and the
        scheduler's next problem index, in one transaction."""
        with self.transaction() as db:
            self.put("next_problem_index", next_problem_index, db)
            db.execute(
                "INSERT INTO assignments(assignment_id, node_id, batch_step, min_policy_step, created_ms, "
                "deadline_ms, state, prompts) VALUES(?,?,?,?,?,?,?,?)", _assignment_values(a))
            db.executemany("DELETE FROM requeued_prompts WHERE prompt_id=?", [(p.prompt_id,) for p in a.prompts])

    def assignment(self, assignment_id: str) -> AssignmentRow | None:
        row = self._exec("SELECT * FROM assignments WHERE assignment_id=?", (assignment_id,)).fetchone()
        return _assignment(row) if row else None

    def open_assignments(self, deadline_before_ms: int | None = None) -> list[AssignmentRow]:
        """Open assignments (only those whose deadline is before `deadline_before_ms`, if given)."""
        if deadline_before_ms is None:
            rows = self._exec("SELECT * FROM assignments WHERE state='open'").fetchall()
        else:
            rows = self._exec("SELECT * FROM assignments WHERE state='open' AND deadline_ms < ?",
                              (deadline_before_ms,)).fetchall()
        return [_assignment(r) for r in rows]

    def set_assignment_state(self, assignment_id: str, state: AssignmentState) -> None:
        self._exec("UPDATE assignments SET state=? WHERE assignment_id=?", (state, assignment_id))

    # -- submissions -----------------------------------------------------------------------------
    def record_submission(self, assignment_id: str, node_id: str, groups: list[SubmittedGroup], rejections: list[Rejection],
                          requeue: list[PromptSlot], *, reputation_delta: float, reputation_cap: float,
                          ban_below: float) -> bool:
        """One transaction: the groups (waiting for their verdict), rejections, node counters and
        reputation, the prompts to hand out again, the assignment closed. Returns whether the node is
        now banned."""
        t = now_ms()
        n_acc = sum(len(g.rollouts) for g in groups)
        with self.transaction(durable=True) as db:
            for g in groups:
                db.execute(
                    "INSERT INTO groups(assignment_id, node_id, prompt_id, problem_index, batch_step, "
                    "policy_step, received_ms, data, reward_mean, verdict) VALUES(?,?,?,?,?,?,?,?,?,NULL)",
                    (assignment_id, node_id, g.prompt_id, g.problem_index, g.batch_step, g.policy_step, t,
                     _group_data(g), g.reward_mean),
                )
            self._insert_rejections(db, node_id, assignment_id, rejections, t)
            db.execute(
                "UPDATE nodes SET accepted=accepted+?, rejected=rejected+?, reputation=MIN(?, reputation+?), "
                "last_seen_ms=?, submissions=submissions+1 WHERE node_id=?",
                (n_acc, len(rejections), reputation_cap, reputation_delta, t, node_id),
            )
            db.execute("UPDATE nodes SET banned=1 WHERE node_id=? AND reputation < ?", (node_id, ban_below))
            db.execute("UPDATE assignments SET state='submitted' WHERE assignment_id=?", (assignment_id,))
            self._requeue(db, requeue)
            banned = bool(db.execute("SELECT banned FROM nodes WHERE node_id=?", (node_id,)).fetchone()[0])
        self._standing_changed([node_id])
        return banned

    @staticmethod
    def _insert_rejections(db: sqlite3.Connection, node_id: str, assignment_id: str | None,
                           rejections: list[Rejection], t: int) -> None:
        db.executemany(
            "INSERT INTO rejections(at_ms, node_id, assignment_id, prompt_id, sample_index, reason) "
            "VALUES(?,?,?,?,?,?)",
            [(t, node_id, assignment_id, r.prompt_id, r.sample_index, r.reason)
             for r in rejections])

    def record_rejection(self, node_id: str, reason: str, assignment_id: str | None = None) -> None:
        self._exec("INSERT INTO rejections(at_ms, node_id, assignment_id, reason) VALUES(?,?,?,?)",
                   (now_ms(), node_id, assignment_id, reason))

    _WAITING = "consumed_step IS NULL AND dropped IS NULL AND verdict IN ('verified', 'unchecked')"

    def waiting_groups(self) -> list[GroupRow]:
        """Groups the trainer may use: decided (verified, or passed over), not yet trained or dropped."""
        rows = self._exec(f"SELECT * FROM groups WHERE {self._WAITING} ORDER BY group_id").fetchall()
        return [_group(r) for r in rows]

    def waiting_group_ids(self) -> list[int]:
        return [r[0] for r in self._exec(f"SELECT group_id FROM groups WHERE {self._WAITING} ORDER BY group_id")]

    def groups(self, group_ids: list[int]) -> list[GroupRow]:
        """These groups, in id order."""
        out = []
        for start in range(0, len(group_ids), 500):  # SQLite's bound-parameter limit
            chunk = group_ids[start:start + 500]
            rows = self._exec(f"SELECT * FROM groups WHERE group_id IN ({','.join('?' * len(chunk))}) "
                              "ORDER BY group_id", chunk).fetchall()
            out += [_group(r) for r in rows]
        return sorted(out, key=lambda g: g.group_id)

    # -- verdicts --------------------------------------------------------------------------------
    def undecided_submissions(self) -> list[str]:
        """Assignments whose groups wait for a verdict, oldest first (re-queued after a restart)."""
        rows = self._exec("SELECT assignment_id FROM groups WHERE verdict IS NULL GROUP BY assignment_id "
                          "ORDER BY MIN(group_id)").fetchall()
        return [r[0] for r in rows]

    def submission_groups(self, assignment_id: str) -> list[GroupRow]:
        rows = self._exec("SELECT * FROM groups WHERE assignment_id=? ORDER BY group_id", (assignment_id,)).fetchall()
        return [_group(r) for r in rows]

    def undecided_head(self, assignment_id: str) -> UndecidedHead | None:
        """The node and claimed step of the submission's first group still without a verdict; None when every
        group of it has one (or it has none). Two columns through the assignment's index: no JSON decoded."""
        row = self._exec("SELECT node_id, policy_step FROM groups WHERE assignment_id=? AND verdict IS NULL "
                         "ORDER BY group_id LIMIT 1", (assignment_id,)).fetchone()
        return None if row is None else UndecidedHead(row[0], row[1])

    def set_verdict(self, assignment_id: str, verdict: Verdict, *, node_id: str | None = None, tokens: int = 0,
                    near_ties: int = 0) -> None:
        """verified / unchecked for the undecided groups of one submission, with the replay's counts."""
        with self.transaction() as db:
            db.execute("UPDATE groups SET verdict=? WHERE assignment_id=? AND verdict IS NULL", (verdict, assignment_id))
            if node_id is not None and tokens:
                db.execute("UPDATE nodes SET verified_tokens=verified_tokens+?, near_ties=near_ties+? WHERE node_id=?",
                           (tokens, near_ties, node_id))
        self._standing_changed([])  # counters only: the standing is as it was

    def ban_and_void(self, node_id: str, assignment_id: str | None,
                     rejections: list[Rejection]) -> tuple[int, dict[int, int]]:
        """A proven cheat: ban the node and void every group of it not trained on yet (its accepted count
        moves to rejected). Returns (rollouts voided, batch -> groups voided)."""
        t = now_ms()
        with self.transaction(durable=True) as db:
            rows = db.execute("SELECT group_id, batch_step, data FROM groups WHERE node_id=? AND consumed_step IS NULL "
                              "AND dropped IS NULL AND (verdict IS NULL OR verdict != 'void')", (node_id,)).fetchall()
            voided = sum(len(json.loads(r[2])["rollouts"]) for r in rows)
            db.executemany("UPDATE groups SET verdict='void' WHERE group_id=?", [(r[0],) for r in rows])
            self._insert_rejections(db, node_id, assignment_id, rejections, t)
            db.execute("UPDATE nodes SET banned=1, accepted=MAX(0, accepted-?), rejected=rejected+? WHERE node_id=?",
                       (voided, voided, node_id))
        self._standing_changed([node_id])
        by_batch: dict[int, int] = {}
        for r in rows:
            by_batch[r[1]] = by_batch.get(r[1], 0) + 1
        return voided, by_batch

    def void_submission(self, assignment_id: str, node_id: str, rejections: list[Rejection], reputation: float,
                        banned: bool, prompt_ids: Collection[str] | None = None) -> tuple[int, dict[int, int]]:
        """One submission's undecided groups void (never trained), those of `prompt_ids` only when given, with its
        rejections and the node's new reputation. Returns (rollouts voided, batch -> groups voided)."""
        with self.transaction(durable=True) as db:
            rows = db.execute("SELECT group_id, batch_step, data, prompt_id FROM groups WHERE assignment_id=? AND "
                              "verdict IS NULL", (assignment_id,)).fetchall()
            if prompt_ids is not None:
                rows = [r for r in rows if r[3] in prompt_ids]
            voided = sum(len(json.loads(r[2])["rollouts"]) for r in rows)
            db.executemany("UPDATE groups SET verdict='void' WHERE group_id=?", [(r[0],) for r in rows])
            self._insert_rejections(db, node_id, assignment_id, rejections, now_ms())
            db.execute("UPDATE nodes SET accepted=MAX(0, accepted-?), rejected=rejected+?, reputation=?, "
                       "banned=MAX(banned, ?) WHERE node_id=?", (voided, voided, reputation, int(banned), node_id))
        self._standing_changed([node_id])
        by_batch: dict[int, int] = {}
        for r in rows:
            by_batch[r[1]] = by_batch.get(r[1], 0) + 1
        return voided, by_batch

    def accepted_by_batch(self) -> dict[int, int]:
        """Groups accepted and still to be trained (decided or not; void ones excluded), per batch."""
        rows = self._exec("SELECT batch_step, COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL "
                          "AND (verdict IS NULL OR verdict != 'void') GROUP BY batch_step").fetchall()
        return {r[0]: r[1] for r in rows}

    # -- prompts to hand out again ------------------------------------------------------------------
    def _requeue(self, db: sqlite3.Connection, slots: list[PromptSlot]) -> None:
        base = db.execute("SELECT COALESCE(MAX(queued), 0) FROM requeued_prompts").fetchone()[0]
        db.executemany("INSERT OR REPLACE INTO requeued_prompts(prompt_id, queued, slot) VALUES(?,?,?)",
                       [(sl.prompt_id, base + i + 1, json.dumps(sl.to_json())) for i, sl in enumerate(slots)])

    def requeued(self) -> list[PromptSlot]:
        return [PromptSlot.from_json(json.loads(r[0]))
                for r in self._exec("SELECT slot FROM requeued_prompts ORDER BY queued").fetchall()]

    def expire_assignment(self, assignment_id: str, node_id: str, slots: list[PromptSlot], penalty: float,
                          ban_below: float) -> bool:
        """The deadline passed: the prompts go back in the queue and the node pays. True if now banned."""
        with self.transaction() as db:
            db.execute("UPDATE assignments SET state='expired' WHERE assignment_id=?", (assignment_id,))
            self._requeue(db, slots)
            db.execute("UPDATE nodes SET reputation=reputation-?, banned=MAX(banned, reputation-? < ?) "
                       "WHERE node_id=?", (penalty, penalty, ban_below, node_id))
            row = db.execute("SELECT banned FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        self._standing_changed([node_id])
        return bool(row and row[0])

    def open_assignments_of(self, node_id: str) -> int:
        """The node's slots in use: open assignments, and declined ones whose hold has not ended."""
        return self._exec("SELECT COUNT(*) FROM assignments WHERE node_id=? AND (state='open' OR "
                          "(state='declined' AND deadline_ms > ?))", (node_id, now_ms())).fetchone()[0]

    def decline_assignment(self, assignment_id: str, node_id: str, slots: list[PromptSlot], *, reason: str,
                           penalty: float, ban_below: float, hold_until_ms: int) -> bool:
        """The node submitted outside the window: one transaction records the rejection, puts the prompts back
        in the queue, drops them from the assignment row (the row only holds the node's slot now, until
        `hold_until_ms` or its own deadline, whichever is first) and takes `penalty` off the node's
        reputation. True if the node is now banned."""
        with self.transaction() as db:
            db.execute("UPDATE assignments SET state='declined', prompts='[]', deadline_ms=MIN(deadline_ms, ?) "
                       "WHERE assignment_id=?", (hold_until_ms, assignment_id))
            self._requeue(db, slots)
            self._insert_rejections(db, node_id, assignment_id, [Rejection(reason)], now_ms())
            db.execute("UPDATE nodes SET reputation=reputation-?, banned=MAX(banned, reputation-? < ?) "
                       "WHERE node_id=?", (penalty, penalty, ban_below, node_id))
            row = db.execute("SELECT banned FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        self._standing_changed([node_id])
        return bool(row and row[0])

    def prune(self, *, oldest_batch: int, keep_rejections: int) -> dict[str, int]:
        """Bounded history (issue #25): deletes declined assignments whose hold has ended, settled (submitted,
        expired) ones of batches before `oldest_batch` with no submission still waiting for its verdict (the
        replay reads the seeds from the row), and folds the rejections beyond the newest `keep_rejections`
        into per-reason totals. Returns rows deleted per table. Indexed deletes: a few ms per thousand rows."""
        t = now_ms()
        with self.transaction() as db:
            declined = db.execute("DELETE FROM assignments WHERE state='declined' AND deadline_ms <= ?", (t,)).rowcount
            settled = db.execute(
                "DELETE FROM assignments WHERE state IN ('submitted', 'expired') AND batch_step < ? AND NOT EXISTS "
                "(SELECT 1 FROM groups g WHERE g.assignment_id = assignments.assignment_id AND g.verdict IS NULL)",
                (oldest_batch,)).rowcount
            cut = db.execute("SELECT id FROM rejections ORDER BY id DESC LIMIT 1 OFFSET ?", (keep_rejections,)).fetchone()
            folded = 0
            if cut is not None:
                db.execute("INSERT INTO rejection_totals(reason, n) SELECT reason, COUNT(*) FROM rejections "
                           "WHERE id <= ? GROUP BY reason ON CONFLICT(reason) DO UPDATE SET n = n + excluded.n",
                           (cut[0],))
                folded = db.execute("DELETE FROM rejections WHERE id <= ?", (cut[0],)).rowcount
        return {"declined": declined, "settled": settled, "rejections": folded}

    def recent_rejections(self, limit: int = 20) -> list[RejectionRow]:
        rows = self._exec("SELECT * FROM rejections ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [RejectionRow(**dict(r)) for r in rows]

    def verdict_counts(self) -> dict[str, int]:
        """Groups by verdict: verified, unchecked (passed over), void, undecided."""
        rows = self._exec("SELECT COALESCE(verdict, 'undecided'), COUNT(*) FROM groups GROUP BY verdict").fetchall()
        return {r[0]: r[1] for r in rows}

    def rejection_counts(self) -> dict[str, int]:
        """Rejections by reason since the run began: the rows kept and the totals of those pruned."""
        rows = self._exec("SELECT reason, SUM(n) FROM (SELECT reason, COUNT(*) AS n FROM rejections GROUP BY reason "
                          "UNION ALL SELECT reason, n FROM rejection_totals) GROUP BY reason").fetchall()
        return {r[0]: r[1] for r in rows}

    def counts(self) -> dict[str, int]:
        acc = self._exec("SELECT COALESCE(SUM(accepted),0), COALESCE(SUM(rejected),0) FROM nodes").fetchone()
        return {"accepted_rollouts": acc[0], "rejected_rollouts": acc[1]}

    # -- steps -----------------------------------------------------------------------------------
    def publish_step(self, row: StepRow, consumed_group_ids: list[int],
                     dropped: dict[DropReason, list[int]] | None = None) -> None:
        """One transaction: the step, the groups it trained on and the groups it dropped (reason ->
        group ids), so a crash before it leaves every one of them waiting for the redone step."""
        with self.transaction(durable=True) as db:
            db.execute(
                "INSERT INTO steps(step, published_ms, manifest_hash, encoding, base_step, compressed_bytes, "
                "metrics) VALUES(?,?,?,?,?,?,?)",
                (row.step, row.published_ms, row.manifest_hash, row.encoding, row.base_step,
                 row.compressed_bytes, json.dumps(row.metrics)),
            )
            db.executemany("UPDATE groups SET consumed_step=? WHERE group_id=?",
                           [(row.step, g) for g in consumed_group_ids])
            for reason, group_ids in (dropped or {}).items():
                db.executemany("UPDATE groups SET dropped=? WHERE group_id=?", [(reason, g) for g in group_ids])

    def latest_step(self) -> StepRow | None:
        row = self._exec("SELECT * FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return self._step_row(row) if row else None

    def steps(self) -> list[StepRow]:
        return [self._step_row(r) for r in self._exec("SELECT * FROM steps ORDER BY step").fetchall()]

    @staticmethod
    def _step_row(r: sqlite3.Row) -> StepRow:
        return StepRow(r["step"], r["published_ms"], r["manifest_hash"], r["encoding"], r["base_step"],
                       r["compressed_bytes"], json.loads(r["metrics"]))


# -- records <-> rows: the one place that knows the columns and the JSON inside them ----------------------
def _assignment(r: sqlite3.Row) -> AssignmentRow:
    return AssignmentRow(r["assignment_id"], r["node_id"], r["batch_step"], r["min_policy_step"], r["created_ms"],
                         r["deadline_ms"], r["state"],
                         tuple(PromptSlot.from_json(p) for p in json.loads(r["prompts"])))


def _assignment_values(a: AssignmentRow) -> tuple:
    """The assignments row (column order of SCHEMA): prompts as [{prompt_id, problem_index, prompt_ids, seeds,
    batch_step}] (PromptSlot.to_json), [] once declined."""
    return (a.assignment_id, a.node_id, a.batch_step, a.min_policy_step, a.created_ms, a.deadline_ms, a.state,
            json.dumps([p.to_json() for p in a.prompts]))


def _group(r: sqlite3.Row) -> GroupRow:
    data = json.loads(r["data"])
    return GroupRow(r["group_id"], r["assignment_id"], r["node_id"], r["prompt_id"], r["problem_index"],
                    r["batch_step"], r["policy_step"], r["received_ms"], data["prompt_ids"],
                    tuple(_rollout(x) for x in data["rollouts"]), r["reward_mean"], r["consumed_step"], r["dropped"],
                    r["verdict"])


def _rollout(d: dict) -> StoredRollout:
    return StoredRollout(d["sample_index"], d["completion_ids"], d["logprobs"], d["reward"], d["finish_reason"],
                         d.get("commitment") or "",
                         tuple(StoredTurn(t["env_ids"], t["completion_ids"], t["logprobs"], t["finish_reason"],
                                          t.get("commitment") or "") for t in d.get("turns") or ()))


def _group_data(g: SubmittedGroup) -> str:
    """The groups row's `data` column: {"prompt_ids": [...], "rollouts": [{completion_ids, logprobs, reward,
    finish_reason, sample_index, commitment[, turns: [{completion_ids, logprobs, finish_reason, commitment,
    env_ids}]]}]}, keys in the order the ledger has always written them. Encoded by pydantic-core's JSON writer
    (compact, floats in their shortest round-trip form, read back by json.loads as the same values): 3.0 ms of CPU
    for a 1.4 MB submission's groups against json.dumps's 27.4 ms, time the intake spent holding the GIL."""
    return pydantic_core.to_json({"prompt_ids": g.prompt_ids, "rollouts": [
        {"completion_ids": r.completion_ids, "logprobs": r.logprobs, "reward": r.reward,
         "finish_reason": r.finish_reason, "sample_index": r.sample_index, "commitment": r.commitment,
         **({"turns": [{"completion_ids": t.completion_ids, "logprobs": t.logprobs, "finish_reason": t.finish_reason,
                        "commitment": t.commitment, "env_ids": t.env_ids} for t in r.turns]} if r.turns else {})}
        for r in g.rollouts]}).decode()
