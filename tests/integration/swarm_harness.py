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


async def wait_for(pred, timeout: float, what: str, coord=None, workers=()) -> None:
    """Poll `pred` until true. Fails at once when training failed or one of `workers` ((node, task) pairs from
    start_worker) ended, and on timeout says where the run and each worker stood (a bare "timed out" in a CI log
    cannot tell a slow machine from a stuck one)."""
    t0 = time.monotonic()
    while not pred():
        if coord is not None and coord.training.error:
            raise AssertionError(f"training failed: {coord.training.error}")
        for node, task in workers:
            if task.done():
                error = None if task.cancelled() else task.exception()
                raise AssertionError(f"worker {node.root.name} ended ({error!r}) before {what}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}: {where(coord, workers)}")
        await asyncio.sleep(0.2)


def where(coord, workers) -> str:
    parts = [] if coord is None else [f"published step {coord.published_step}"]
    parts += [f"{node.root.name}: {node.state} on step {node.policy_step}, {node.stats.accepted} accepted, "
              f"{node.stats.rejected} rejected" for node, _ in workers]
    return "; ".join(parts)


async def stop_workers(*pairs) -> None:
    for node, _ in pairs:
        node.stop()
    results = await asyncio.gather(*(t for _, t in pairs), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
