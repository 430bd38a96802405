"""Order of the whole suite: test files longest first (tests/durations.py says why and how the table is made).

Only whole files move (a file's tests keep their order, so module-scoped fixtures and in-file sequences are
untouched); every xdist worker sorts its collection with the same table, so their collections stay identical.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.durations import TABLE

# Tiny demo models built once per machine and copied (node/coordinator/run_model.py, TINY_CACHE_ENV): every test
# coordinator of the engine-process layout (the default) would otherwise build its own in a child Python that
# imports torch and transformers, ~4-5 s each on 2 loaded cores. Inherited by the CLI coordinators tests start.
os.environ.setdefault("PRIME_NODE_TINY_MODEL_CACHE", str(Path(tempfile.gettempdir()) / f"prime-node-tiny-{os.getuid()}"))

NEW_FILE_S = 30.0  # a file the table does not know yet: among the long ones, as a new file is often an integration test


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        seconds: dict[str, float] = json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::")[0]
        return (-seconds.get(path, NEW_FILE_S), first_seen[path])

    items.sort(key=key)
