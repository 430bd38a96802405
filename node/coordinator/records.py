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
