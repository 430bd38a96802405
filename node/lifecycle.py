"""How every long-running `prime-node` process stops (docs/OPERATIONS.md, "Stopping").

- SIGTERM, SIGINT or SIGHUP starts the role's graceful stop and a deadline (STOP_GRACE_S).
- Still running at the deadline, a thread is stuck (a collective that a trainer rank will never answer,
  a read from a peer that never writes): the stacks of every thread go to stderr (faulthandler), every
  process this one started (trainer ranks, inference engines; found in /proc) is SIGKILLed, and the
  process exits 128 + signal number with os._exit. The coordinator's ledger is sqlite in WAL mode with a
  commit per transaction, so what was committed is on disk and the file re-opens; a transaction cut off
  is rolled back when it is next opened.
- A second signal does the same at once.
- A process started by `prime-node demo` gets SIGTERM when the demo dies, however it dies (Linux
  PR_SET_PDEATHSIG, asked for through DIE_WITH_ENV).

Signals are read by a thread of their own from the `signal` module's wakeup fd (written by the C-level
handler the moment a signal comes), not by a Python handler: a Python handler runs only when the main
thread runs Python code, and the main thread may be the stuck one. So nothing else in the process may
call `loop.add_signal_handler` or `signal.set_wakeup_fd`: either would take the wakeup fd away.
"""
from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable

STOP_GRACE_S = 10.0  # from the first signal to the forced exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
DIE_WITH_ENV = "PRIME_NODE_DIE_WITH"  # a parent's pid: get SIGTERM when it dies (set by the demo)
_PR_SET_PDEATHSIG = 1


def _say(line: str) -> None:
    """One line on stderr without taking any lock a stuck thread might hold (logging's, sys.stderr's)."""
    try:
        os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
    except OSError:
        pass


def descendant_pids(root: int | None = None) -> list[int]:
    """Every live process under `root` (default: this one), from the parent pids in /proc/*/stat;
    children before their own children. Empty where there is no /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for d in entries:
        if not d.isdigit():
            continue
        try:
            raw = open(f"/proc/{d}/stat", "rb").read().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(d))
    out, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(0), [])
        out += kids
        frontier += kids
    return out


def kill_descendants() -> None:
    """SIGKILL every process this one started, theirs too (SIGKILL also ends a SIGSTOPped one)."""
    for pid in descendant_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def force_exit(code: int) -> None:
    kill_descendants()
    os._exit(code)


class Stopper:
    """The signal handling of one process: the first stop signal calls the `on_stop` callbacks (from the
    signal thread: they must only hand the stop to the role, e.g. loop.call_soon_threadsafe) and arms the
    deadline; the deadline or a second signal force the exit (module docstring)."""

    def __init__(self, role: str, grace_s: float = STOP_GRACE_S):
        self.role = role
        self.grace_s = grace_s
        self.signum: int | None = None  # the first stop signal, once one came
        self._callbacks: list[Callable[[int], object]] = []
        self._lock = threading.Lock()

    def install(self) -> "Stopper":
        """From the main thread, before the role starts threads or child processes."""
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C handler must never block; a full pipe drops bytes, not signals we need
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)  # first: a signal between the two is not lost
        for s in STOP_SIGNALS:
            signal.signal(s, _noop)  # a Python-level handler, so the C handler writes the wakeup fd
        threading.Thread(target=self._read, args=(r,), name="stop-signals", daemon=True).start()
        return self

    def on_stop(self, fn: Callable[[int], object]) -> None:
        """Call fn(signum) at the first stop signal; at once if it already came."""
        with self._lock:
            self._callbacks.append(fn)
            came = self.signum
        if came is not None:
            self._call(fn, came)

    def _read(self, fd: int) -> None:
        while True:
            for signum in os.read(fd, 64):
                if signum in STOP_SIGNALS:
                    self._signal(signum)

    def _signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            first = self.signum is None
            if first:
                self.signum = signum
            callbacks = list(self._callbacks)
        if not first:
            _say(f"prime-node {self.role}: {name} again: exiting now")
            force_exit(128 + signum)
        _say(f"prime-node {self.role}: {name}: stopping (a second signal exits at once; "
             f"forced exit in {self.grace_s:.0f} s)")
        threading.Thread(target=self._deadline, args=(signum,), name="stop-deadline", daemon=True).start()
        for fn in callbacks:
            self._call(fn, signum)

    def _call(self, fn: Callable[[int], object], signum: int) -> None:
        try:
            fn(signum)
        except Exception as e:  # noqa: BLE001 - e.g. the loop is closed already: the deadline still holds
            _say(f"prime-node {self.role}: stop callback failed: {type(e).__name__}: {e}")

    def _deadline(self, signum: int) -> None:
        time.sleep(self.grace_s)
        _say(f"prime-node {self.role}: did not stop within {self.grace_s:.0f} s of "
             f"{signal.Signals(signum).name}; stacks of its threads follow, then exit {128 + signum}")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        force_exit(128 + signum)


def _noop(signum, frame) -> None:
    pass


def run_async(role: str, main: Callable[[], Awaitable[int | None]], stop: Callable[[], None], *,
              cancel_after_s: float | None = 2.0, grace_s: float = STOP_GRACE_S) -> int:
    """`asyncio.run(main())` for a role, under a Stopper. The first signal calls `stop()` on the loop (the
    role's own clean stop: its loops watch a stop event); if `main` has not returned `cancel_after_s` later,
    its task is cancelled (an await that watches no stop event, e.g. a read from a silent peer; None: never,
    for a role whose stop must run to its end). Returns main's exit code, or 0 when a signal's stop
    finished before the deadline."""
    stopper = Stopper(role, grace_s).install()

    async def supervised():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # supervised() runs as asyncio.run's task

        def on_loop():
            stop()
            if cancel_after_s is not None:
                loop.call_later(cancel_after_s, task.cancel)

        stopper.on_stop(lambda _signum: loop.call_soon_threadsafe(on_loop))
        return await main()

    try:
        return int(asyncio.run(supervised()) or 0)
    except asyncio.CancelledError:
        if stopper.signum is None:
            raise
        return 0


def die_with_parent_from_env() -> None:
    """In a process started with DIE_WITH_ENV=<parent pid> (the demo's): ask Linux for SIGTERM when that
    parent dies. The variable is removed so that this process's own children do not inherit it. If the
    parent is gone already (it died before the request), exit now."""
    parent = os.environ.pop(DIE_WITH_ENV, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        _say(f"warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); "
             "this process will outlive its parent")
        return
    if os.getppid() != int(parent):
        _say(f"prime-node: parent process {parent} is gone; exiting")
        raise SystemExit(128 + signal.SIGTERM)
