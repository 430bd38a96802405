"""Regenerate docs/dashboard.png from a real run: a coordinator and a few in-process workers on
127.0.0.1 (configs/local.toml), trained for a few steps, then the live /dashboard captured by a
headless Chromium driven through Playwright (no browser download: it uses the system's chromium).

    .venv/bin/python docs/tools/screenshot_dashboard.py [--workers 3] [--steps 8] [--out docs/dashboard.png]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


async def capture(workers: int, steps: int, out: Path, width: int, height: int) -> None:
    from playwright.async_api import async_playwright

    from node.config import load_config
    from node.coordinator.app import start_server
    from node.coordinator.service import Coordinator
    from node.worker.node import WorkerNode
    from protocol.identity import Identity

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = load_config(REPO / "configs/local.toml", [f"storage.dir={tmp / 'coord'}", f"run.max_steps={steps}"])
        coord = Coordinator(cfg, Identity.generate())
        runner, port = await start_server(coord, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        nodes = []
        for i in range(workers):
            wcfg = load_config(REPO / "configs/local.toml",
                               [f"worker.storage_dir={tmp / f'w{i}'}", "worker.heartbeat_seconds=0.5"])
            node = WorkerNode(wcfg, url, Identity.generate(), coordinator_key=coord.identity.public_hex)
            nodes.append((node, asyncio.create_task(node.run())))
        try:
            t0 = time.monotonic()
            while coord.published_step < steps:
                if coord.training.error:
                    raise SystemExit(f"training failed: {coord.training.error}")
                if time.monotonic() - t0 > 600:
                    raise SystemExit(f"only {coord.published_step} of {steps} steps after 600 s")
                await asyncio.sleep(0.5)
            print(f"{steps} steps in {time.monotonic() - t0:.1f} s")
            await asyncio.sleep(1.5)  # one more heartbeat round so every node reports the newest step
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                page = await browser.new_page(viewport={"width": width, "height": height})
                await page.goto(url + "/dashboard")
                await page.wait_for_function("document.querySelectorAll('#nodes tbody tr').length > 0")
                await page.wait_for_timeout(300)
                out.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(out), full_page=True)
                await browser.close()
            print(f"wrote {out}")
        finally:
            for node, _ in nodes:
                node.stop()
            await asyncio.gather(*(t for _, t in nodes), return_exceptions=True)
            await runner.cleanup()
            await coord.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "docs/dashboard.png")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=900)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(capture(a.workers, a.steps, a.out, a.width, a.height))


if __name__ == "__main__":
    main()
