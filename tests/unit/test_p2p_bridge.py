"""The asyncio <-> trio-thread bridge, with a small real trio service (no libp2p)."""
import asyncio
import threading

import pytest
import trio

from node.p2p.bridge import TrioBridge
from node.p2p.errors import P2PError, P2PNotRunning

pytestmark = pytest.mark.timeout(60)


class Counter:
    """A trio service with state that only the trio thread touches."""

    def __init__(self, fail_start=False):
        self.value = 0
        self.fail_start = fail_start
        self.cleaned_up = False
        self.cancelled_calls = 0
        self.thread = None

    async def run(self, stop, *, task_status):
        if self.fail_start:
            raise P2PError("port taken")
        self.thread = threading.current_thread()
        task_status.started("ready")
        try:
            await stop.wait()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # a graceful shutdown step
            self.cleaned_up = True

    async def add(self, n):
        assert threading.current_thread() is self.thread
        await trio.sleep(0)
        self.value += n
        return self.value

    async def boom(self):
        raise ValueError("bad input")

    async def hang(self):
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled_calls += 1
            raise


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("prime-node-")}


async def test_calls_run_on_the_trio_thread_and_return_here():
    svc = Counter()
    bridge = TrioBridge("t1")
    assert await bridge.start(svc.run) == "ready"
    assert svc.thread is not threading.current_thread()
    results = await asyncio.gather(*(bridge.call(svc.add, 1) for _ in range(50)))
    assert sorted(results) == list(range(1, 51))
    with pytest.raises(ValueError, match="bad input"):
        await bridge.call(svc.boom)
    await bridge.stop()
    assert svc.cleaned_up and not _threads()
    with pytest.raises(P2PNotRunning):
        await bridge.call(svc.add, 1)
    await bridge.stop()  # idempotent


async def test_cancelling_the_asyncio_caller_cancels_the_trio_task():
    svc = Counter()
    bridge = TrioBridge("t2")
    await bridge.start(svc.run)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(bridge.call(svc.hang), 0.2)
    for _ in range(100):
        if svc.cancelled_calls:
            break
        await asyncio.sleep(0.01)
    assert svc.cancelled_calls == 1
    assert await bridge.call(svc.add, 2) == 2  # the bridge is still fine
    await bridge.stop()


async def test_stop_fails_pending_calls_cleanly():
    svc = Counter()
    bridge = TrioBridge("t3")
    await bridge.start(svc.run)
    pending = asyncio.ensure_future(bridge.call(svc.hang))
    await asyncio.sleep(0.05)
    await bridge.stop()
    with pytest.raises(P2PNotRunning):
        await pending
    assert svc.cancelled_calls == 1 and svc.cleaned_up and not _threads()


async def test_a_service_that_fails_to_start_raises_and_leaves_no_thread():
    bridge = TrioBridge("t4")
    with pytest.raises(P2PError, match="port taken"):
        await bridge.start(Counter(fail_start=True).run)
    assert not _threads()
    with pytest.raises(P2PNotRunning):
        await bridge.call(Counter().add, 1)
