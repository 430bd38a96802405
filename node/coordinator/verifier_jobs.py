"""The verifier pool's job board: replays the verdict queue hands to trusted verifier processes.

A job is the chosen rollouts of one submission. A verifier (`prime-node verifier`, its key listed in
`verification.verifier_keys`) leases the oldest job nobody holds, or one whose lease ran out (its verifier
died or is too slow: the job is handed out again), replays it against the claimed step's weights and
answers with one verdict per rollout. The verdict queue awaits the job; the board does no ledger work
and no IO. Jobs live in memory: a submission whose job was lost in a crash is still undecided in the
ledger and is queued again at the next start.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from node.coordinator.ledger import now_ms
from node.http import ApiError
from protocol import messages as M


@dataclass
class Job:
    job_id: str
    step: int
    sampling: M.Sampling
    items: list[M.ReplayItem]
    future: asyncio.Future = field(repr=False)
    leased_by: str | None = None
    lease_until_ms: int = 0

    def wire(self) -> M.VerifyJob:
        return M.VerifyJob(job_id=self.job_id, policy_step=self.step, sampling=self.sampling,
                           lease_ms=self.lease_until_ms, items=self.items)


class JobBoard:
    def __init__(self, verifier_keys: list[str], lease_seconds: float, *, metrics=None,
                 clock: Callable[[], int] = now_ms):
        self.keys = frozenset(verifier_keys)
        self.lease_ms = int(lease_seconds * 1000)
        self.metrics = metrics
        self.clock = clock
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)  # job ids of one coordinator process never repeat another's
        self.last_seen: dict[str, int] = {}  # verifier key -> when it last asked for work (ms)

    def check_verifier(self, key: str) -> None:
        if key not in self.keys:
            raise ApiError(403, "not_a_verifier", "this key is not in the run's verification.verifier_keys")
        self.last_seen[key] = self.clock()

    async def replay(self, step: int, items: list[M.ReplayItem], sampling: M.Sampling) -> list[M.ReplayVerdict] | None:
        """One verdict per item, from whichever verifier answers; None if a verifier could not get the
        step's weights (it fell out of the window): the caller passes the submission over."""
        job = Job(f"{self._prefix}-{next(self._ids)}", step, sampling, items,
                  asyncio.get_running_loop().create_future())
        self._jobs[job.job_id] = job
        self._count()
        try:
            return await job.future
        finally:
            self._jobs.pop(job.job_id, None)
            self._count()

    def lease(self, key: str) -> Job | None:
        """The oldest job nobody holds, or whose lease ran out; None when there is none."""
        now = self.clock()
        for job in self._jobs.values():
            if job.future.done() or (job.leased_by is not None and job.lease_until_ms > now):
                continue
            if job.leased_by is not None and self.metrics is not None:
                self.metrics.verify_jobs_rehanded.inc()
            job.leased_by, job.lease_until_ms = key, now + self.lease_ms
            self._count()
            return job
        return None

    def complete(self, key: str, req: M.VerdictsRequest) -> None:
        job = self._jobs.get(req.job_id)
        if job is None or job.future.done():
            raise ApiError(404, "unknown_job", "no open job has this id (decided, or from before a restart)")
        if job.leased_by != key:
            raise ApiError(409, "not_your_job", "this job's lease is held by another verifier (yours ran out)")
        if not req.unavailable and len(req.verdicts) != len(job.items):
            raise ApiError(400, "wrong_verdict_count",
                           f"the job has {len(job.items)} rollouts; {len(req.verdicts)} verdicts were sent")
        job.future.set_result(None if req.unavailable else list(req.verdicts))

    def pending(self) -> tuple[int, int]:
        """(jobs waiting for a verifier, jobs leased now)."""
        now = self.clock()
        leased = sum(1 for j in self._jobs.values() if j.leased_by is not None and j.lease_until_ms > now)
        return len(self._jobs) - leased, leased

    def _count(self) -> None:
        if self.metrics is not None:
            waiting, leased = self.pending()
            self.metrics.verify_jobs.labels("waiting").set(waiting)
            self.metrics.verify_jobs.labels("leased").set(leased)
