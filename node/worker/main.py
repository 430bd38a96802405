"""`prime-node join --coordinator URL [--coordinator-key HEX] [--key KEYFILE] [--set a.b=v ...]`."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from node.config import load_config
from node.logs import setup_logging
from node.worker.node import WorkerNode
from protocol.identity import Identity, public_key_arg

log = logging.getLogger("prime_node.worker")


async def run_worker(cfg, url: str, identity: Identity, coordinator_key: str | None, status_line: bool) -> None:
    node = WorkerNode(cfg, url, identity, coordinator_key=coordinator_key, status_line=status_line)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.stop)
    await node.run()


def cmd_join(args) -> int:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.server.log_format)
    coordinator_key = public_key_arg("--coordinator-key", args.coordinator_key) if args.coordinator_key else None
    key_path = Path(args.key) if args.key else Path(cfg.worker.storage_dir) / "node.key"
    identity, created = Identity.load_or_create(key_path)
    if created:
        print(f"created node key {key_path} (node id {identity.node_id[:16]}…)", file=sys.stderr)
    asyncio.run(run_worker(cfg, args.coordinator, identity, coordinator_key, sys.stderr.isatty()))
    return 0
