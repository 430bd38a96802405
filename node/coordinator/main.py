"""`prime-node coordinator --config FILE [--set a.b=v ...]`."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from pathlib import Path

from node.config import load_config
from node.coordinator.app import start_server
from node.coordinator.service import Coordinator
from node.lifecycle import STOP_GRACE_S, run_async
from node.logs import setup_logging
from protocol.identity import Identity

log = logging.getLogger("prime_node.coordinator")


def coordinator_identity(storage_dir: Path) -> Identity:
    ident, created = Identity.load_or_create(storage_dir / "coordinator.key")
    if created:
        log.info("created coordinator key %s", storage_dir / "coordinator.key")
    return ident


async def serve(cfg, *, ready_file: Path | None = None, stop: asyncio.Event | None = None) -> int:
    """Run until `stop` is set (cmd_coordinator sets it on SIGTERM/SIGINT/SIGHUP, node/lifecycle.py), then
    stop the HTTP server and the coordinator (training thread, ledger)."""
    stop = asyncio.Event() if stop is None else stop
    storage = Path(cfg.storage.dir)
    storage.mkdir(parents=True, exist_ok=True)
    identity = coordinator_identity(storage)
    coord = Coordinator(cfg, identity)
    # A stop asked while the coordinator starts (its engine process restores the run: tens of seconds on a busy
    # box) ends the start instead of waiting it out and meeting node/lifecycle.py's deadline (exit 143).
    starting = asyncio.ensure_future(start_server(coord, cfg.server.host, cfg.server.port))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done() and coord.engine is not None:  # one process: its restore thread can't be cut short
        log.info("stop asked while starting: stopping before serving")
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await coord.stop()
        return 1 if coord.failure is not None else 0
    runner, port = await starting
    # Everything built so far (modules, pydantic schemas, the run's tokenizer, the ledger's caches) lives as long
    # as the process: out of the collector's sight it is not walked again by each full collection, a pass that
    # holds the GIL throughout (a 131-192 ms gen2 pass as the first submissions came in at 1,000 nodes:
    # docs/BENCHMARKS.md, "Training in its own process").
    gc.collect()
    gc.freeze()
    url = f"http://{cfg.server.host}:{port}"
    print(f"coordinator listening on {url}", flush=True)
    print(f"  dashboard:       {url}/dashboard", flush=True)
    print(f"  coordinator key: {identity.public_hex}", flush=True)
    print(f"  join with:       prime-node join --coordinator {url} --coordinator-key {identity.public_hex}",
          flush=True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": url, "key": identity.public_hex, "pid_time": time.time()}))
        tmp.replace(ready_file)
    failed = asyncio.create_task(coord.supervisor.wait_failed())  # a dead task or thread (supervisor.py)
    if cfg.server.exit_on_failure:
        failed.add_done_callback(lambda _: stop.set())
    try:
        await stop.wait()
    finally:
        log.info("stopping coordinator")
        failed.cancel()
        await runner.cleanup()
        await coord.stop()
    return 1 if coord.failure is not None else 0


def cmd_coordinator(args) -> int:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.server.log_format)
    ready = getattr(args, "ready_file", None)
    stop = asyncio.Event()
    # No cancellation: the coordinator's stop (training thread, then the ledger) runs to its end, or the
    # deadline ends the process with the committed ledger on disk. The deadline leaves the training thread
    # the server.stop_timeout_s it was given, and the rest of the stop a few seconds after that.
    grace = max(STOP_GRACE_S, cfg.server.stop_timeout_s + 5.0)
    return run_async("coordinator", lambda: serve(cfg, ready_file=Path(ready) if ready else None, stop=stop),
                     stop.set, cancel_after_s=None, grace_s=grace)
