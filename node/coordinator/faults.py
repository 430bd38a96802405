"""Fault injection for crash tests: `PRIME_NODE_CRASH_AT=<point>` SIGKILLs the process at that point.

Points: "publish" (a step n ≥ 1: checkpoint and trainer state written, ledger not yet committed) and "intake"
(submission committed, answer not yet sent). Unset in normal runs, where this costs one dict lookup.
"""
import os
import signal


def crash_point(point: str) -> None:
    if os.environ.get("PRIME_NODE_CRASH_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)
