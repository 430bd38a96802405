"""bench/load.py --gc-log: on the coordinator's PYTHONPATH, logs each garbage-collector pass that takes over 2 ms
(the unix time it ended, its generation, wall ms, the thread that triggered it) to $BENCH_GC_LOG_DIR/gc_<pid>.log.
A pass holds the GIL from start to end: the event loop cannot run meanwhile. Only the process whose command line
names `coordinator` (the API process) logs; anything else imports this and does nothing."""
import gc
import os
import sys
import threading
import time

_dir = os.environ.get("BENCH_GC_LOG_DIR")
if _dir and "coordinator" in sys.argv:
    _start = [0.0]
    _out = open(os.path.join(_dir, f"gc_{os.getpid()}.log"), "a", buffering=1)

    def _cb(phase: str, info: dict) -> None:
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        ms = 1000 * (time.perf_counter() - _start[0])
        if ms > 2.0:
            _out.write(f"{time.time():.3f} gen{info['generation']} {ms:.1f} {threading.current_thread().name}\n")

    gc.callbacks.append(_cb)
