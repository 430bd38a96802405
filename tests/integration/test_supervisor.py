"""Issue #25, finding 12: dead background work went unnoticed. A coordinator whose training thread or
assignment-expiry loop died kept answering /v1/work (assignments that could never be trained or expired),
logged a WARNING at most, and ran on. Now the supervisor (node/coordinator/supervisor.py) owns them: the
first death fails the coordinator, which answers node requests 503 with the reason, shows it on status,
the dashboard and /metrics, and exits with status 1 (server.exit_on_failure, default true).

The coordinators here are real `prime-node coordinator` processes on loopback; the deaths are real
exceptions raised inside the component (node/coordinator/faults.py, PRIME_NODE_FAULT).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.coordinator_harness import REPO, RawNode

pytestmark = pytest.mark.timeout(180)

READY_S = 120  # start-up imports torch and builds the tiny model: seconds on an idle machine, more when loaded
FAILED_S = 60


def start_coordinator(tmp: Path, fault: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    ready, log = tmp / "ready.json", tmp / "coordinator.log"
    args = [sys.executable, "-m", "node.cli", "coordinator", "--config", str(REPO / "configs/local.toml"),
            "--set", f"storage.dir={tmp / 'coord'}", "--set", "trainer.warm_start_steps=0",
            "--set", "eval.every_steps=0", "--ready-file", str(ready), *[f"--set={e}" for e in extra]]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PRIME_NODE_FAULT": fault,
           # the suite's tiny-model cache (tests/conftest.py): no child Python building the model for each of these
           **{k: v for k, v in os.environ.items() if k == "PRIME_NODE_TINY_MODEL_CACHE"}}
    proc = subprocess.Popen(args, cwd=tmp, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    return proc, log


async def wait_ready(proc: subprocess.Popen, tmp: Path, log: Path) -> str:
    deadline = time.monotonic() + READY_S
    while not (tmp / "ready.json").is_file():
        assert proc.poll() is None, f"the coordinator exited during start-up:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the coordinator did not start"
        await asyncio.sleep(0.1)
    return json.loads((tmp / "ready.json").read_text())["url"]


async def wait_failed(s: aiohttp.ClientSession, base: str) -> dict:
    deadline = time.monotonic() + FAILED_S
    while True:
        async with s.get(base + "/v1/status") as r:
            status = await r.json()
        if status.get("failed"):
            return status
        assert time.monotonic() < deadline, f"status never said the coordinator failed: {status.get('trainer')}"
        await asyncio.sleep(0.1)


async def check_failed_coordinator(base: str, component: str, reason: str) -> None:
    """What a failed coordinator shows: 503 with the reason for work, submissions and joins; status, the
    dashboard and the metrics gauge name the component."""
    async with aiohttp.ClientSession() as s:
        node = RawNode(base, s)
        status = await wait_failed(s, base)
        assert status["failed"]["component"] == component and reason in status["failed"]["reason"]
        for path, payload in (("/v1/work", {"policy_step": 0}), ("/v1/join", {}),
                              ("/v1/submit", {"assignment_id": "x", "policy_step": 0, "rollouts": []})):
            st, body = await node.post(path, payload)
            assert st == 503, (path, st, body)
            assert body["error"] == "coordinator_failed" and component in body["detail"] and reason in body["detail"]
        async with s.get(base + "/metrics") as r:
            metrics = await r.text()
        assert f'prime_coordinator_failed{{component="{component}"}} 1.0' in metrics
        async with s.get(base + "/dashboard") as r:
            page = await r.text()
        assert 'id="failed"' in page and "s.failed" in page


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.parametrize("fault,component,reason", [
    ("train-step", "trainer", "InjectedFault"),
    ("expire-loop", "expire-assignments", "InjectedFault"),
])
async def test_dead_component_stops_work_and_shows_why(tmp_path, fault, component, reason):
    """exit_on_failure = false: the failed coordinator stays up to show why; it still exits 1 when stopped."""
    proc, log = start_coordinator(tmp_path, fault, "server.exit_on_failure=false")
    try:
        base = await wait_ready(proc, tmp_path, log)
        await check_failed_coordinator(base, component, reason)
        assert proc.poll() is None, "exit_on_failure = false: the coordinator stays up"
    finally:
        rc = stop(proc)
    assert rc == 1, log.read_text()[-3000:]
    assert f"coordinator failed: {component} died" in log.read_text()


@pytest.mark.parametrize("fault,component", [("train-step", "trainer"), ("expire-loop", "expire-assignments")])
async def test_dead_component_exits_the_coordinator_non_zero(tmp_path, fault, component):
    """The default (server.exit_on_failure = true): the process ends by itself, with status 1, so that a
    process manager restarts it."""
    proc, log = start_coordinator(tmp_path, fault)
    try:
        await wait_ready(proc, tmp_path, log)
        rc = await asyncio.to_thread(proc.wait, FAILED_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 1, log.read_text()[-3000:]
    text = log.read_text()
    assert f"coordinator failed: {component} died" in text and "stopping coordinator" in text


async def test_healthy_coordinator_is_not_failed_and_exits_zero(tmp_path):
    """The other side: no fault, status says failed = null, work is handed out, SIGTERM ends it with 0 --
    on a loaded box too: three busy processes share the two cores while it stops, and the niced engine
    process (server.engine_nice) must still exit before the API process's deadline (it once spent more than
    10 s in the interpreter's teardown after its stop was done: exit 143, in CI and 4 of 4 runs here)."""
    proc, log = start_coordinator(tmp_path, "")
    busy: list[subprocess.Popen] = []
    try:
        base = await wait_ready(proc, tmp_path, log)
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            assert (await node.post("/v1/join", {}))[0] == 200
            st, _ = await node.post("/v1/work", {"policy_step": 0})
            assert st == 200
            async with s.get(base + "/v1/status") as r:
                assert (await r.json())["failed"] is None
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    finally:
        try:
            rc = stop(proc)
        finally:
            for b in busy:
                b.kill()
                b.wait()
    assert rc == 0, log.read_text()[-3000:]
    assert "the engine process did not stop" not in log.read_text()  # it stopped by itself, not killed
    assert os.path.exists(tmp_path / "coord" / "ledger.sqlite")


async def test_dashboard_shows_the_failure_in_a_banner(tmp_path, monkeypatch):
    """The dashboard in real Chromium (skipped where none is installed), its CSP in force: a red banner naming
    the dead component and its reason once the training thread died (an in-process coordinator here)."""
    from tests.integration.coordinator_harness import running_coordinator
    from tests.integration.test_dashboard import chromium_page, text

    monkeypatch.setenv("PRIME_NODE_FAULT", "train-step")
    async with running_coordinator(tmp_path) as (coord, url), chromium_page(bypass_csp=False) as (page, errors):
        await page.goto(url + "/dashboard")
        await page.wait_for_selector("#conn.live", timeout=10_000)
        await page.wait_for_selector("#failed:not([hidden])", timeout=FAILED_S * 1000)
        banner = await text(page, "#failed")
        assert "trainer died" in banner and "InjectedFault" in banner, banner
        assert coord.failure is not None and coord.failure.component == "trainer"
        assert not errors, errors
