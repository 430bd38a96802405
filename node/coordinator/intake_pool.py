"""The intake's CPU in processes of its own (`server.intake_processes`, with `server.engine_process`).

Why: assessing a submission (triage, rewards, the groups' encoding: assess.Assessor) is ~23 ms of pure Python
per 1.4 MB submission. In a thread of the API process it holds the GIL that the event loop needs for every other
node's request; when a batch's submissions arrive together, the loop queues behind them. At 1,000 simulated
nodes (bench/load.py --gen 24-28) the submissions' own body reads took up to 370 ms of wall time for ~5 ms of
work, one GIL hand-off per chunk. Here the assessment runs in another interpreter with its own GIL; the API
process keeps the ledger commit (nothing is acknowledged before it, as before).

What crosses: the assignment's prompts (PromptSlot, our own dataclass), its batch step and the request's body as
the node sent it (bytes, already authenticated and validated by the API process: the worker validates it again);
back, an assess.Assessed (our dataclasses of strings and numbers). concurrent.futures pickles them; nothing a
node sent is ever unpickled, only bytes objects and what our own workers built.

Failure: a worker that dies (killed, out of memory) breaks the pool. The submission in flight, and any that
arrive until a new pool is up, get IntakePoolBroken, and intake.py assesses them in the API process instead:
nothing is lost, the next submission starts a new pool, and the error log names what happened. Workers ignore
SIGINT/SIGTERM (a terminal's Ctrl-C reaches the whole process group: the API process shuts them down after its
own stop) and die with the API process (PR_SET_PDEATHSIG), which node/lifecycle.py's forced exit also kills.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import signal
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import Config

if TYPE_CHECKING:
    from node.coordinator.assess import Assessed, Assessor
    from node.coordinator.scheduler import PromptSlot

log = logging.getLogger("prime_node.intake")


MAX_RESTARTS = 3


class IntakePoolBroken(Exception):
    """A worker died: this submission is assessed elsewhere (intake.py)."""


_assessor: Assessor | None = None  # in a worker process: built once by _init


def _init(config_json: str, storage: str) -> None:
    """A worker's start: the run's model and task, as the API process loaded them (node/coordinator/run_model.py)."""
    global _assessor
    from node.coordinator.assess import Assessor
    from node.coordinator.run_model import load_run_model
    from node.lifecycle import die_with_parent

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(sig=signal.SIGKILL)  # SIGTERM is ignored here
    cfg = Config.model_validate_json(config_json)
    _assessor = Assessor(cfg, load_run_model(cfg, Path(storage)))


def _assess(prompts: tuple[PromptSlot, ...], batch_step: int, body: bytes) -> Assessed:
    from protocol import messages as M

    assert _assessor is not None, "_init did not run"
    return _assessor.assess(prompts, batch_step, M.SubmitRequest.model_validate_json(body))


class IntakePool:
    """`processes` workers, started at the first submission (a coordinator that gets none starts none)."""

    def __init__(self, cfg: Config, storage: Path, processes: int):
        self._config_json = cfg.model_dump_json()
        self._storage = str(storage)
        self._processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.restarts = 0  # pools replaced after a worker died

    def _ensure(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the API process runs threads (p2p, the ledger's), which fork would copy mid-state
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._processes, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                initargs=(self._config_json, self._storage))
        return self._pool

    async def assess(self, prompts: tuple[PromptSlot, ...] | list[PromptSlot], batch_step: int,
                     body: bytes) -> Assessed:
        if self.restarts > MAX_RESTARTS:  # workers that die as they start (a model they cannot load): stop trying
            raise IntakePoolBroken(f"intake processes died {self.restarts} times; assessing in the API process")
        pool = self._ensure()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _assess, tuple(prompts), batch_step, body)
        except BrokenProcessPool as e:
            if self._pool is pool:  # the first to see it replaces it; the others only report
                self._pool = None
                self.restarts += 1
                pool.shutdown(wait=False, cancel_futures=True)
                then = ("the next submission starts new ones" if self.restarts <= MAX_RESTARTS
                        else "submissions are assessed in the API process from now on")
                log.error("an intake process died (%s); %s", e, then)
            raise IntakePoolBroken(f"an intake process died: {e}") from None

    def close(self) -> None:
        """Wait for the assessments in flight (each ~tens of ms), then end the workers."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
