"""The coordinator's records, typed: assignments, submitted and stored groups with their rollouts, node liveness.

The wire is typed by protocol/messages.py (pydantic, untrusted input); these are the coordinator's own records
after intake, so they are plain frozen dataclasses with `Literal` states and verdicts, checked by the type checker
rather than at run time. The ledger (ledger.py) alone turns them into rows and back (JSON in its columns, the
shape described in its SCHEMA), so nothing else in the coordinator knows a column or a JSON key;
tests/unit/test_records.py fails on code outside the ledger that indexes one of them by a string key.

Frozen is shallow: token lists inside a record are lists (no copy on the way in or out of the ledger) that nobody
mutates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from node.coordinator.scheduler import PromptSlot

AssignmentState = Literal["open", "submitted", "expired", "declined"]


@dataclass(frozen=True)
class AssignmentRow:
    """Prompts handed to one node for one batch. Until `deadline_ms` it holds one of the node's slots
    (a declined one too: its prompts are back in the queue and `prompts` is empty)."""
    assignment_id: str
    node_id: str
    batch_step: int
    min_policy_step: int
    created_ms: int
    deadline_ms: int
    state: AssignmentState
    prompts: tuple[PromptSlot, ...]


Verdict = Literal["verified", "unchecked", "void"]  # replayed and passed | passed over by the draw | failed
DropReason = Literal["stale", "filtered"]  # why the trainer did not use a group
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StoredTurn:
    """A multi-turn episode's turn after the first: the environment's tokens, then the model's turn."""
    env_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    commitment: str


@dataclass(frozen=True)
class StoredRollout:
    """One accepted sample: the model's first turn with its evidence, the reward intake computed, the turns after."""
    sample_index: int
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: FinishReason
    commitment: str
    turns: tuple[StoredTurn, ...] = ()


@dataclass(frozen=True)
class SubmittedGroup:
    """A whole group of one submission, scored by intake, before the ledger gives it an id."""
    prompt_id: str
    problem_index: int
    batch_step: int
    policy_step: int
    reward_mean: float
    prompt_ids: list[int]
    rollouts: tuple[StoredRollout, ...]


@dataclass(frozen=True)
class GroupRow:
    """A stored group: waits for its verdict, then for the trainer (consumed at a step, or dropped)."""
    group_id: int
    assignment_id: str
    node_id: str
    prompt_id: str
    problem_index: int
    batch_step: int
    policy_step: int
    received_ms: int
    prompt_ids: list[int]
    rollouts: tuple[StoredRollout, ...]
    reward_mean: float
    consumed_step: int | None  # the trainer step that used it (None = waiting)
    dropped: DropReason | None
    verdict: Verdict | None  # None = not decided yet


@dataclass(frozen=True)
class Rejection:
    """Why a rollout (or a whole submission: no prompt, no sample) was refused."""
    reason: str
    prompt_id: str | None = None
    sample_index: int | None = None


NodeState = Literal["starting", "fetching", "generating", "idle", "stopping"]  # a heartbeat's (protocol/messages.py)


@dataclass(frozen=True)
class Liveness:
    """What a node's last heartbeat or work request said, kept in memory and written to the ledger in batches
    (Ledger.record_liveness). None: not said since the last write; the ledger keeps its stored value."""
    node_id: str
    last_seen_ms: int
    policy_step: int | None
    tokens_per_s: float | None
    state: NodeState | None
