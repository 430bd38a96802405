"""Hands out work inside the async window (DESIGN §1).

Step semantics. Trainer step n consumes batch n and produces θ_n; while batch n is being collected
the freshest policy that can exist is θ_{n-1}. A rollout made with θ_m therefore has staleness
s = (n − 1) − m for batch n, and batch n accepts it only while s ≤ k (k = run.async_level):

    m ≥ max(0, n − 1 − k)

k = 0 is on-policy (batch n comes from θ_{n-1} only); k = 2 lets nodes keep generating with θ_{n-1}
and θ_{n-2} while θ_n is still crossing the WAN. (DESIGN §1 writes the bound as m ≥ n − k; read
literally that makes k = 0 impossible, because θ_n does not exist before batch n is trained, so we
count staleness from the newest policy that can exist. docs/ARCHITECTURE.md explains this.)

Open batches: with θ_p published, batches p+1 … p+1+k can still be generated. Admission control
keeps at most `quota(b)` prompts in flight or waiting for each open batch, so no more work is out
than those batches can use. A node holding θ_m may only work for batches b ≤ m + 1 + k; if none is
open it is stale (409) and must fetch a newer checkpoint.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field


def min_policy_for_batch(batch: int, k: int) -> int:
    return max(0, batch - 1 - k)


@dataclass
class PromptSlot:
    """One prompt of a batch, with the seeds of its G samples. Survives reassignment unchanged."""

    prompt_id: str
    problem_index: int
    prompt_ids: list[int]
    seeds: list[int]
    batch_step: int

    def to_json(self) -> dict:
        return {"prompt_id": self.prompt_id, "problem_index": self.problem_index,
                "prompt_ids": self.prompt_ids, "seeds": self.seeds, "batch_step": self.batch_step}

    @classmethod
    def from_json(cls, d: dict) -> "PromptSlot":
        return cls(d["prompt_id"], d["problem_index"], d["prompt_ids"], d["seeds"], d["batch_step"])


class StaleNode(Exception):
    """The node's policy is too old for every open batch."""


@dataclass
class Scheduler:
    async_level: int
    batch_prompts: int
    group_size: int
    prompts_per_assignment: int
    make_prompt: "callable"  # problem_index -> (prompt_id, prompt_ids)
    published_step: int = 0
    next_problem_index: int = 0
    keep_rate: float = 1.0  # fraction of groups that survive filters (for oversampling)
    inflight: dict[str, list[PromptSlot]] = field(default_factory=dict)  # assignment id -> slots
    waiting_by_batch: dict[int, int] = field(default_factory=dict)  # accepted, not yet trained
    requeue: deque = field(default_factory=deque)  # slots whose assignment expired or failed

    # -- capacity --------------------------------------------------------------------------------
    def open_batches(self) -> range:
        first = self.published_step + 1
        return range(first, first + self.async_level + 1)

    def quota(self) -> int:
        """Prompts to have in flight or waiting per batch: oversample when filters drop groups."""
        return math.ceil(self.batch_prompts / max(self.keep_rate, 0.25))

    def _inflight_by_batch(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for slots in self.inflight.values():
            for s in slots:
                counts[s.batch_step] = counts.get(s.batch_step, 0) + 1
        return counts

    def demand(self) -> dict[int, int]:
        """Open batch -> prompts still needed. Work for an already-trained batch rolls forward."""
        first = self.published_step + 1
        inflight = self._inflight_by_batch()
        carried = sum(n for b, n in self.waiting_by_batch.items() if b < first)
        carried += sum(n for b, n in inflight.items() if b < first)
        out = {}
        for b in self.open_batches():
            have = self.waiting_by_batch.get(b, 0) + inflight.get(b, 0)
            if b == first:
                have += carried
            out[b] = max(0, self.quota() - have)
        return out

    # -- assignment ------------------------------------------------------------------------------
    def pick_batch(self, policy_step: int) -> int | None:
        """The lowest open batch this node may work on that still needs prompts (None = no work now).
        Raises StaleNode when the node's policy is outside every open batch's window."""
        if policy_step > self.published_step:
            raise ValueError("policy step from the future")
        last_ok = policy_step + 1 + self.async_level
        eligible = [b for b in self.open_batches() if b <= last_ok]
        if not eligible:
            raise StaleNode()
        demand = self.demand()
        for b in eligible:
            if demand[b] > 0:
                return b
        return None

    def new_slots(self, batch: int, count: int) -> list[PromptSlot]:
        slots: list[PromptSlot] = []
        while self.requeue and len(slots) < count:
            s = self.requeue.popleft()
            s.batch_step = batch  # same prompt and seeds, now counted for the batch it is issued for
            slots.append(s)
        while len(slots) < count:
            idx = self.next_problem_index
            self.next_problem_index += 1
            prompt_id, prompt_ids = self.make_prompt(idx)
            slots.append(PromptSlot(prompt_id, idx, prompt_ids, self.seeds_for(idx), batch))
        return slots

    def seeds_for(self, problem_index: int) -> list[int]:
        """Per-sequence seeds chosen by the coordinator, unpredictable to nodes (os.urandom)."""
        return [int.from_bytes(os.urandom(8), "big") >> 1 for _ in range(self.group_size)]

    def assign(self, policy_step: int, assignment_id: str) -> tuple[int, list[PromptSlot]] | None:
        batch = self.pick_batch(policy_step)
        if batch is None:
            return None
        count = min(self.prompts_per_assignment, self.demand()[batch])
        slots = self.new_slots(batch, count)
        self.inflight[assignment_id] = slots
        return batch, slots

    # -- outcomes --------------------------------------------------------------------------------
    def finish(self, assignment_id: str, accepted_prompt_ids: set[str]) -> list[PromptSlot]:
        """An assignment was submitted: accepted prompts wait for training, the rest are re-issued
        (returned, for the ledger to keep them across a restart)."""
        again = []
        for s in self.inflight.pop(assignment_id, []):
            if s.prompt_id in accepted_prompt_ids:
                self.waiting_by_batch[s.batch_step] = self.waiting_by_batch.get(s.batch_step, 0) + 1
            else:
                again.append(s)
        self.requeue.extend(again)
        return again

    def expire(self, assignment_id: str) -> list[PromptSlot]:
        again = self.inflight.pop(assignment_id, [])
        self.requeue.extend(again)
        return again

    def on_step_published(self, step: int, consumed_by_batch: dict[int, int]) -> None:
        self.published_step = step
        self.forget_waiting(consumed_by_batch)

    def forget_waiting(self, by_batch: dict[int, int]) -> None:
        """Accepted groups that no longer wait: trained, or dropped (stale, filtered). Dropped ones are
        reported as they happen, so the batch being collected asks for replacements at once (with
        k = 0 nothing else would ever refill it)."""
        for b, n in by_batch.items():
            left = self.waiting_by_batch.get(b, 0) - n
            if left > 0:
                self.waiting_by_batch[b] = left
            else:
                self.waiting_by_batch.pop(b, None)


def assignment_id() -> str:
    return f"a{int(time.time() * 1000):x}{os.urandom(6).hex()}"
