"""The API process of `server.engine_process = true` never imports torch (docs/ARCHITECTURE.md, "Processes"):
every module it loads to serve HTTP, run the scheduler, take submissions and talk to the engine, imported in a
fresh interpreter, leaves torch (and transformers) out of sys.modules. The engine module itself does import
them: the check would notice if the list below stopped meaning anything.

At run time the API process still imports torch, through transformers' tokenizer loading: the strict xfail
below says so, and fails (XPASS) once that is no longer true."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.xfail(strict=True, reason="transformers 5 imports torch when it loads a tokenizer "
                                       "(configuration_utils -> generation -> torch): the API process needs the "
                                       "run's tokenizer, so it still imports torch at run time (it runs nothing of "
                                       "it); a tokenizer loaded without transformers is the step left")
def test_the_api_process_loads_the_run_model_without_torch(tmp_path):
    """What the API process loads at run time besides its modules: the run's model files and tokenizer
    (node/coordinator/run_model.py; the tiny model is built in a child process with server.engine_process)."""
    code = ("import json, sys\n"
            "from pathlib import Path\n"
            "from node.config import load_config\n"
            "from node.coordinator.run_model import load_run_model\n"
            f"cfg = load_config('configs/local.toml', ['storage.dir={tmp_path}', 'server.engine_process=true'])\n"
            f"load_run_model(cfg, Path({str(tmp_path)!r}))\n"
            "print(json.dumps({'torch': 'torch' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch": False}
