"""Order of the whole suite: test files longest first (tests/durations.py says why and how the table is made).

Only whole files move (a file's tests keep their order, so module-scoped fixtures and in-file sequences are
untouched); every xdist worker sorts its collection with the same table, so their collections stay identical.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.durations import TABLE

# Tiny demo models built once per machine and copied (node/coordinator/run_model.py, TINY_CACHE_ENV): every test
# coordinator of the engine-process layout (the default) would otherwise build its own in a child Python that
# imports torch and transformers, ~4-5 s each on 2 loaded cores. Inherited by the CLI coordinators tests start.
os.environ.setdefault("PRIME_NODE_TINY_MODEL_CACHE", str(Path(tempfile.gettempdir()) / f"prime-node-tiny-{os.getuid()}"))

# The coordinator's layout in tests. The default, server.engine_process = true, costs every coordinator an engine
# process: a Python that imports torch + transformers and restores the run, ~8 s of CPU on 2 cores, where the
# one-process layout costs ~0.3 s once the test worker has imported torch (measured in this repository, 2026-11).
# The modules below build coordinators in this process to test the HTTP door, intake, attacks on the API, p2p and
# relays, none of which depends on where training runs: they pin one process (coordinator_harness.PINNED; a
# test's own settings still win). Everything else runs the default: training, status, evaluation, the verifier
# pool (both layouts), stopping, crashes, the CLI, the demo and the end-to-end swarms.
ONE_PROCESS_MODULES = frozenset(f"tests/{m}.py" for m in (
    "integration/test_admission", "integration/test_attack_admission_declines", "integration/test_attack_announcements",
    "integration/test_attack_connections", "integration/test_attack_hostile_relay", "integration/test_coordinator_api",
    "integration/test_coordinator_load", "integration/test_fair_work", "integration/test_fuzz_api",
    "integration/test_intake_attacks", "integration/test_lora_serving", "integration/test_p2p_holder_hint",
    "integration/test_p2p_http", "integration/test_p2p_swarm", "integration/test_reachability_join",
    "integration/test_real_sizes", "integration/test_relay", "integration/test_relay_hop", "integration/test_step_push",
    "integration/test_submit_overlap", "unit/test_idle_pacing"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the item's fixtures (a module-scoped coordinator too): its module's layout pin."""
    from tests.integration import coordinator_harness

    one = item.nodeid.split("::")[0] in ONE_PROCESS_MODULES
    coordinator_harness.PINNED = ("server.engine_process=false",) if one else ()


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


# Disk. A real-model training test writes up to ~5.5 GB of checkpoints and trainer snapshots (measured), and pytest
# keeps every tmp_path of a session until the session ends (then the last 3 sessions'): one CI run piled up >10 GB
# and a CI box ran out of space mid-lane. A passed test's tmp_path is removed as soon as the test ends; a failed
# one's is kept for reading (tmp_path_retention_policy = "failed" in pyproject.toml does the same for whole sessions).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, f"_prime_report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _drop_tmp_path_when_passed(request: pytest.FixtureRequest) -> Iterator[None]:
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    setup, call = (getattr(request.node, f"_prime_report_{w}", None) for w in ("setup", "call"))
    if tmp is not None and setup is not None and setup.passed and call is not None and call.passed:
        shutil.rmtree(tmp, ignore_errors=True)
