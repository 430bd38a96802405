"""The coordinator's Supervisor (node/coordinator/supervisor.py) on its own: what counts as a death."""
import asyncio
import threading

from node.coordinator.supervisor import Supervisor


async def _bound() -> tuple[Supervisor, list]:
    seen = []
    sup = Supervisor(on_failure=seen.append)
    sup.bind(asyncio.get_running_loop())
    return sup, seen


async def test_a_thread_that_returns_while_running_is_a_death():
    sup, seen = await _bound()
    sup.start_thread(lambda: None, "quitter").join()
    failure = await asyncio.wait_for(sup.wait_failed(), 5)
    assert (failure.component, failure.reason) == ("quitter", "exited unexpectedly")
    assert seen == [failure]


async def test_a_thread_that_raises_is_a_death_with_its_reason_and_the_first_death_wins():
    sup, _ = await _bound()

    def boom():
        raise ValueError("disk full")

    sup.start_thread(boom, "trainer").join()
    failure = await asyncio.wait_for(sup.wait_failed(), 5)
    sup.fail("later", "a consequence")
    assert (failure.component, failure.reason) == ("trainer", "ValueError: disk full")
    assert sup.failure == failure


async def test_a_critical_task_that_raises_or_returns_is_a_death():
    async def raises():
        raise RuntimeError("expiry broke")

    async def returns():
        return None

    for body, reason in ((raises, "RuntimeError: expiry broke"), (returns, "exited unexpectedly")):
        sup, _ = await _bound()
        sup.spawn(body(), "expire-assignments")
        failure = await asyncio.wait_for(sup.wait_failed(), 5)
        assert (failure.component, failure.reason) == ("expire-assignments", reason)


async def test_non_critical_task_failures_and_stopping_are_not_deaths():
    sup, seen = await _bound()

    async def announce():
        raise ConnectionError("peer gone")

    sup.spawn(announce(), "announce-3", critical=False)
    sup.spawn(asyncio.sleep(3600), "expire-assignments")
    await asyncio.sleep(0.05)
    release = threading.Event()
    t = sup.start_thread(release.wait, "trainer")
    assert t.daemon  # a thread left behind at stop cannot keep the process alive
    await sup.stop()  # cancels the task: not a death
    release.set()  # the thread ends after stop: expected
    t.join(5)
    await asyncio.sleep(0.05)
    assert sup.failure is None and seen == []
