"""Fault injection for crash and supervision tests. Unset in normal runs, where each costs one dict lookup.

`PRIME_NODE_CRASH_AT=<point>` SIGKILLs the process at that point. Points: "publish" (a step n ≥ 1:
checkpoint and trainer state written, ledger not yet committed) and "intake" (submission committed,
answer not yet sent).

`PRIME_NODE_FAULT=<point>` raises `InjectedFault` at that point, as a bug or a broken disk would: the
coordinator's supervisor must notice (node/coordinator/supervisor.py). Points: "train-step" (the training
thread, at the start of each step), "expire-loop" (the assignment-expiry task, each turn), "replay" (a
submission's replay, each time one is asked for; the verdict queue answers for it, not the supervisor:
node/coordinator/verification.py).
"""
import os
import signal


class InjectedFault(RuntimeError):
    pass


def crash_point(point: str) -> None:
    if os.environ.get("PRIME_NODE_CRASH_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_point(point: str) -> None:
    if os.environ.get("PRIME_NODE_FAULT") == point:
        raise InjectedFault(f"fault injected at {point!r} (PRIME_NODE_FAULT)")
