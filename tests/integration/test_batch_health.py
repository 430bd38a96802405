"""A run that cannot fill its batch says why (issue #31 item 3): a real coordinator and a real in-process worker
on 127.0.0.1, on a task whose reward is a constant. Every group then has equal rewards, the trainer's
difficulty filter drops each one, and step 1 never comes; status, /metrics, the log and the demo's progress
line must name the reason, and the warning must come once (rate-limited), not once per group."""
from __future__ import annotations

import logging
import re

import aiohttp
import pytest

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(300)]

TASK = "task.name=tests.integration.constant_tasks:ConstantReward"
WARN_AFTER = 8
# Verification off: replaying every submission only slows the groups down; these tests are about what the
# trainer does with them (test_rejected_groups_are_counted... covers verification's share).
FAST = ("run.batch_prompts=8", "run.group_size=4", f"run.stall_warn_groups={WARN_AFTER}",
        "verification.fraction=0", "verification.new_node_fraction=0")


def stall_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "prime_node.training" and r.levelno == logging.WARNING and "cannot fill" in r.getMessage()]


async def metric(url: str, name: str, **labels) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{re.escape(sel)}}} (\S+)$" if sel else rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name}{{{sel}}} not in /metrics"
    return float(m.group(1))


async def stalled_run(tmp_path, caplog, reward: float, reason: str) -> dict:
    """Runs until three times the warning threshold of groups in a row were unusable; returns the status."""
    caplog.set_level(logging.INFO, logger="prime_node.training")
    async with running_coordinator(tmp_path, TASK, f"task.kwargs={{reward = {reward}}}", *FAST) as (coord, url):
        worker = start_worker(tmp_path, "w", coord, url)
        try:
            await wait_for(lambda: coord.status()["batch_health"]["unusable_in_a_row"] >= 3 * WARN_AFTER, 180,
                           f"{3 * WARN_AFTER} unusable groups in a row", coord)
        finally:
            await stop_workers(worker)
        status = coord.status()
        bh = status["batch_health"]
        assert status["step"] == 0
        assert bh["batch"] == 1 and bh["usable"] == 0 and bh["needed"] == 8
        assert bh["unusable"][reason] >= 3 * WARN_AFTER
        assert sum(bh["unusable"].values()) == bh["unusable"][reason], bh["unusable"]  # no other reason
        assert bh["unusable_in_a_row"] >= 3 * WARN_AFTER and bh["warn_after"] == WARN_AFTER
        assert await metric(url, "prime_groups_unusable_total", reason=reason) >= 3 * WARN_AFTER
        assert await metric(url, "prime_groups_unusable_in_a_row") >= 3 * WARN_AFTER
        assert await metric(url, "prime_batch_groups_usable") == 0
        assert await metric(url, "prime_batch_groups_needed") == 8
        # once, though the streak is three times the threshold: the warning is rate-limited
        assert len(stall_warnings(caplog)) == 1, stall_warnings(caplog)
        return status


async def test_every_reward_zero_says_why_everywhere(tmp_path, caplog):
    status = await stalled_run(tmp_path, caplog, 0.0, "all_rewards_zero")
    hint = "check the task's answer format against what the model writes"
    assert hint in status["batch_health"]["warning"]
    (logged,) = stall_warnings(caplog)
    assert hint in logged and "all_rewards_zero" in logged
    from node.demo import unusable_note

    note = unusable_note(status)
    assert re.fullmatch(r"\d+ \(all rewards 0\)", note), note  # the demo's progress line


async def test_every_reward_one_says_the_task_is_too_easy(tmp_path, caplog):
    status = await stalled_run(tmp_path, caplog, 1.0, "all_rewards_equal")
    hint = "the task is too easy or the reward is constant"
    assert hint in status["batch_health"]["warning"]
    (logged,) = stall_warnings(caplog)
    assert hint in logged
    from node.demo import unusable_note

    assert "(all rewards equal)" in unusable_note(status)


async def test_normal_run_fills_its_batches_without_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="prime_node.training")
    async with running_coordinator(tmp_path, "run.max_steps=2", *FAST) as (coord, url):
        worker = start_worker(tmp_path, "w", coord, url)
        try:
            await wait_for(lambda: coord.published_step >= 2, 180, "2 training steps", coord)
        finally:
            await stop_workers(worker)
        bh = coord.status()["batch_health"]
        assert bh["run_usable"] >= 2 * 8 and bh["warning"] is None
        assert bh["unusable_in_a_row"] < WARN_AFTER
        assert await metric(url, "prime_groups_usable_total") >= 2 * 8
        assert stall_warnings(caplog) == []
