"""Intake of one submission, in explicit steps: assess (assess.py: triage → score → encode; in a thread, or in
an intake process, intake_pool.py) → reputation → record → verdict queue.

Reputation: a structurally impossible rollout costs `reputation_penalty`; a clean submission earns
`reputation_reward` (up to the start value); below `ban_below` the node is banned. A verified forgery
bans at once (verification.py).

Nothing is acknowledged before the ledger transaction commits. Which submissions are replayed against
the claimed weights is decided afterwards, in secret, by the verdict queue (verification.py): the
answer a node gets is the same, and comes as fast, whether or not its work will be checked, and its
groups enter training only after their verdict.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from node.config import Config
from node.coordinator.assess import Assessed, Assessor
from node.coordinator.faults import crash_point
from node.coordinator.intake_pool import IntakePool, IntakePoolBroken
from node.coordinator.ledger import Ledger
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.records import AssignmentRow
from node.coordinator.run_model import RunModel
from node.coordinator.scheduler import Scheduler
from node.coordinator.verification import VerdictQueue
from protocol import messages as M

log = logging.getLogger("prime_node.intake")


class Intake:
    def __init__(self, *, cfg: Config, ledger: Ledger, scheduler: Scheduler, verdicts: VerdictQueue,
                 metrics: CoordinatorMetrics, model: RunModel, recent_staleness: deque[int],
                 pool: IntakePool | None = None):
        self.cfg = cfg
        self.ledger = ledger
        self.scheduler = scheduler
        self.verdicts = verdicts
        self.metrics = metrics
        self.assessor = Assessor(cfg, model)
        self.pool = pool
        self.recent_staleness = recent_staleness

    async def process(self, node_id: str, a: AssignmentRow, req: M.SubmitRequest,
                      body: bytes | None = None) -> M.SubmitResponse:
        # Off the event loop: a 1.4 MB submission costs ~23 ms of CPU to assess and an fsync'd commit. With an
        # intake pool (`server.intake_processes`) the assessment runs in another process, out of this one's GIL,
        # which the event loop and every other node's request wait on; else, with the commit, in a thread.
        pooled: Assessed | None = None
        if self.pool is not None and body is not None:
            try:
                pooled = await self.pool.assess(a.prompts, a.batch_step, body)
            except IntakePoolBroken as e:  # said and counted by the pool; this submission is assessed here
                log.warning("assessing submission %s in the API process: %s", a.assignment_id, e)
        if pooled is None:
            assessed, banned = await asyncio.to_thread(self._assess_and_record, node_id, a, req)
        else:
            assessed, banned = pooled, await asyncio.to_thread(self._record, node_id, a, pooled)
        crash_point("intake")
        if banned:
            log.warning("node %s banned (reputation below %.2f)", node_id[:12], self.cfg.verification.ban_below)
        groups = assessed.groups
        self.scheduler.finish(a.assignment_id, {g.prompt_id for g in groups})
        if groups:
            self.verdicts.submit(a.assignment_id)
        staleness = max(0, a.batch_step - 1 - req.policy_step)
        for _ in groups:
            self.recent_staleness.append(staleness)
            self.metrics.staleness.observe(staleness)
        self.metrics.accepted.inc(sum(len(g.sample_indexes) for g in groups))
        for r in assessed.rejections:
            self.metrics.rejected.labels(r.reason).inc()
        return M.SubmitResponse(
            accepted=[M.RolloutRef(prompt_id=g.prompt_id, sample_index=i) for g in groups for i in g.sample_indexes],
            rejected=[M.Rejection(prompt_id=r.prompt_id, sample_index=r.sample_index, reason=r.reason)
                      for r in assessed.rejections],
        )

    def _assess_and_record(self, node_id: str, a: AssignmentRow, req: M.SubmitRequest) -> tuple[Assessed, bool]:
        assessed = self.assessor.assess(a.prompts, a.batch_step, req)
        return assessed, self._record(node_id, a, assessed)

    def _record(self, node_id: str, a: AssignmentRow, assessed: Assessed) -> bool:
        """reputation → one ledger transaction (thread-safe: the ledger has its lock). Returns whether the node
        is now banned."""
        accepted = {g.prompt_id for g in assessed.groups}
        requeue = [p for p in a.prompts if p.prompt_id not in accepted]
        vc = self.cfg.verification
        delta = -vc.reputation_penalty if assessed.cheated else vc.reputation_reward
        return self.ledger.record_submission(a.assignment_id, node_id, list(assessed.groups), list(assessed.rejections),
                                             requeue, reputation_delta=delta, reputation_cap=vc.reputation_start,
                                             ban_below=vc.ban_below)
