"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real
coordinator and real in-process worker nodes on 127.0.0.1.

Skips with a reason where no chromium is installed (CI installs it: `apt-get install -y chromium`)
or the playwright package / its driver cannot start it.
"""
from __future__ import annotations

import asyncio
import shutil
from contextlib import asynccontextmanager

import pytest

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'


@asynccontextmanager
async def chromium_page(*, bypass_csp: bool):
    """A fresh page in headless Chromium, plus the console errors and page errors it reports.

    bypass_csp: the page's Content-Security-Policy forbids eval, which Playwright's string
    `wait_for_function` needs; with the CSP in force, CSP violations show up as console errors."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("the playwright python package is not installed (pip install -e '.[dev]')")
    async with async_playwright() as p:
        try:
            browser = await p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        except Exception as e:  # playwright raises its own Error types for a browser that will not start
            pytest.skip(f"playwright could not start {exe}: {str(e).splitlines()[0]}")
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=bypass_csp)
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("dialog", lambda d: errors.append(f"dialog: {d.message}"))
            page.on("response", lambda r: errors.append(f"HTTP {r.status} for {r.url}") if r.status >= 400 else None)
            yield page, errors
        finally:
            await browser.close()


async def text(page, selector: str) -> str:
    return (await page.text_content(selector) or "").strip()


async def test_dashboard_shows_live_training_without_reload(tmp_path):
    async with running_coordinator(tmp_path, "run.max_steps=6") as (coord, url), chromium_page(bypass_csp=True) as (page, errors):
        navigations: list[str] = []
        page.on("framenavigated", lambda f: navigations.append(f.url) if f == page.main_frame else None)
        await page.goto(url + "/dashboard")
        await page.wait_for_function("document.getElementById('conn').className === 'live'", timeout=10_000)
        # Before any node joins: step 0, an empty node table that says so, no reward points yet.
        assert await text(page, "#step") == "0"
        assert await page.locator("#nodes tbody tr[data-node-id]").count() == 0
        assert "no node has joined yet" in await text(page, "#nodes tbody")
        assert await page.locator("#reward circle").count() == 0
        await page.evaluate("window.__sameDocument = true")

        workers = [start_worker(tmp_path, f"w{i}", coord, url) for i in range(2)]
        try:
            # The page polls by itself: the node rows appear and the step / accepted count climb.
            await page.wait_for_function(
                "document.querySelectorAll('#nodes tbody tr[data-node-id]').length === 2"
                " && Number(document.getElementById('step').textContent) >= 3"
                " && Number(document.getElementById('accepted').textContent.replace(/,/g, '')) > 0",
                timeout=45_000, polling=200)
            assert not coord.training.error
            step_seen = int(await text(page, "#step"))
            await page.wait_for_function(f"Number(document.getElementById('step').textContent) > {step_seen}",
                                         timeout=30_000, polling=200)
            later = int(await text(page, "#step"))
            assert step_seen < later <= coord.published_step

            # Rows are the real nodes, keyed by their public keys, showing their short ids.
            ids = {n.identity.public_hex for n, _ in workers}
            rows = page.locator("#nodes tbody tr[data-node-id]")
            assert {await rows.nth(i).get_attribute("data-node-id") for i in range(2)} == ids
            shown = {(await rows.nth(i).locator("td").first.text_content()).strip() for i in range(2)}
            assert shown == {i[:8] for i in ids}
            # The reward curve has one point per trained step the page has seen.
            assert await page.locator("#reward circle").count() >= later
            # Every accepted rollout shown was counted by the coordinator (the page may lag by a poll).
            accepted = int((await text(page, "#accepted")).replace(",", ""))
            assert 0 < accepted <= coord.ledger.counts()["accepted_rollouts"]
            assert await page.evaluate("window.__sameDocument") is True
        finally:
            await stop_workers(*workers)
        assert navigations == [url + "/dashboard"], f"the page navigated again: {navigations}"
        assert errors == [], errors

        # When the coordinator goes away the page says so instead of freezing on stale numbers.
        await page.route("**/v1/status", lambda route: route.abort())
        await page.wait_for_function("document.getElementById('conn').className === 'down'", timeout=5_000)
        assert "disconnected" in await text(page, "#conn")
        assert all("Failed to load resource" in e for e in errors), errors  # only the aborted polls


async def test_dashboard_renders_node_supplied_strings_as_text(tmp_path):
    """Node ids, states and rejection reasons end up in /v1/status; a hostile string must show up as
    literal text and never become markup. The real status document is fetched and then tampered.
    The page's own CSP stays in force here (it allows inline handlers, so it is not what stops this:
    the rendering code is), and a page that violates its CSP would log console errors."""
    # one process: what the page does with hostile strings does not depend on where training runs (~8 CPU-s less)
    async with running_coordinator(tmp_path, "server.engine_process=false") as (coord, url), \
            chromium_page(bypass_csp=False) as (page, errors):
        async def tamper(route):
            response = await route.fetch()
            doc = await response.json()
            doc["run_id"] = HOSTILE
            doc["nodes"] = [{"node_id": HOSTILE, "short_id": HOSTILE, "state": HOSTILE, "policy_step": HOSTILE,
                             "tokens_per_s": 1.5, "accepted": 3, "rejected": 1, "reputation": 0.25,
                             "last_seen_ms": 0}]
            doc["nodes_by_state"] = {HOSTILE: 1}
            doc["verification"]["rejected_by_reason"] = {HOSTILE: 1}
            doc["recent_rejections"] = [{"at_ms": 0, "node": HOSTILE, "reason": HOSTILE,
                                         "prompt_id": None, "sample_index": None}]
            await route.fulfill(response=response, json=doc)

        await page.route("**/v1/status", tamper)
        await page.goto(url + "/dashboard")
        await page.wait_for_selector("#conn.live", timeout=10_000)
        await page.wait_for_selector("#nodes tbody tr[data-node-id]", timeout=5_000)
        await asyncio.sleep(0.3)
        assert await page.evaluate("window.__pwned") is None
        assert await page.locator("main img, main script, header img").count() == 0
        assert HOSTILE in await text(page, "#nodes tbody")
        assert HOSTILE in await text(page, "#rejections tbody")
        assert HOSTILE in await text(page, "#verif tbody")
        assert HOSTILE in await text(page, "#runid")
        # The state goes into a class name too: only its letters survive there.
        cls = await page.locator("#nodes tbody .pill").get_attribute("class")
        assert cls.split() == ["pill", "s-imgsrcxonerrorwindowpwnedscriptwindowpwnedscript"]
        assert errors == [], errors
