"""The engine process (`server.engine_process = true`; docs/ARCHITECTURE.md, "Processes"): the training loop
(training, evaluation, publishing) and the coordinator's own replays of submissions, which share the policy
models (PolicyStore) in memory, in a child of the API process. The API process keeps HTTP, the ledger's
other writers, the scheduler, intake and status, and runs nothing of torch: a training step no longer holds
the GIL that every request waits on. (It imports no torch at all: its tokenizer is node/trainer/light_tokenizer.py's,
tests/unit/test_engine_imports.py.)

    python -m node.coordinator.engine --fd N --storage DIR

`--fd`: this end of the socketpair the API process made (node/coordinator/engine_channel.py); `--storage`
names the run's directory (and the process, for an operator's `ps`). Both processes open the one SQLite
ledger (WAL): the engine writes published steps and reads waiting groups and submissions, the API process
writes everything else.

Life: Init (config and key) -> restore or publish θ_0 -> Ready -> Start -> train until Stop, or until the
channel closes (the API process is gone, SIGKILL included): a step cut short is redone after a restart,
as after any crash (node/coordinator/training.py). The training thread's death is sent as Failed, and the
process exits 1. One engine per storage directory at a time: an exclusive lock on `engine.lock`, which a
new engine waits for while an old one (its API process killed) finishes its step.
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.checkpoint_dir import CheckpointDir
from node.config import Config
from node.coordinator import engine_channel as C
from node.coordinator.ledger import Ledger
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.publisher import Publisher
from node.coordinator.run_model import load_run_model
from node.coordinator.status import CURVE_POINTS, thin
from node.coordinator.supervisor import describe
from node.coordinator.training import TrainingLoop
from node.coordinator.verification import PolicyStore, build_checks, merge_turns
from node.logs import setup_logging
from protocol.identity import Identity

log = logging.getLogger("prime_node.engine")

SNAPSHOT_EVERY_S = 1.0  # the status document is rebuilt at most once a second (app.STATUS_MAX_AGE_S)
LOCK_WAIT_S = 120.0  # an old engine (its API process killed) finishes its step and exits within this


def take_lock(storage: Path, wait_s: float = LOCK_WAIT_S) -> int:
    """An exclusive flock on storage/engine.lock, held until this process exits (the kernel drops it then,
    SIGKILL included). Two engines on one run would both train and publish."""
    fd = os.open(storage / "engine.lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"another engine still holds {storage / 'engine.lock'} after {wait_s:.0f} s")
            time.sleep(0.2)


def renice(by: int) -> None:
    """Add `by` to the niceness of every thread of this process. Linux keeps niceness per thread: os.nice would
    change only the calling thread's, and torch's worker threads exist by the time this is called; threads
    started later inherit their creator's. Where there is no /proc/self/task, os.nice (process-wide there)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        os.nice(by)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
        except OSError:
            pass  # a thread that ended meanwhile


class Engine:
    def __init__(self, cfg: Config, identity: Identity, chan: C.BlockingChannel):
        self.cfg, self.chan = cfg, chan
        root = Path(cfg.storage.dir)
        self.ledger = Ledger(root / "ledger.sqlite")
        self.model = load_run_model(cfg, root)
        self.checkpoints = CheckpointDir(root)
        k = cfg.run.async_level
        publisher = Publisher(self.checkpoints, identity, cfg.run.run_id, async_level=k,
                              shard_size=cfg.distribution.shard_size, level=cfg.distribution.compression_level,
                              full_every=cfg.distribution.full_every)
        self.policies = PolicyStore(self.model.model_dir, keep=k + 2)
        # this process's own registry: what the API process shows comes from the snapshots sent to it
        self.training = TrainingLoop(cfg=cfg, storage=root, ledger=self.ledger, checkpoints=self.checkpoints,
                                     publisher=publisher, policies=self.policies, model=self.model,
                                     metrics=CoordinatorMetrics(), on_groups_dropped=self._dropped,
                                     on_step_published=self._published)
        self._replays = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")  # one at a time, as before
        self._done = threading.Event()
        self._ready = False

    # -- training thread -> API process --------------------------------------------------------------
    def _dropped(self, by_batch: dict[int, int], keep_rate: float) -> None:
        self.chan.send(C.Dropped(by_batch=by_batch, keep_rate=min(1.0, max(0.0, keep_rate))))

    def _published(self, step: int, consumed: dict[int, int]) -> None:
        if not self._ready:  # θ_0, published while restoring: Ready says it
            return
        self.chan.send(C.Published(step=step, consumed=consumed, held=self.policies.steps()))
        self._send_snapshot()

    def _send_snapshot(self) -> None:
        s = self.training.snapshot()
        self.chan.send(C.Snapshot(busy=s.busy, busy_seconds=s.busy_seconds, idle_seconds=s.idle_seconds,
                                  error=None if s.error is None else s.error[:C.MAX_REASON_CHARS],
                                  last_metrics=s.last_metrics, batch_health=s.batch_health,
                                  eval_curve=None if s.eval_curve is None else thin(s.eval_curve, CURVE_POINTS)))

    def _snapshots(self) -> None:
        while not self._done.wait(SNAPSHOT_EVERY_S):
            try:
                self._send_snapshot()
            except OSError:  # the API process is gone: the main loop sees the channel close
                return

    def _start_thread(self, target, name: str) -> threading.Thread:
        """The training thread, as the API process's Supervisor would own it: its death (an exception, or a
        return while not stopping) ends the engine, and the API process fails the coordinator on it."""
        def run() -> None:
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - every way out is reported
                if self._done.is_set():
                    log.info("thread %s ended while stopping: %s", name, describe(e))
                    return
                log.error("thread %s died", name, exc_info=e)
                self._fail(name, describe(e))
                return
            if not self._done.is_set():
                self._fail(name, "exited unexpectedly")

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def _fail(self, component: str, reason: str) -> None:
        try:
            self.chan.send(C.Failed(component=component, reason=reason[:C.MAX_REASON_CHARS]))
        finally:
            os._exit(1)  # the API process sees the channel close after the Failed message

    # -- replays -------------------------------------------------------------------------------------
    def _verify(self, req: C.Verify) -> None:
        try:
            answer = self._judge(req)
        except Exception as e:  # noqa: BLE001 - one bad submission must not stop later verdicts
            log.exception("replay of %s failed", req.assignment_id)
            answer = C.Verdicts(request_id=req.request_id, refs=None, error=describe(e))
        try:
            self.chan.send(answer)
        except OSError:
            pass  # the API process is gone

    def _judge(self, req: C.Verify) -> C.Verdicts:
        from verify.rollouts import judge
        from protocol.messages import ReplayVerdict

        with self.policies.lease(req.step) as model:  # the training thread may publish while this replays
            if model is None:
                return C.Verdicts(request_id=req.request_id, refs=None)
            undecided = [g for g in self.ledger.submission_groups(req.assignment_id) if g.verdict is None]
            a = self.ledger.assignment(req.assignment_id)
            if a is None or not undecided:
                raise RuntimeError(f"assignment {req.assignment_id} has no undecided groups in the ledger")
            refs, checks, owner = build_checks(undecided, {p.prompt_id: p.seeds for p in a.prompts},
                                               self.cfg.sampling, self.model.eos_token_id)
            verdicts = merge_turns(judge(model, checks, claimed=not req.audit), owner, len(refs))
        return C.Verdicts(request_id=req.request_id, refs=refs,
                          verdicts=[ReplayVerdict(reason=v.reason, tokens=v.tokens, near_ties=v.near_ties,
                                                  outlier=v.outlier, fit=v.fit) for v in verdicts])

    # -- life ----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.training.restore_or_init()
        # Niced from here on (server.engine_nice): the API process serves requests only after Ready, so the
        # restore, θ_0 and the warm start run at its priority. Niced from the start they were starved on a loaded
        # box: configs/local.toml (warm start 40) ready after 166 s at load 13.5, against 45 and 68 s at load 10
        # niced from here (2 cores, other sessions' benchmarks running).
        if self.cfg.server.engine_nice:
            renice(self.cfg.server.engine_nice)
        self._ready = True
        # the trainer's snapshot first: status answers from the engine's own figures (batch health, last
        # metrics) from the moment the API process starts, as in one process, not from an empty placeholder
        self._send_snapshot()
        self.chan.send(C.Ready(published_step=self.training.published_step, held=self.policies.steps()))
        started = False
        try:
            while True:
                msg = self.chan.recv()
                if msg is None:
                    log.warning("the API process is gone; stopping the engine")
                    break
                if isinstance(msg, C.Stop):
                    break
                if isinstance(msg, C.Start) and not started:
                    started = True
                    self.training.start(self._start_thread)
                    threading.Thread(target=self._snapshots, name="snapshots", daemon=True).start()
                elif isinstance(msg, C.Verify):
                    self._replays.submit(self._verify, msg)
                elif isinstance(msg, C.Decided):
                    self.training.notify_decided()
                else:
                    raise C.ChannelError(f"unexpected {msg.kind!r} message")
        finally:
            self._done.set()
            self.training.stop(self.cfg.server.stop_timeout_s)
            self._replays.shutdown(wait=False, cancel_futures=True)
            if not self.training.running:
                self.ledger.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m node.coordinator.engine")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--storage", required=True)
    args = p.parse_args(argv)
    # Its life is its channel's: a terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process
    # group, and the API process then stops the engine itself (Stop) after its own stop; SIGKILL still ends it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    chan = C.BlockingChannel(socket.socket(fileno=args.fd), C.TO_ENGINE)
    init = chan.recv()
    if not isinstance(init, C.Init):
        print("engine: no Init message on the channel", file=sys.stderr)
        return 2
    cfg = Config.model_validate_json(init.config_json)
    setup_logging(cfg.server.log_format)
    if Path(cfg.storage.dir).resolve() != Path(args.storage).resolve():
        raise SystemExit(f"engine: --storage {args.storage} is not the config's storage.dir {cfg.storage.dir}")
    take_lock(Path(cfg.storage.dir))
    identity = Identity(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(init.key_hex)))
    try:
        return Engine(cfg, identity, chan).run()
    except Exception as e:  # noqa: BLE001 - start-up failed (restore, θ_0): said on the channel, then exit 1
        log.exception("the engine failed")
        try:
            chan.send(C.Failed(component="engine", reason=describe(e)))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    code = main()
    # Everything is on disk by now (the ledger closed, or left to crash safety when a step is left behind), so the
    # interpreter's own teardown is skipped: torch's is the slow part, and the engine is niced (server.engine_nice).
    # On a loaded box it took more than 10 s of wall time after main returned, and the API process's stop met
    # node/lifecycle.py's deadline (exit 143; tests/integration/test_supervisor.py with three busy loops, 4 of 4).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
