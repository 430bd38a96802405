"""Run a trio service in its own thread and call into it from asyncio.

py-libp2p is trio-only; the rest of prime-node is asyncio/aiohttp. `TrioBridge` owns one thread
running one `trio.run`, in which:

    root nursery
    ├── the service  (e.g. the libp2p host), started with `nursery.start`, told to stop by an event
    └── jobs nursery (every coroutine submitted with `call`, each in its own cancel scope)

Every task has an owner and a way to stop: `stop()` cancels the jobs first (their asyncio callers
get `P2PNotRunning`), then sets the service's stop event and gives it `grace_s` to shut down
cleanly before cancelling it, and finally joins the thread. Cancelling the asyncio side of a `call`
cancels its trio task. Crossing threads uses only the thread-safe doors of each loop:
`TrioToken.run_sync_soon` into trio, `loop.call_soon_threadsafe` back into asyncio; neither blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .errors import P2PError, P2PNotRunning

if TYPE_CHECKING:
    import trio

log = logging.getLogger(__name__)


class _Job:
    __slots__ = ("fn", "args", "fut", "loop", "scope", "cancel_requested")

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple, fut: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.fn, self.args, self.fut, self.loop = fn, args, fut, loop
        self.scope: trio.CancelScope | None = None  # created on the trio thread
        self.cancel_requested = False


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, *, result: Any = None,
          exc: BaseException | None = None) -> None:
    """Resolve an asyncio future from the trio thread (no-op if its loop has gone)."""

    def resolve() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # loop closed: nobody is waiting any more
        pass


def unwrap(error: BaseException) -> BaseException:
    """trio wraps errors in (nested) exception groups; callers want the one real error."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


class TrioBridge:
    def __init__(self, name: str = "p2p", *, grace_s: float = 5.0):
        self.name = name
        self.grace_s = grace_s
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop_event: trio.Event | None = None  # created on the trio thread
        self._jobs: trio.Nursery | None = None  # for submitted calls
        self._started: asyncio.Future | None = None
        self._finished: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self._jobs is not None

    async def start(self, service: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start the thread and `service(stop_event, *args, task_status=...)`; return what it passes to
        `task_status.started()`. A service that fails before that raises here."""
        if self._thread is not None:
            raise P2PError("this p2p bridge was already started")
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._finished = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(service, args),
                                        name=f"prime-node-{self.name}-trio", daemon=True)
        self._thread.start()
        try:
            return await asyncio.shield(self._started)
        except BaseException:
            await self.stop()
            raise

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `await fn(*args)` on the trio thread and return its result here."""
        token = self._token
        if token is None or self._jobs is None:
            raise P2PNotRunning(f"p2p node {self.name} is not running")
        import trio

        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), loop)
        try:
            token.run_sync_soon(self._spawn, job)
        except trio.RunFinishedError:
            raise P2PNotRunning(f"p2p node {self.name} has stopped") from None
        job.fut.add_done_callback(lambda f: self._request_cancel(token, job) if f.cancelled() else None)
        return await job.fut

    def _request_cancel(self, token, job: _Job) -> None:
        import trio

        def cancel() -> None:
            job.cancel_requested = True
            if job.scope is not None:
                job.scope.cancel()

        try:
            token.run_sync_soon(cancel)
        except trio.RunFinishedError:
            pass

    async def stop(self) -> None:
        """Stop the service and every job, and join the thread. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        token = self._token
        if token is not None:
            import trio

            try:
                token.run_sync_soon(self._begin_stop)
            except trio.RunFinishedError:
                pass
        assert self._finished is not None
        try:
            # The trio side cancels the service after grace_s; this only guards a wedged thread.
            await asyncio.wait_for(asyncio.shield(self._finished), self.grace_s + 10)
        except asyncio.TimeoutError:
            log.error("p2p thread %s did not stop within %.0f s", thread.name, self.grace_s + 10)
        thread.join(timeout=1.0)

    # --- trio thread ---------------------------------------------------------------------------
    def _begin_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    def _spawn(self, job: _Job) -> None:
        if self._jobs is None:
            _post(job.loop, job.fut, exc=P2PNotRunning(f"p2p node {self.name} has stopped"))
            return
        self._jobs.start_soon(self._run_job, job)

    async def _run_job(self, job: _Job) -> None:
        import trio

        scope = job.scope = trio.CancelScope()
        if job.cancel_requested:
            scope.cancel()
        try:
            with scope:
                result = await job.fn(*job.args)
        except trio.Cancelled:
            _post(job.loop, job.fut, exc=P2PNotRunning(f"p2p node {self.name} stopped during the call"))
            raise
        except Exception as e:  # handed to the caller, who owns the error
            error = unwrap(e)
            _post(job.loop, job.fut, exc=error if isinstance(error, Exception) else P2PError(repr(error)))
            return
        if not scope.cancelled_caught:
            _post(job.loop, job.fut, result=result)

    async def _main(self, service: Callable[..., Awaitable[Any]], args: tuple) -> None:
        import trio

        assert self._loop is not None and self._started is not None  # set by start() before the thread
        self._token = trio.lowlevel.current_trio_token()
        stop_event = self._stop_event = trio.Event()
        async with trio.open_nursery() as root:
            value = await root.start(service, stop_event, *args)
            async with trio.open_nursery() as jobs:
                self._jobs = jobs
                _post(self._loop, self._started, result=value)
                await stop_event.wait()
                self._jobs = None
                jobs.cancel_scope.cancel()
            # The service saw the stop event too; give it grace_s to close connections cleanly.
            root.cancel_scope.deadline = trio.current_time() + self.grace_s

    def _thread_main(self, service: Callable[..., Awaitable[Any]], args: tuple) -> None:
        import trio

        error: BaseException | None = None
        try:
            trio.run(self._main, service, args)
        except BaseException as e:  # reported to whoever awaits start(); logged otherwise
            error = e
            if self._started is not None and self._started.done():
                log.error("p2p service %s crashed: %r", self.name, e, exc_info=e)
        finally:
            self._jobs = None
            self._token = None
            assert self._loop is not None and self._started is not None and self._finished is not None
            if error is not None:
                error = unwrap(error)
                _post(self._loop, self._started, exc=error if isinstance(error, Exception) else P2PError(repr(error)))
            else:
                _post(self._loop, self._started, exc=P2PNotRunning(f"p2p node {self.name} stopped before it started"))
            _post(self._loop, self._finished, result=None)
