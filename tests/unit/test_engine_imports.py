"""The API process of `server.engine_process = true` never imports torch (docs/ARCHITECTURE.md, "Processes"):
every module it loads to serve HTTP, run the scheduler, take submissions and talk to the engine, imported in a
fresh interpreter, leaves torch (and transformers) out of sys.modules. The engine module itself does import
them: the check would notice if the list below stopped meaning anything.

At run time the API process loads the run's model files and tokenizer too: transformers 5 imports torch to load
any tokenizer, so that layout loads it with node/trainer/light_tokenizer.py (tokenizers + jinja2; its parity with
transformers: tests/unit/test_light_tokenizer.py). The whole API process of a real coordinator that trained maps no
libtorch: tests/integration/test_engine_process.py."""
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


def test_the_api_process_loads_the_run_model_without_torch(tmp_path):
    """What the API process loads at run time besides its modules: the run's model files and tokenizer
    (node/coordinator/run_model.py; the tiny model is built in a child process with server.engine_process)."""
    code = ("import json, sys\n"
            "from pathlib import Path\n"
            "from node.config import load_config\n"
            "from node.coordinator.run_model import load_run_model\n"
            f"cfg = load_config('configs/local.toml', ['storage.dir={tmp_path}', 'server.engine_process=true'])\n"
            f"m = load_run_model(cfg, Path({str(tmp_path)!r}))\n"
            "from node.envs import encode_prompt\n"
            "ids = encode_prompt(m.tokenizer, m.task.sample(0, 0))\n"  # and uses the tokenizer as the API does
            "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules, "
            "'ids': len(ids), 'built': (Path(m.model_dir) / 'model.safetensors').is_file()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the tiny model was built (in a child process, with torch) and its prompts encoded, all without torch here
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] > 0 and got == {"torch": False, "transformers": False, "ids": got["ids"], "built": True}
