"""Models loaded by several threads at once stay whole (node/model_loading.py). transformers' from_pretrained
swaps PreTrainedModel.tie_weights and the default dtype while it runs; unserialized, four threads loading the
tiny (tied) model left tie_weights a no-op for the rest of the process and failed with "Cannot copy out of meta
tensor". Run in a subprocess: a failure would leave the test process's transformers broken for later tests."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, threading, torch
from transformers import PreTrainedModel
from node.trainer.model import build_tiny_model_dir, load_model
from node.worker.backends.transformers_backend import TransformersBackend

model_dir = build_tiny_model_dir(sys.argv[1])
tie_weights, errors, heads = PreTrainedModel.tie_weights, [], []

def load(dtype):
    try:
        for _ in range(4):
            m = load_model(model_dir, dtype=dtype) if dtype == "float32" else \\
                TransformersBackend(model_dir, dtype=dtype, device="cpu").model
            heads.append(m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr())
    except Exception as e:
        errors.append(repr(e)[:300])

threads = [threading.Thread(target=load, args=(d,)) for d in ("float32", "bfloat16") * 2]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
assert PreTrainedModel.tie_weights is tie_weights, "tie_weights left swapped for a no-op"
assert torch.get_default_dtype() == torch.float32, torch.get_default_dtype()
assert len(heads) == 16 and all(heads), heads
print("ok")
"""


def test_concurrent_loads_keep_weights_tied_and_the_default_dtype(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
