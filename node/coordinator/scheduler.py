"""Hands out work inside the async window (docs/ARCHITECTURE.md, "Step semantics and the async window").

Step semantics. Trainer step n consumes batch n and produces θ_n; while batch n is being collected
the freshest policy that can exist is θ_{n-1}. A rollout made with θ_m therefore has staleness
s = (n − 1) − m for batch n, and batch n accepts it only while s ≤ k (k = run.async_level):

    m ≥ max(0, n − 1 − k)

k = 0 is on-policy (batch n comes from θ_{n-1} only); k = 2 lets nodes keep generating with θ_{n-1}
and θ_{n-2} while θ_n is still crossing the WAN. (The original design wrote the bound as m ≥ n − k;
read literally that makes k = 0 impossible, because θ_n does not exist before batch n is trained, so we
count staleness from the newest policy that can exist. docs/ARCHITECTURE.md explains this.)

Open batches: with θ_p published, batches p+1 … p+1+k can still be generated. Admission control
keeps at most `quota(b)` prompts in flight or waiting for each open batch, so no more work is out
than those batches can use. A node holding θ_m may only work for batches b ≤ m + 1 + k; if none is
open it is stale (409) and must fetch a newer checkpoint.

Fair share (docs/BENCHMARKS.md, "WAN lab: work shared by compute"). When the swarm can generate more than
the trainer consumes, work is scarce, and handing it to whoever asks first gives it to the nodes with the
shortest round trip (it fetches the newest step first, and only the newest step may work for the batch that
a step opens): in the WAN lab a home at 200 ms round trip got 16 rollouts against 1,120 for one at 20 ms on
the same compute. So the work left in the open batches is kept, for a bounded time (`fair_hold_s` per batch
before it), for nodes that asked for work and got none (`fair_waiting_s`) and have recently been given fewer
prompts than the node asking (max-min fairness over the nodes that are asking: a node's compute decides how
often it asks, its round trip no longer decides what it gets). Nobody's claims about its own speed are
used, and a node that is busy generating does not ask, so it reserves nothing. A node too stale for every open
batch is waiting too: it fetches on that answer, and the work kept for it lets a far node catch up with a
trainer that steps faster than it fetches (the trainer then waits, at most `fair_hold_s` per batch).
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

# Fair share: prompts a node was given decay with this half-life (its recent share); a node that asked for work
# and got none within FAIR_WAITING_S is waiting for work; work is kept for waiting nodes at most FAIR_HOLD_S per
# batch before it (a step's fetch and the next request of a home 200 ms away, with margin).
FAIR_HALF_LIFE_S, FAIR_WAITING_S, FAIR_HOLD_S = 20.0, 3.0, 1.5
FAIR_MAX_NODES = 4096  # bounded state: the oldest entries go first


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
    make_prompt: Callable[[int], tuple[str, list[int]]]  # problem_index -> (prompt_id, prompt_ids)
    published_step: int = 0
    next_problem_index: int = 0
    keep_rate: float = 1.0  # fraction of groups that survive filters (for oversampling)
    inflight: dict[str, list[PromptSlot]] = field(default_factory=dict)  # assignment id -> slots
    waiting_by_batch: dict[int, int] = field(default_factory=dict)  # accepted, not yet trained
    requeue: deque = field(default_factory=deque)  # slots whose assignment expired or failed
    fair_hold_s: float = FAIR_HOLD_S
    fair_waiting_s: float = FAIR_WAITING_S
    _given: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (decayed prompts, at)
    _waiting: dict[str, float] = field(default_factory=dict)  # node -> when it last asked and got nothing
    _held_since: float | None = None  # when work was first kept back for waiting nodes
    # batch -> prompts in flight, kept with `inflight` (add_inflight/_pop_inflight): counting them per request was
    # O(prompts in flight), a quarter of the event loop at 1,000 nodes (docs/BENCHMARKS.md, "Coordinator under load")
    _inflight_counts: dict[int, int] = field(default_factory=dict)

    # -- capacity --------------------------------------------------------------------------------
    def open_batches(self) -> range:
        first = self.published_step + 1
        return range(first, first + self.async_level + 1)

    def quota(self) -> int:
        """Prompts to have in flight or waiting per batch: oversample when filters drop groups."""
        return math.ceil(self.batch_prompts / max(self.keep_rate, 0.25))

    def _inflight_by_batch(self) -> dict[int, int]:
        return self._inflight_counts

    def add_inflight(self, assignment_id: str, slots: list[PromptSlot]) -> None:
        """An assignment's prompts are out (issued now, or restored from the ledger at start)."""
        self.inflight[assignment_id] = slots
        for s in slots:
            self._inflight_counts[s.batch_step] = self._inflight_counts.get(s.batch_step, 0) + 1

    def _pop_inflight(self, assignment_id: str) -> list[PromptSlot]:
        slots = self.inflight.pop(assignment_id, [])
        for s in slots:
            left = self._inflight_counts.get(s.batch_step, 0) - 1
            if left > 0:
                self._inflight_counts[s.batch_step] = left
            else:
                self._inflight_counts.pop(s.batch_step, None)
        return slots

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

    def assign(self, policy_step: int, assignment_id: str, node_id: str | None = None,
               now: float | None = None) -> tuple[int, list[PromptSlot]] | None:
        """Work for a node holding `policy_step`, or None. With `node_id`, scarce work is shared fairly (the
        module's docstring); without, first come first served."""
        now = time.monotonic() if now is None else now
        try:
            batch = self.pick_batch(policy_step)
        except StaleNode:
            if node_id is not None:
                self.note_stale(node_id, now)
            raise
        if batch is None or (node_id is not None and self._keep_for_others(node_id, batch, now)):
            if node_id is not None:
                self._waiting[node_id] = now
                self._bound(self._waiting)
            return None
        count = min(self.prompts_per_assignment, self.demand()[batch])
        slots = self.new_slots(batch, count)
        self.add_inflight(assignment_id, slots)
        if node_id is not None:
            self._waiting.pop(node_id, None)
            self._given[node_id] = (self._recent(node_id, now) + len(slots), now)
            self._bound(self._given)
        return batch, slots

    def note_stale(self, node_id: str, now: float | None = None) -> None:
        """`node_id` asked with a policy outside every open batch's window. It is fetching a newer step now (a
        worker fetches on 409) and will ask again with it: it waits for work like a node that got none. Kept out,
        a node whose fetch takes longer than a few trainer steps (200 ms away, a trainer stepping every 0.5 s)
        was stale at every ask and got 1/15 of a near node's work (tests/wan/test_wan_fair_share.py)."""
        self._waiting[node_id] = time.monotonic() if now is None else now
        self._bound(self._waiting)

    # -- fair share ------------------------------------------------------------------------------
    def _recent(self, node_id: str, now: float) -> float:
        """Prompts given to the node lately, decayed (half-life FAIR_HALF_LIFE_S)."""
        n, at = self._given.get(node_id, (0.0, now))
        return n * 0.5 ** (max(0.0, now - at) / FAIR_HALF_LIFE_S)

    def _keep_for_others(self, node_id: str, batch: int, now: float) -> bool:
        """Whether the work left should wait for nodes that asked for work, got none, and were given fewer
        prompts lately than this one. They are kept what they lack (the gap, up to what is left), so a node
        is held back only when work is scarce; and only for a bounded time, longer for a batch the trainer
        needs later (fair_hold_s per batch before it): the newest batch, the one a far node reaches last
        because it needs the newest step, can wait k steps without the trainer waiting at all."""
        mine = self._recent(node_id, now)
        owed = 0.0
        for other, asked in list(self._waiting.items()):
            if now - asked > self.fair_waiting_s:
                del self._waiting[other]
            elif other != node_id:
                gap = mine - self._recent(other, now)
                if gap >= self.prompts_per_assignment:
                    owed += gap
        if owed == 0:
            self._held_since = None
            return False
        left = sum(self.demand().values())
        if left - self.prompts_per_assignment >= owed:  # enough for this node and what the others lack
            return False
        if self._held_since is None:
            self._held_since = now
        if now - self._held_since > self.fair_hold_s * (batch - self.published_step):
            self._held_since = None  # they did not come in time: the work is needed
            return False
        return True

    @staticmethod
    def _bound(d: dict) -> None:
        while len(d) > FAIR_MAX_NODES:
            del d[next(iter(d))]

    # -- outcomes --------------------------------------------------------------------------------
    def finish(self, assignment_id: str, accepted_prompt_ids: set[str]) -> list[PromptSlot]:
        """An assignment was submitted: accepted prompts wait for training, the rest are re-issued
        (returned, for the ledger to keep them across a restart)."""
        again = []
        for s in self._pop_inflight(assignment_id):
            if s.prompt_id in accepted_prompt_ids:
                self.waiting_by_batch[s.batch_step] = self.waiting_by_batch.get(s.batch_step, 0) + 1
            else:
                again.append(s)
        self.requeue.extend(again)
        return again

    def expire(self, assignment_id: str) -> list[PromptSlot]:
        again = self._pop_inflight(assignment_id)
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
