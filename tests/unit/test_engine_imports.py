"""The API process of `server.engine_process = true` never imports torch (docs/ARCHITECTURE.md, "Processes"):
every module it loads to serve HTTP, run the scheduler, take submissions and talk to the engine, imported in a
fresh interpreter, leaves torch (and transformers) out of sys.modules. The engine module itself does import
them: the check would notice if the list below stopped meaning anything.

tests/integration/test_engine_process.py checks the running process too (no libtorch mapped in it)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

API_SIDE = ["node.coordinator.main", "node.coordinator.app", "node.coordinator.service",
            "node.coordinator.engine_client", "node.coordinator.engine_channel", "node.coordinator.intake",
            "node.coordinator.verification", "node.coordinator.status", "node.coordinator.run_model"]


def loaded_after_import(modules: list[str]) -> dict:
    code = ("import json, sys\n"
            f"for m in {modules!r}: __import__(m)\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_api_side_of_the_coordinator_imports_no_torch():
    assert loaded_after_import(API_SIDE) == {"torch": False, "transformers": False}


def test_the_engine_side_does_import_torch():
    assert loaded_after_import(["node.coordinator.engine"])["torch"] is True
