"""`prime-node join --coordinator URL [--coordinator-key HEX] [--key KEYFILE] [--set a.b=v ...]`."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from node.config import load_config
from node.lifecycle import run_async
from node.logs import setup_logging
from node.worker.node import WorkerNode
from protocol.identity import Identity, public_key_arg

log = logging.getLogger("prime_node.worker")


def cmd_join(args) -> int:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.server.log_format)
    coordinator_key = public_key_arg("--coordinator-key", args.coordinator_key) if args.coordinator_key else None
    key_path = Path(args.key) if args.key else Path(cfg.worker.storage_dir) / "node.key"
    identity, created = Identity.load_or_create(key_path)
    if created:
        print(f"created node key {key_path} (node id {identity.node_id[:16]}…)", file=sys.stderr)
    node = WorkerNode(cfg, args.coordinator, identity, coordinator_key=coordinator_key,
                      status_line=sys.stderr.isatty())
    # a signal stops the node's loops; an await that watches no stop event (a read from a coordinator that
    # never answers) is cancelled lifecycle's few seconds later
    return run_async("join", node.run, node.stop)
