"""Clean stops (issue #31 items 1 and 2): `prime-node demo` takes its swarm down with it, whether it is
stopped by a signal or SIGKILLed; every role exits on SIGTERM within a bounded time even when a thread is
stuck (a trainer rank that will never answer, a read from a peer that never writes), with the ledger intact;
a second signal exits at once. Every process here is a real `python -m node.cli ...` on 127.0.0.1; processes
are found by their parent pid in /proc and recognised by (pid, start time), so a reused pid never counts."""
from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.coordinator_harness import REPO

pytestmark = [pytest.mark.timeout(180)]

STOP_BOUND_S = 10.0  # what a role promises (node/lifecycle.py STOP_GRACE_S; the coordinator's with the default
# server.stop_timeout_s of 5 s)
MARGIN_S = 8.0  # a loaded 2-core box: interpreter teardown, logging, the kernel reaping
FAST_CFG = ["--set=eval.every_steps=0", "--set=trainer.warm_start_steps=0"]


# ------------------------------------------------------------------------------- processes, from /proc

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in ticks) of `pid`, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[tuple[int, int], str]:
    """Every live process under `root` (root included): (pid, start time) -> command line."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            table[int(d)] = st
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        st = table.get(pid)
        if st is None or st[1] == "Z":
            continue
        found[(pid, st[2])] = _cmdline(pid)
        frontier += [p for p, (ppid, _, _) in table.items() if ppid == pid]
    return found


def alive(procs) -> list[str]:
    """Those of `procs` ((pid, start time) -> cmdline) still running (a zombie is not running)."""
    out = []
    for (pid, start), cmd in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            out.append(f"{pid} {cmd[:160]}")
    return out


def wait_until(pred, timeout: float, what: str, poll: float = 0.2):
    t0 = time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def wait_gone(procs, timeout: float) -> float:
    """Seconds until none of `procs` runs; fails naming the ones left."""
    t0 = time.monotonic()
    while alive(procs):
        if time.monotonic() - t0 > timeout:
            left = alive(procs)
            for line in left:  # do not leave them to the next test
                os.kill(int(line.split()[0]), signal.SIGKILL)
            raise AssertionError(f"still running {timeout:.0f} s after the stop: {left}")
        time.sleep(0.1)
    return time.monotonic() - t0


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)
        proc.kill()
        for (pid, _), _cmd in tree.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout:.0f} s of the signal") from None
    return rc, time.monotonic() - t0


def cli(tmp: Path, log: str, *args: str, program: list[str] | None = None) -> subprocess.Popen:
    """`prime-node ARGS` as a subprocess in `tmp`, output to `tmp/log` (`program`: another way to start it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *(program or ["-m", "node.cli"]), *args], cwd=tmp, env=env,
                            stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT)


# The coordinator, with a stop that never finishes (a thread stuck where no bound of the coordinator's own
# reaches): only node/lifecycle.py's deadline can end it.
HANGING_STOP = [
    "-c",
    "import asyncio, sys, threading\n"
    "from node.coordinator.service import Coordinator\n"
    "async def stop(self):\n"
    "    await asyncio.to_thread(threading.Event().wait)\n"
    "Coordinator.stop = stop\n"
    "from node.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n",
]


def ledger_intact(db_path: Path) -> int:
    """The ledger of a stopped coordinator opens, passes sqlite's integrity check; returns its newest step."""
    db = sqlite3.connect(db_path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT coalesce(max(step), 0) FROM steps").fetchone()[0]
    finally:
        db.close()


@contextmanager
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never writes a byte: every read from it
    blocks. Yields (url, event set once a client has connected)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    connected, done, held = threading.Event(), threading.Event(), []

    def accept():
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            held.append(conn)
            connected.set()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", connected
    finally:
        done.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


# ------------------------------------------------------------------------------- 1. the demo owns its processes

def _start_demo(tmp: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    """A demo that will still be training when stopped; returns it and its process tree once its
    coordinator (with its trainer ranks) and worker run."""
    demo = cli(tmp, "demo.log", "demo", "--nodes", "1", "--steps", "100000", *FAST_CFG, *extra)

    def up():
        assert demo.poll() is None, (tmp / "demo.log").read_text()[-3000:]
        tree = descendants(demo.pid)
        cmds = list(tree.values())
        ranks = sum("node.trainer.distributed" in c for c in cmds)
        want_ranks = 1 if "--set=trainer.ranks=2" in extra else 0
        ok = (any(" coordinator " in c for c in cmds) and any(" join " in c for c in cmds)
              and ranks == want_ranks and (tmp / "demo-out" / "coordinator.ready").is_file())
        return tree if ok else None

    return demo, wait_until(up, 150, "the demo's coordinator and worker")


@pytest.mark.slow
def test_demo_stopped_by_sigterm_stops_its_coordinator_and_workers(tmp_path):
    """`kill -TERM <demo>` (what timeout, systemd and docker stop send) used to leave the coordinator and
    the workers training as orphans. Now the demo stops them (TERM, KILL after the grace period) and exits
    non-zero saying why."""
    demo, tree = _start_demo(tmp_path)
    assert len(tree) >= 3
    demo.send_signal(signal.SIGTERM)
    rc, took = wait_exit(demo, 15)
    left_after = wait_gone(tree, 15)
    out = (tmp_path / "demo.log").read_text()
    assert rc == 128 + signal.SIGTERM, (rc, out[-2000:])
    assert "SIGTERM" in out, out[-2000:]
    ledger_intact(tmp_path / "demo-out" / "coordinator" / "ledger.sqlite")
    print(f"demo exited {took:.1f} s after SIGTERM, its swarm gone {left_after:.1f} s after that")


@pytest.mark.slow
def test_demo_sigkilled_takes_its_swarm_and_the_second_trainer_rank_with_it(tmp_path):
    """The demo SIGKILLed (nothing of it runs to clean up): its coordinator and worker notice their parent
    died (PR_SET_PDEATHSIG) and stop; the coordinator stops its second trainer rank on the way."""
    demo, tree = _start_demo(tmp_path, "--set=trainer.ranks=2")
    assert len(tree) >= 4
    demo.send_signal(signal.SIGKILL)
    demo.wait(5)
    took = wait_gone(tree, 15)
    ledger_intact(tmp_path / "demo-out" / "coordinator" / "ledger.sqlite")
    print(f"the swarm of a SIGKILLed demo was gone {took:.1f} s later")


# ------------------------------------------------------------------------------- 2. every role stops in bounded time

def _coordinator_with_a_stopped_rank(tmp: Path, program: list[str] | None = None) -> tuple[subprocess.Popen, dict, int]:
    """A coordinator with trainer.ranks = 2 whose rank-1 process is SIGSTOPped: every collective with it
    (the stop message, the wait for it to exit) never completes."""
    ready = tmp / "ready.json"
    coord = cli(tmp, "coord.log", "coordinator", "--config", str(REPO / "configs/local.toml"),
                f"--set=storage.dir={tmp / 'coord'}", "--set=trainer.ranks=2", *FAST_CFG, "--ready-file", str(ready),
                program=program)

    def up():
        assert coord.poll() is None, (tmp / "coord.log").read_text()[-3000:]
        tree = descendants(coord.pid)
        ranks = [pid for (pid, _), c in tree.items() if "node.trainer.distributed" in c]
        return (tree, ranks[0]) if ready.is_file() and ranks else None

    tree, rank1 = wait_until(up, 150, "the coordinator and its second rank")
    os.kill(rank1, signal.SIGSTOP)
    return coord, tree, rank1


@pytest.mark.slow
def test_coordinator_with_a_stopped_rank_exits_on_sigterm_with_the_ledger_intact(tmp_path):
    """SIGTERM to a coordinator whose second trainer rank will never answer (it used to wait for it for
    ever): it exits within the bound and leaves no rank behind, either by its own bounded stop (the
    training thread's server.stop_timeout_s, then the rank is killed: exit 0) or, on a box too loaded for
    that, by the deadline (exit 128 + SIGTERM, with the threads' stacks); the ledger re-opens and passes
    sqlite's integrity check."""
    coord, tree, _ = _coordinator_with_a_stopped_rank(tmp_path)
    coord.send_signal(signal.SIGTERM)
    rc, took = wait_exit(coord, STOP_BOUND_S + MARGIN_S)
    wait_gone(tree, 5)
    log = (tmp_path / "coord.log").read_text()
    assert rc in (0, 128 + signal.SIGTERM), (rc, log[-3000:])
    if rc:
        assert "did not stop within" in log and 'File "' in log, log[-3000:]
    ledger_intact(tmp_path / "coord" / "ledger.sqlite")
    print(f"coordinator with a stopped rank exited {took:.1f} s after SIGTERM, code {rc}")


@pytest.mark.slow
def test_coordinator_whose_stop_hangs_is_ended_at_the_deadline_with_its_ranks(tmp_path):
    """A stop that never finishes (HANGING_STOP): 10 s after SIGTERM the coordinator prints every thread's
    stack, SIGKILLs its trainer ranks (the stopped one too) and exits 128 + SIGTERM; the ledger, never
    closed, re-opens and passes the integrity check."""
    coord, tree, _ = _coordinator_with_a_stopped_rank(tmp_path, program=HANGING_STOP)
    coord.send_signal(signal.SIGTERM)
    rc, took = wait_exit(coord, STOP_BOUND_S + MARGIN_S)
    wait_gone(tree, 5)
    log = (tmp_path / "coord.log").read_text()
    assert rc == 128 + signal.SIGTERM, (rc, log[-3000:])
    assert took >= STOP_BOUND_S - 1, took  # the deadline, not something else, ended it
    assert "did not stop within 10 s of SIGTERM" in log and 'Thread 0x' in log, log[-3000:]  # faulthandler's dump
    ledger_intact(tmp_path / "coord" / "ledger.sqlite")
    print(f"coordinator whose stop hangs exited {took:.1f} s after SIGTERM")


@pytest.mark.slow
def test_second_sigterm_exits_a_stuck_coordinator_at_once(tmp_path):
    coord, tree, _ = _coordinator_with_a_stopped_rank(tmp_path)
    coord.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping" in (tmp_path / "coord.log").read_text(), 10, "the coordinator to start stopping")
    coord.send_signal(signal.SIGTERM)
    rc, took = wait_exit(coord, 3)
    wait_gone(tree, 5)
    assert rc == 128 + signal.SIGTERM, (rc, (tmp_path / "coord.log").read_text()[-3000:])
    ledger_intact(tmp_path / "coord" / "ledger.sqlite")
    print(f"second SIGTERM: exited {took:.2f} s later")


# The coordinator, whose engine process never says it is ready (the API process never reads its channel): a
# restore that takes longer than anyone waits, as on a busy box.
ENGINE_NEVER_READY = [
    "-c",
    "import asyncio, sys\n"
    "from node.coordinator import engine_channel\n"
    "async def recv(self):\n"
    "    await asyncio.Event().wait()\n"
    "engine_channel.AsyncChannel.recv = recv\n"
    "from node.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n",
]


def test_coordinator_stopped_while_its_engine_starts_exits_at_once_and_kills_the_engine(tmp_path):
    """SIGTERM while the engine process is still starting (server.engine_process, the default): the start is
    cut short, the engine killed (it ignores signals and reads its channel only once ready), exit 0; before,
    the stop waited for a start that never ended and met the 10 s deadline (exit 128 + SIGTERM)."""
    coord = cli(tmp_path, "coord.log", "coordinator", "--config", str(REPO / "configs/local.toml"),
                f"--set=storage.dir={tmp_path / 'coord'}", *FAST_CFG, program=ENGINE_NEVER_READY)

    def engine_up():
        assert coord.poll() is None, (tmp_path / "coord.log").read_text()[-3000:]
        tree = descendants(coord.pid)
        return tree if any("node.coordinator.engine" in c for c in tree.values()) else None

    tree = wait_until(engine_up, 60, "the engine process")
    coord.send_signal(signal.SIGTERM)
    rc, took = wait_exit(coord, STOP_BOUND_S + MARGIN_S)
    wait_gone(tree, 5)
    log = (tmp_path / "coord.log").read_text()
    assert rc == 0, (rc, log[-3000:])
    assert took < STOP_BOUND_S - 1, took  # the stop, not the deadline, ended it
    assert "killing it" in log, log[-3000:]
    ledger_intact(tmp_path / "coord" / "ledger.sqlite")
    print(f"coordinator stopped while its engine started exited {took:.1f} s after SIGTERM")


def _role_blocked_on_a_silent_peer(tmp: Path, role: str, *args: str):
    """Start `role` against a server that accepts and never answers; SIGTERM it once it is blocked in
    that read; it must exit within the bound."""
    with silent_server() as (url, connected):
        proc = cli(tmp, f"{role}.log", role, *[a.replace("{URL}", url) for a in args])
        wait_until(lambda: connected.is_set() or proc.poll() is not None, 60, f"the {role} to connect")
        assert proc.poll() is None, (tmp / f"{role}.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        rc, took = wait_exit(proc, STOP_BOUND_S + MARGIN_S)
    log = (tmp / f"{role}.log").read_text()
    assert rc == 0, (rc, log[-3000:])
    assert "Traceback" not in log, log[-3000:]
    print(f"{role} blocked on a silent peer exited {took:.1f} s after SIGTERM")
    return took


def test_worker_blocked_on_a_silent_coordinator_exits_on_sigterm(tmp_path):
    _role_blocked_on_a_silent_peer(tmp_path, "join", "--coordinator", "{URL}", "--config",
                                   str(REPO / "configs/local.toml"), f"--set=worker.storage_dir={tmp_path / 'w'}")


def test_relay_blocked_on_a_silent_upstream_exits_on_sigterm(tmp_path):
    _role_blocked_on_a_silent_peer(tmp_path, "relay", "--upstream", "{URL}", "--dir", str(tmp_path / "relay"))


def test_verifier_blocked_on_a_silent_coordinator_exits_on_sigterm(tmp_path):
    from protocol.identity import Identity

    Identity.generate().save(tmp_path / "v.key")
    _role_blocked_on_a_silent_peer(tmp_path, "verifier", "--coordinator", "{URL}", "--key", str(tmp_path / "v.key"),
                                   "--dir", str(tmp_path / "v"))


def test_idle_coordinator_stops_on_sigterm_with_exit_0(tmp_path):
    """The ordinary case stays ordinary: a coordinator with nothing stuck stops cleanly, exit 0, well
    inside the bound, and leaves a closed ledger."""
    ready = tmp_path / "ready.json"
    coord = cli(tmp_path, "coord.log", "coordinator", "--config", str(REPO / "configs/local.toml"),
                f"--set=storage.dir={tmp_path / 'coord'}", *FAST_CFG, "--ready-file", str(ready))
    wait_until(lambda: ready.is_file() or coord.poll() is not None, 120, "the coordinator")
    assert coord.poll() is None, (tmp_path / "coord.log").read_text()[-3000:]
    coord.send_signal(signal.SIGTERM)
    rc, took = wait_exit(coord, STOP_BOUND_S + MARGIN_S)
    assert rc == 0, (rc, (tmp_path / "coord.log").read_text()[-3000:])
    assert not (tmp_path / "coord" / "ledger.sqlite-wal").exists() or \
        (tmp_path / "coord" / "ledger.sqlite-wal").stat().st_size == 0  # closed: checkpointed into the file
    ledger_intact(tmp_path / "coord" / "ledger.sqlite")
    print(f"idle coordinator exited {took:.1f} s after SIGTERM")
