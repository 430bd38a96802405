"""The verifier pool's job board: replays the verdict queue hands to trusted verifier processes.

A job is the chosen rollouts of one submission. A verifier (`prime-node verifier`, its key listed in
`verification.verifier_keys`) leases the oldest job nobody holds, or one whose lease ran out (its verifier
died or is too slow: the job is handed out again), replays it against the claimed step's weights and
answers with one verdict per rollout. The verdict queue awaits the job; the board does no ledger work
and no IO. Jobs live in memory: a submission whose job was lost in a crash is still undecided in the
ledger and is queued again at the next start.

A verifier that cannot get the step (it answers `unavailable`) never decides anything: the job goes to
another active verifier that has not refused it, and after `refusals` verifiers refused it (or when no
other verifier is there to take it within a lease) the board gives it back and the verdict queue
replays it itself (in-process, or in the engine process). Which step a node claims therefore never decides whether it is replayed. Each
verifier's `unavailable` answers are counted (bounded: one counter per listed key) and logged.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from node.coordinator.ledger import now_ms
from node.coordinator.refusals import Refused
from protocol import messages as M

log = logging.getLogger("prime_node.verifier_jobs")

# a verifier that asked for work this recently counts as active (and can take a job another one refused)
ACTIVE_MS = 30_000


@dataclass(frozen=True)
class PoolSnapshot:
    """The verifier pool: listed keys, those that asked for work in the last 30 s, jobs waiting and leased,
    `unavailable` answers per verifier (key prefix) and jobs none could do (replayed by the coordinator itself:
    in-process, or in its engine process with `server.engine_process`; the field keeps its name)."""

    verifiers: int
    active: int
    jobs_waiting: int
    jobs_leased: int
    unavailable: dict[str, int]
    replayed_in_process: int


@dataclass
class Job:
    job_id: str
    step: int
    sampling: M.Sampling
    items: list[M.ReplayItem]
    future: asyncio.Future = field(repr=False)
    leased_by: str | None = None
    lease_until_ms: int = 0
    refused_by: set[str] = field(default_factory=set)  # verifiers that answered `unavailable`: never again

    def wire(self) -> M.VerifyJob:
        return M.VerifyJob(job_id=self.job_id, policy_step=self.step, sampling=self.sampling,
                           lease_ms=self.lease_until_ms, items=self.items)


class JobBoard:
    def __init__(self, verifier_keys: list[str], lease_seconds: float, *, refusals: int = 2, metrics=None,
                 clock: Callable[[], int] = now_ms):
        self.keys = frozenset(verifier_keys)
        self.lease_ms = int(lease_seconds * 1000)
        self.refusals = refusals  # `unavailable` answers on one job before the coordinator replays it itself
        self.metrics = metrics
        self.clock = clock
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)  # job ids of one coordinator process never repeat another's
        self.last_seen: dict[str, int] = {}  # verifier key -> when it last asked for work (ms)
        self.unavailable: Counter[str] = Counter()  # verifier key -> `unavailable` answers (keys are listed: bounded)
        self.answered: Counter[str] = Counter()  # verifier key -> answers of any kind
        self.given_back = 0  # jobs no verifier could do: replayed by the coordinator (in-process or its engine)

    def check_verifier(self, key: str) -> None:
        if key not in self.keys:
            raise Refused("not_a_verifier", "this key is not in the run's verification.verifier_keys")
        self.last_seen[key] = self.clock()

    async def replay(self, step: int, items: list[M.ReplayItem], sampling: M.Sampling) -> list[M.ReplayVerdict] | None:
        """One verdict per item, from whichever verifier answers; None if no verifier could get the step's
        weights (`refusals` of them answered `unavailable`, or none other was there): the caller replays it."""
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
            if job.future.done() or (job.leased_by is not None and job.lease_until_ms > now) or key in job.refused_by:
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
            raise Refused("unknown_job", "no open job has this id (decided, or from before a restart)")
        if job.leased_by != key:
            raise Refused("not_your_job", "this job's lease is held by another verifier (yours ran out)")
        if not req.unavailable and len(req.verdicts) != len(job.items):
            raise Refused("wrong_verdict_count",
                          f"the job has {len(job.items)} rollouts; {len(req.verdicts)} verdicts were sent")
        self.answered[key] += 1
        if req.unavailable:
            self._refused(key, job)
        else:
            job.future.set_result(list(req.verdicts))

    def _refused(self, key: str, job: Job) -> None:
        """`key` cannot get the job's step: hand the job to another verifier, or give it back for an
        in-process replay once `refusals` verifiers refused it or no other one is active."""
        self.unavailable[key] += 1
        log.warning("verifier %s answered unavailable for step %d (%d of its %d answers)", key[:16], job.step,
                    self.unavailable[key], self.answered[key])
        job.refused_by.add(key)
        job.leased_by, job.lease_until_ms = None, 0
        self._count()
        now = self.clock()
        others = [k for k, t in self.last_seen.items() if k not in job.refused_by and now - t < ACTIVE_MS]
        if len(job.refused_by) >= self.refusals or not others:
            self._give_back(job)
        else:  # bounded: if no other verifier takes it within a lease, the coordinator replays it
            asyncio.get_running_loop().call_later(self.lease_ms / 1000, self._unless_leased, job)

    def _unless_leased(self, job: Job) -> None:
        if job.future.done():
            return
        wait_ms = job.lease_until_ms - self.clock()
        if job.leased_by is not None and wait_ms > 0:  # another verifier is on it: look again when its lease ends
            asyncio.get_running_loop().call_later(wait_ms / 1000, self._unless_leased, job)
        else:
            self._give_back(job)

    def _give_back(self, job: Job) -> None:
        self.given_back += 1
        job.future.set_result(None)

    def snapshot(self) -> "PoolSnapshot":
        """The pool as /v1/status shows it."""
        waiting, leased = self.pending()
        now = self.clock()
        return PoolSnapshot(verifiers=len(self.keys), active=sum(1 for ms in self.last_seen.values() if now - ms < ACTIVE_MS),
                            jobs_waiting=waiting, jobs_leased=leased,
                            unavailable={k[:16]: n for k, n in self.unavailable.items()},
                            replayed_in_process=self.given_back)

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
