"""In-process worker nodes against a real coordinator (see coordinator_harness)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.integration.coordinator_harness import REPO


def worker_config(tmp: Path, name: str, *extra: str):
    from node.config import load_config

    return load_config(REPO / "configs/local.toml", [f"worker.storage_dir={tmp / name}",
                                                      "worker.heartbeat_seconds=0.5", *extra])


def start_worker(tmp: Path, name: str, coord, url: str, *extra: str):
    from node.worker.node import WorkerNode
    from protocol.identity import Identity

    node = WorkerNode(worker_config(tmp, name, *extra), url, Identity.generate(),
                      coordinator_key=coord.identity.public_hex)
    return node, asyncio.create_task(node.run(), name=f"worker-{name}")


async def wait_for(pred, timeout: float, what: str, coord=None) -> None:
    t0 = time.monotonic()
    while not pred():
        if coord is not None and coord.training.error:
            raise AssertionError(f"training failed: {coord.training.error}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


async def stop_workers(*pairs) -> None:
    for node, _ in pairs:
        node.stop()
    results = await asyncio.gather(*(t for _, t in pairs), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
