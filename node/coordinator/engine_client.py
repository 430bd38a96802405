"""The API process's side of the engine process (`server.engine_process = true`, node/coordinator/engine.py):
starts it, tells it to train and what to replay, and turns what it says into the calls the in-process
TrainingLoop makes (`on_step_published`, `on_groups_dropped`) and into the status's TrainerSnapshot.

Imports neither torch nor the trainer (tests/unit/test_engine_imports.py). The engine is started with
subprocess, never forked: a fork would copy this process's event loop, sockets and threads into it.

Death of either side: the engine's end of the channel closes when the API process dies (SIGKILL included),
and the engine stops (node/coordinator/engine.py). When the engine dies, `serve()` raises: it is a critical
task of the coordinator's Supervisor, which fails the coordinator (503 to nodes, the reason on status and
/metrics) and, with server.exit_on_failure, makes the process exit 1.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from node.config import Config
from node.coordinator import engine_channel as C
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.status import TrainerSnapshot
from node.coordinator.verification import Judged
from protocol.identity import Identity

log = logging.getLogger("prime_node.coordinator")

KILL_AFTER_S = 5.0  # past the engine's own stop deadline (server.stop_timeout_s), it is killed


class EngineDied(RuntimeError):
    pass


class EngineProcess:
    """What Coordinator needs of its trainer, served by the engine process: `published_step`, `snapshot()`,
    `notify_decided()`, `verify()` and `holds()` (the VerdictQueue's replays), start and stop."""

    def __init__(self, *, cfg: Config, identity: Identity, metrics: CoordinatorMetrics,
                 on_groups_dropped: Callable[[dict[int, int], float], None],
                 on_step_published: Callable[[int, dict[int, int]], None],
                 on_failed: Callable[[str, str], None]):
        self.cfg, self.identity, self.metrics = cfg, identity, metrics
        self.on_failed = on_failed  # (component, reason): what died in the engine, before the process ends
        self.on_groups_dropped = on_groups_dropped
        self.on_step_published = on_step_published
        self.published_step = 0
        self.held: frozenset[int] = frozenset()  # steps whose weights the engine holds for replays
        self.error: str | None = None  # why the engine died, if it did
        self._snapshot = TrainerSnapshot(busy=False, busy_seconds=0.0, idle_seconds=0.0, error=None,
                                         last_metrics={}, batch_health={}, eval_curve=None)
        self.proc: subprocess.Popen | None = None
        self._chan: C.AsyncChannel | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[C.Verdicts]] = {}
        self._stopping = False
        self._counted: dict[str, int] = {"usable": 0}  # batch health's run totals already added to the counters
        metrics.trainer_busy.set_function(lambda: self._snapshot.busy_seconds)
        metrics.trainer_idle.set_function(lambda: self._snapshot.idle_seconds)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self) -> TrainerSnapshot:
        return self._snapshot

    # -- life ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine and wait until it restored the run from the ledger (or published θ_0): then
        `published_step` is the ledger's newest step. Raises EngineDied if it dies first. Cancelled (a stop
        asked while it starts: node/coordinator/main.py), it kills the engine: it ignores signals, reads its
        channel only once ready, and a restore cut short is redone at the next start (the ledger's crash
        safety, as for a SIGKILL)."""
        try:
            await self._start()
        except asyncio.CancelledError:
            if self.proc is not None and self.proc.poll() is None:
                log.info("stop asked while the engine process %d was starting: killing it", self.proc.pid)
                self.proc.kill()
                self.proc.wait()
            if self._chan is not None:
                self._chan.close()
                self._chan = None
            raise

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        storage = str(Path(self.cfg.storage.dir).resolve())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node.coordinator.engine", "--fd", str(theirs.fileno()), "--storage", storage],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()  # the engine's copy is its own: ours must not keep its end open
        self._chan = await C.AsyncChannel.open(ours, C.FROM_ENGINE)
        await self._chan.send(C.Init(config_json=self.cfg.model_dump_json(),
                                     key_hex=self.identity.private_bytes_raw().hex()))
        msg = await self._chan.recv()
        while isinstance(msg, C.Snapshot):  # the restored trainer's, sent just before Ready (engine.py)
            self._apply(msg)
            msg = await self._chan.recv()
        if not isinstance(msg, C.Ready):
            code = await self._exit_code()
            if code is None:  # alive but saying something else: not an engine this process can drive
                self.proc.kill()
            why = f"{msg.component}: {msg.reason}" if isinstance(msg, C.Failed) else \
                f"exit code {code}" if msg is None else f"it sent {msg.kind!r} first"
            raise EngineDied(f"the engine process did not start ({why})")
        self.published_step = msg.published_step
        self.held = frozenset(msg.held)
        log.info("engine process %d ready at step %d", self.proc.pid, msg.published_step)

    async def begin(self) -> None:
        """Train (after the scheduler was restored at `published_step`)."""
        assert self._chan is not None, "start() first"
        await self._chan.send(C.Start())

    async def serve(self) -> None:
        """Apply what the engine says until it ends; its end while not stopping raises (the supervisor's
        critical task: the coordinator fails)."""
        assert self._chan is not None, "start() first"
        try:
            while True:
                msg = await self._chan.recv()
                if msg is None:
                    break
                self._apply(msg)
        finally:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(EngineDied("the engine process ended"))
            self._waiting.clear()
        if not self._stopping:
            code = await self._exit_code()
            self.error = self.error or f"the engine process ended (exit code {code})"
            raise EngineDied(self.error)

    def _apply(self, msg) -> None:
        if isinstance(msg, C.Published):
            self.published_step = msg.step
            self.held = frozenset(msg.held)
            self.on_step_published(msg.step, dict(msg.consumed))
        elif isinstance(msg, C.Dropped):
            self.on_groups_dropped(dict(msg.by_batch), msg.keep_rate)
        elif isinstance(msg, C.Snapshot):
            self._snapshot = TrainerSnapshot(busy=msg.busy, busy_seconds=msg.busy_seconds,
                                             idle_seconds=msg.idle_seconds, error=msg.error or self.error,
                                             last_metrics=dict(msg.last_metrics), batch_health=dict(msg.batch_health),
                                             eval_curve=None if msg.eval_curve is None else list(msg.eval_curve))
            self._health_metrics(msg.batch_health)
            if msg.eval_curve:
                self.metrics.eval_reward.set(msg.eval_curve[-1].get("reward", 0.0))
                self.metrics.eval_step.set(msg.eval_curve[-1].get("step", 0))
        elif isinstance(msg, C.Verdicts):
            fut = self._waiting.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, C.Failed):  # the same failure as in one process: the component and its reason
            self.error = f"{msg.component}: {msg.reason}"
            self.on_failed(msg.component, msg.reason)
            s = self._snapshot
            self._snapshot = TrainerSnapshot(s.busy, s.busy_seconds, s.idle_seconds, msg.reason, s.last_metrics,
                                             s.batch_health, s.eval_curve)
        else:  # Ready twice
            raise C.ChannelError(f"unexpected {msg.kind!r} message from the engine")

    def _health_metrics(self, h: dict) -> None:
        """The batch-health series that BatchHealth sets in one process (batch_health.py), from its snapshot:
        gauges set, counters advanced by what the engine counted since the last snapshot."""
        def count(x) -> int:
            return x if isinstance(x, int) and x >= 0 else 0
        m = self.metrics
        m.batch_needed.set(count(h.get("needed")))
        m.batch_usable.set(count(h.get("usable")))
        m.groups_unusable_in_a_row.set(count(h.get("unusable_in_a_row")))
        for reason, n in (h.get("unusable") or {}).items():
            m.batch_unusable.labels(str(reason)[:64]).set(count(n))
        usable = count(h.get("run_usable"))
        if usable > self._counted["usable"]:
            m.groups_usable.inc(usable - self._counted["usable"])
            self._counted["usable"] = usable
        for reason, n in (h.get("run_unusable") or {}).items():
            key, n = f"unusable:{str(reason)[:64]}", count(n)
            if n > self._counted.get(key, 0):
                m.groups_unusable.labels(str(reason)[:64]).inc(n - self._counted.get(key, 0))
                self._counted[key] = n

    async def _exit_code(self, wait_s: float = KILL_AFTER_S) -> int | None:
        """The engine's exit code, waiting up to `wait_s` for it (its end of the channel closes as it exits);
        None: still running. Polled: a thread blocked in wait() would hold up this process's own exit."""
        assert self.proc is not None
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.proc.poll()

    async def stop(self, timeout: float) -> None:
        """Stop: the engine finishes or cuts its step within `timeout` (server.stop_timeout_s) and exits;
        killed after a few more seconds (a step cut short is redone after a restart)."""
        self._stopping = True
        if self.proc is None:
            return
        if self._chan is not None:
            try:
                await self._chan.send(C.Stop())
            except (ConnectionError, RuntimeError):
                pass  # already gone
        if await self._exit_code(timeout + KILL_AFTER_S) is None:
            log.warning("the engine process did not stop within %.1f s; killing it", timeout + KILL_AFTER_S)
            self.proc.kill()
            await self._exit_code()
        if self._chan is not None:
            self._chan.close()

    # -- what the coordinator asks -------------------------------------------------------------------
    def notify_decided(self) -> None:
        """A verdict was recorded (on the loop): the trainer may have its batch now."""
        if self._chan is not None and self.running:
            self._chan.writer.write(C.frame(C.Decided()))  # a few bytes: no drain needed

    def holds(self, step: int) -> bool:
        """Whether the engine holds `step`'s weights (as of its last Ready/Published): VerdictQueue passes a
        submission over whose step it no longer holds, before a replay by the pool or by the engine."""
        return step in self.held

    async def verify(self, assignment_id: str, step: int, audit: bool = False) -> Judged | None:
        """VerdictQueue's replay of a submission, done by the engine (which holds the policies); None when
        it no longer holds `step`'s weights. `audit`: the stale-step audit's replay against the step before."""
        assert self._chan is not None, "start() first"
        if step not in self.held:
            return None
        rid = next(self._ids)
        fut: asyncio.Future[C.Verdicts] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        await self._chan.send(C.Verify(request_id=rid, assignment_id=assignment_id, step=step, audit=audit))
        answer = await fut
        if answer.error is not None:
            raise RuntimeError(f"the engine's replay failed: {answer.error}")
        if answer.refs is None:
            return None
        if len(answer.refs) != len(answer.verdicts):
            raise C.ChannelError(f"{len(answer.refs)} rollouts and {len(answer.verdicts)} verdicts")
        return [(p, i) for p, i in answer.refs], list(answer.verdicts)
