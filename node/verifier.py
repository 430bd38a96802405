"""`prime-node verifier --coordinator URL --key KEYFILE`: a trusted process of the coordinator's verifier pool.

It does what the coordinator does in-process when no pool is configured: replay chosen submissions
against the claimed step's weights (verify.rollouts.judge) and answer with one verdict per rollout. Its
key must be listed in the run's `verification.verifier_keys`. Jobs come over the signed API
(POST /v1/verify/jobs, POST /v1/verify/verdicts; docs/PROTOCOL.md, "HTTP API"); checkpoints come with the worker's own
fetcher, which verifies every shard against the coordinator-signed manifest, holding every step of the
async window (not only the newest: a jump to a newest full checkpoint would skip the steps before it)
plus one. A job for a step it cannot get (older than that, or not arrived within STEP_WAIT_S) is answered
`unavailable`; the coordinator then gives the job to another verifier or replays it itself (never passes
it over).
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from node.aio import client_session, sleep_or_stop, wait_any
from node.backoff import Backoff
from node.checkpoint_dir import CheckpointDir
from node.config import load_config
from node.lifecycle import run_async
from node.logs import setup_logging
from node.worker.backends import start_backend
from node.worker.client import CoordinatorClient, CoordinatorError, Unreachable
from node.worker.fetcher import Fetcher
from node.worker.sources import HttpSource
from protocol import messages as M
from protocol.errors import PrimeNodeError
from protocol.identity import Identity, public_key_arg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from node.worker.backends.transformers_backend import TransformersBackend

log = logging.getLogger("prime_node.verifier")

STEP_WAIT_S = 30.0  # how long a job waits for its step to arrive before it is answered `unavailable`


class VerifierRefused(PrimeNodeError):
    pass


class Verifier:
    def __init__(self, url: str, identity: Identity, root: Path, *, coordinator_key: str | None = None):
        self.url = url.rstrip("/")
        self.identity = identity
        self.root = Path(root)
        self.coordinator_key = coordinator_key
        self.stop_event = asyncio.Event()
        self.spec: M.VerifierSpec | None = None
        self.payloads: dict[int, Path] = {}  # step -> verified payload, as the fetcher commits them
        self._arrived = asyncio.Event()
        self._backends: dict[int, TransformersBackend] = {}  # step -> fp32 backend with that step's weights
        self._spare: list[TransformersBackend] = []  # backends of steps that left the window, reused next
        self._loading: set[int] = set()  # steps whose payload a backend is reading: the fetcher keeps them
        self.jobs_done = 0
        self.rollouts_judged = 0

    def stop(self) -> None:
        self.stop_event.set()

    async def run(self) -> None:
        async with client_session() as session:
            client = CoordinatorClient(self.url, self.identity, session)
            self.spec = spec = await self._spec(client)
            if self.coordinator_key and spec.coordinator_key != self.coordinator_key:
                raise VerifierRefused(f"the coordinator signs with {spec.coordinator_key[:16]}…, not the "
                                      f"--coordinator-key given ({self.coordinator_key[:16]}…)")
            model_dir = self.root / "model"
            model_dir.mkdir(parents=True, exist_ok=True)
            (model_dir / "config.json").write_text(json.dumps(spec.model_config_json))
            self.model_dir = model_dir
            sources = [HttpSource(self.url, "coordinator", session)] + \
                [HttpSource(r, "relay", session) for r in spec.relays]
            self.fetcher = Fetcher(CheckpointDir(self.root / "checkpoints"), sources, spec.coordinator_key,
                                   keep=spec.async_level + 2, window=spec.async_level,
                                   on_new_step=self._on_new_step, in_use=lambda: self._loading)
            log.info("verifier %s serving run %s at %s", self.identity.node_id[:12], spec.run_id, self.url)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.fetcher.run(self.stop_event, poll_seconds=0.25))
                tg.create_task(self._jobs(client))

    async def _spec(self, client: CoordinatorClient) -> M.VerifierSpec:
        backoff = Backoff(0.5, 10.0)
        while True:
            try:
                answer = await client.verify_jobs(spec=True)
            except Unreachable as e:
                log.warning("%s; retrying", e)
                await asyncio.sleep(backoff.next())
                continue
            except CoordinatorError as e:
                raise VerifierRefused(f"{self.url} refused this verifier: {e.code}: {e.detail}") from None
            if answer is None or answer.spec is None:
                raise VerifierRefused(f"{self.url} sent no run facts to this verifier")
            return answer.spec

    @property
    def _run_spec(self) -> M.VerifierSpec:
        """The run's facts: run() has them before the fetcher or the job loop starts."""
        assert self.spec is not None
        return self.spec

    def _on_new_step(self, step: int, payload: Path) -> None:
        self.payloads[step] = payload  # steps of the window may arrive below the newest (filled in)
        newest = max(self.payloads)
        for old in [s for s in self.payloads if s < newest - self._run_spec.async_level - 1]:
            self.payloads.pop(old, None)
            if (b := self._backends.pop(old, None)) is not None and not self._spare:
                self._spare.append(b)
        self._arrived.set()
        self._arrived.clear()

    async def _jobs(self, client: CoordinatorClient) -> None:
        idle = Backoff(0.05, 1.0)
        while not self.stop_event.is_set():
            try:
                answer = await client.verify_jobs()
                if answer is None or answer.job is None:
                    await sleep_or_stop(self.stop_event, idle.next())
                    continue
                idle.reset()
                await client.verify_verdicts(await self._judge(answer.job))
            except Unreachable as e:
                log.warning("%s; retrying", e)
                await sleep_or_stop(self.stop_event, idle.next())
            except CoordinatorError as e:
                if e.status == 403:
                    raise VerifierRefused(f"{self.url} refused this verifier: {e.code}: {e.detail}") from None
                log.warning("coordinator said %s", e)  # e.g. not_your_job: the lease ran out meanwhile
                await sleep_or_stop(self.stop_event, idle.next())

    async def _judge(self, job: M.VerifyJob) -> M.VerdictsRequest:
        model = await self._model_for(job.policy_step)
        if model is None:
            log.warning("job %s: step %d is not held (held %s); answered unavailable", job.job_id, job.policy_step,
                        sorted(self.payloads))
            return M.VerdictsRequest(job_id=job.job_id, unavailable=True)
        from verify.rollouts import RolloutClaim, VerifyItem, judge

        s = job.sampling
        items = [VerifyItem(list(i.prompt_ids), RolloutClaim(list(i.completion_ids), list(i.logprobs), i.finish_reason,
                                                              i.commitment),
                            i.seed, s.temperature, s.top_p, s.max_tokens, self._run_spec.eos_token_id)
                 for i in job.items]
        # claimed=False: no "rollout failed" line per rollout; a job does not say whether `policy_step` is the step
        # the rollouts claim or the one before it (the coordinator's stale-step audit, where failing is expected)
        judgements = await asyncio.to_thread(lambda: judge(model, items, claimed=False))
        self.jobs_done += 1
        self.rollouts_judged += len(items)
        return M.VerdictsRequest(job_id=job.job_id, verdicts=[
            M.ReplayVerdict(reason=j.reason, tokens=j.tokens, near_ties=j.near_ties, outlier=j.outlier,
                            fit=j.fit)
            for j in judgements])

    async def _model_for(self, step: int) -> PreTrainedModel | None:
        """The model of `step`, waiting (bounded) for the fetcher to bring it; None if it will not come."""
        deadline = time.monotonic() + STEP_WAIT_S
        while step not in self.payloads:
            newest = self.fetcher.newest_held  # the fetcher holds every step down to newest - k - 1
            if (newest >= 0 and step < newest - self._run_spec.async_level - 1) or time.monotonic() > deadline \
                    or self.stop_event.is_set():
                return None
            self.fetcher.wake.set()
            await wait_any(self._arrived, self.stop_event, timeout=0.5)
        if step not in self._backends:
            payload = self.payloads[step]
            if not payload.is_file():
                return None
            self._loading.add(step)
            try:
                self._backends[step] = await asyncio.to_thread(self._load, step, payload)
            finally:
                self._loading.discard(step)
        return self._backends[step].model

    def _load(self, step: int, payload: Path) -> TransformersBackend:
        """A backend holding `step`'s weights: a spare one reloaded, else a copy of one held (no model built
        from its config again), else the first one built."""
        if self._spare or self._backends:
            backend = self._spare.pop() if self._spare else copy.deepcopy(next(iter(self._backends.values())))
            backend.load_payload(payload, step)
            return backend
        return cast("TransformersBackend",  # what start_backend("transformers") builds
                    start_backend("transformers", self.model_dir, payload, step, dtype="float32", device="cpu"))


def cmd_verifier(args) -> int:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.server.log_format)
    coordinator_key = public_key_arg("--coordinator-key", args.coordinator_key) if args.coordinator_key else None
    identity = Identity.load(args.key)
    verifier = Verifier(args.coordinator, identity, Path(args.dir), coordinator_key=coordinator_key)

    refused: list[BaseException] = []
    try:
        run_async("verifier", verifier.run, verifier.stop)
    except* VerifierRefused as eg:  # raised in the task group: one line, exit 1
        refused = list(eg.exceptions)
    if refused:
        print(f"prime-node verifier: {refused[0]}", file=sys.stderr)
        return 1
    return 0
