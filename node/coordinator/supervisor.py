"""Ownership of the coordinator's background work: every task and thread it starts is registered here
by name, and the first one that dies marks the whole coordinator failed.

Why: the training thread, the assignment-expiry loop and the verdict queue each keep the run going;
when one of them is gone the coordinator can still answer HTTP, but work it hands out can never be
trained, expired or decided. Dying quietly (a WARNING, or a string in the status document) left nodes
generating for nothing. So a death is loud and final:

- `failure` is set once (the first death wins: later ones are usually its consequences) and `failed`
  (an asyncio.Event) is set, which the coordinator's main loop awaits to exit non-zero
  (`server.exit_on_failure`);
- the HTTP app answers 503 with the reason to every node and verifier request (app.py), and status,
  the dashboard and /metrics (`prime_coordinator_failed{component=...}`) show it.

What counts as a death: a critical task that raises, or returns, while the coordinator is not stopping;
a thread that raises, or returns, while the coordinator is not stopping. Cancelling at stop() is not a
death. Non-critical tasks (a p2p announcement, say) are owned too -- cancelled at stop -- but their
failure is only logged.

Threads are daemon threads: one stuck for good (a trainer rank that never answers) cannot keep the
process alive after stop() gave up waiting for it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("prime_node.coordinator")

MAX_REASON_CHARS = 500  # the reason goes into every 503 body and the status document: keep it short


@dataclass(frozen=True)
class Failure:
    component: str
    reason: str
    at_ms: int

    def as_json(self) -> dict:
        return {"component": self.component, "reason": self.reason, "at_ms": self.at_ms}


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]


class Supervisor:
    """Owns named asyncio tasks and threads. Create it before the event loop runs or on it; `bind()`
    on the loop before spawning. `fail()` may be called from any thread."""

    def __init__(self, on_failure: Callable[[Failure], None] | None = None):
        self.failure: Failure | None = None
        self.stopping = False
        self._on_failure = on_failure  # called once, on the loop (metrics, say)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._failed = asyncio.Event()
        if self.failure is not None:  # a thread died before the loop was known
            self._failed.set()

    async def wait_failed(self) -> Failure:
        """Returns the failure once a component has died (never returns on a healthy coordinator)."""
        assert self._failed is not None, "bind() first"
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    # -- registering work ----------------------------------------------------------------------------
    def spawn(self, coro, name: str, *, critical: bool = True) -> asyncio.Task:
        """A task owned by the supervisor: cancelled by stop(); a critical one that ends by itself
        (an exception, or a return) fails the coordinator, a non-critical one's exception is logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if not critical:
                if exc is not None:
                    log.warning("%s failed: %s", name, describe(exc))
                return
            if exc is not None:
                log.error("%s died", name, exc_info=exc)
                self.fail(name, describe(exc))
            elif not self.stopping:
                self.fail(name, "exited unexpectedly")

        task.add_done_callback(done)
        return task

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A daemon thread running `target`: an exception, or a return while not stopping, fails the
        coordinator."""
        def run() -> None:
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - every way out of the thread is reported
                if self.stopping:  # cut by stop() (a trainer's ranks killed under a step): expected
                    log.info("thread %s ended while stopping: %s", name, describe(e))
                else:
                    log.error("thread %s died", name, exc_info=e)
                    self.fail(name, describe(e))
                return
            if not self.stopping:
                self.fail(name, "exited unexpectedly")

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    # -- failure -------------------------------------------------------------------------------------
    def fail(self, component: str, reason: str) -> None:
        """Mark the coordinator failed (the first call wins). Safe from any thread."""
        with self._lock:
            if self.failure is not None or self.stopping:
                return
            self.failure = Failure(component, reason[:MAX_REASON_CHARS], int(time.time() * 1000))
        log.error("coordinator failed: %s died (%s); no more work is handed out", component, reason)
        loop = self._loop
        if loop is None:
            return
        if _on_loop(loop):
            self._signal()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._signal)

    def _signal(self) -> None:
        if self._failed is not None:
            self._failed.set()
        if self._on_failure is not None and self.failure is not None:  # set before it is signalled
            self._on_failure(self.failure)

    # -- stop ----------------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Stop owning: cancel every task and wait for them. Threads are stopped by their owners (their
        exit from now on is expected)."""
        self.stopping = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
