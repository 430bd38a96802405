"""What the libp2p tests share: real hosts started and always stopped, and a bounded wait."""
from __future__ import annotations

import asyncio
import contextlib
import time


@contextlib.asynccontextmanager
async def running(*nodes):
    """Start each P2PNode in order; stop them all on the way out, whatever happened."""
    try:
        for n in nodes:
            await n.start()
        yield nodes
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))


async def until(what: str, cond, deadline_s: float = 15.0):
    """Poll `cond` (a function, sync or async) every 50 ms until it returns something true (returned); fail
    with `what` after `deadline_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
