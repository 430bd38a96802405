"""A real end-to-end checkpoint round trip, used by `make demo` until the swarm exists.

Step 0 is packed full, step 1 as an xor-delta after a small change; both directories are served by a
real aiohttp server on 127.0.0.1 (ephemeral port) at the coordinator's paths, verified through the URL
as a worker would, and step 1 is unpacked from its delta and compared bit for bit.
`CheckpointServer` is a minimal read-only server for those paths (tests and the demo share it).
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from protocol.checkpoint import (CheckpointError, DirShardReader, load_manifest, parse_shard_index,
                                 read_manifest_bytes)


class CheckpointServer:
    """Serve `{step: ckpt_dir}` as GET /v1/checkpoints/{step}/manifest and /shards/{i}, in its own thread.

    Shard indexes come through `parse_shard_index` and files through `DirShardReader`, so a request can
    never name a file outside a checkpoint. Use as a context manager; `url(step)` gives the base URL.
    """

    def __init__(self, checkpoints: dict[int, Path], host: str = "127.0.0.1"):
        self.checkpoints = {int(k): Path(v) for k, v in checkpoints.items()}
        self.host = host
        self.port: int | None = None
        self.requests = 0
        self._manifests: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def url(self, step: int) -> str:
        return f"http://{self.host}:{self.port}/v1/checkpoints/{step}"

    async def _handle(self, request):
        from aiohttp import web

        self.requests += 1
        try:
            step = int(request.match_info["step"])
        except ValueError:
            raise web.HTTPNotFound() from None
        ckpt = self.checkpoints.get(step)
        if ckpt is None:
            return web.json_response({"error": "not_found", "detail": f"no checkpoint for step {step}"}, status=404)
        try:
            if "index" not in request.match_info:
                return web.Response(body=read_manifest_bytes(ckpt), content_type="application/json")
            manifest = self._manifests.get(step)
            if manifest is None:  # parsed once per step, not on every shard request
                manifest = self._manifests[step] = load_manifest(ckpt)
            index = parse_shard_index(request.match_info["index"], manifest.num_shards)
            return web.Response(body=DirShardReader(ckpt, manifest)(index), content_type="application/octet-stream")
        except CheckpointError as e:
            status = 404 if e.code in ("missing_shard", "shard_index") else 400
            return web.json_response({"error": e.code, "detail": e.detail}, status=status)

    async def _serve(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/checkpoints/{step}/manifest", self._handle)
        app.router.add_get("/v1/checkpoints/{step}/shards/{index}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced by __enter__ instead of dying silently in the thread
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    def __enter__(self) -> "CheckpointServer":
        self._thread = threading.Thread(target=self._run, name="checkpoint-server", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or self.port is None:
            raise RuntimeError(f"checkpoint server did not start: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)


def _small_model_state(seed: int = 0) -> dict:
    """A few MB of bf16 weights with LLM-like shapes (embedding tied to the LM head), std 0.02."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden, vocab, layers = 256, 2048, 2
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden, hidden)),
                            ("self_attn.v_proj.weight", (hidden, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (4 * hidden, hidden)), ("mlp.up_proj.weight", (4 * hidden, hidden)),
                            ("mlp.down_proj.weight", (hidden, 4 * hidden))):
            state[p + name] = torch.randn(*shape, generator=g) * 0.02
        state[p + "input_layernorm.weight"] = torch.ones(hidden)
    state["model.norm.weight"] = torch.ones(hidden)
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied, as in small Qwen/Llama models
    return state


def _small_update(state: dict, lr: float = 1e-4, seed: int = 1) -> dict:
    """One AdamW-like step: every fp32 master weight moves by ~lr, then is cast back to bf16."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue
        master = t.float()
        master -= lr * torch.sign(torch.randn(master.shape, generator=g))  # Adam's first step is lr * sign(g)
        out[name] = master.to(torch.bfloat16)
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def run_checkpoint_roundtrip(workdir: str | Path, *, verbose: bool = True, shard_size: int = 256 * 1024) -> dict[str, Any]:
    """Pack step 0 (full) and 1 (xor-delta), serve, verify over HTTP, unpack the delta, compare bits."""
    import torch

    from protocol.checkpoint import load_payload, pack_checkpoint, unpack_checkpoint
    from protocol.identity import Identity
    from verify.checkpoint import verify_checkpoint_url

    def say(text: str) -> None:
        if verbose:
            print(text, file=sys.stderr)

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    key = Identity.generate()
    trusted = {key.public_hex}
    state0 = _small_model_state()
    state1 = _small_update(state0)
    summary: dict[str, Any] = {"signer": key.public_hex}

    t = time.perf_counter()
    m0 = pack_checkpoint(state0, workdir / "ckpt-0", identity=key, step=0, run_id="demo", shard_size=shard_size,
                         payload_out=workdir / "payload-0.safetensors")
    t_pack0 = time.perf_counter() - t
    t = time.perf_counter()
    m1 = pack_checkpoint(state1, workdir / "ckpt-1", identity=key, step=1, run_id="demo", parent=m0,
                         base_payload=workdir / "payload-0.safetensors", shard_size=shard_size)
    t_pack1 = time.perf_counter() - t
    for m, secs in ((m0, t_pack0), (m1, t_pack1)):
        say(f"packed {m.describe()} in {secs * 1000:.0f} ms (ratio {m.total_size / m.compressed_size:.2f}x)")

    with CheckpointServer({0: workdir / "ckpt-0", 1: workdir / "ckpt-1"}) as server:
        t = time.perf_counter()
        r0 = verify_checkpoint_url(server.url(0), trusted)
        r1 = verify_checkpoint_url(server.url(1), trusted, parent=m0, base=workdir / "payload-0.safetensors")
        t_verify = time.perf_counter() - t
        summary["http_requests"] = server.requests
        summary["server"] = f"{server.host}:{server.port}"
    for r in (r0, r1):
        say(f"{r.source}: {r.summary()}")
        if not r.ok:
            raise CheckpointError(r.codes[0], f"demo checkpoint failed verification: {r.failures[0]}")

    t = time.perf_counter()
    unpack_checkpoint(workdir / "ckpt-0", workdir / "model-0", trusted_keys=trusted)
    unpack_checkpoint(workdir / "ckpt-1", workdir / "model-1", trusted_keys=trusted, base=workdir / "model-0",
                      previous=m0)
    t_unpack = time.perf_counter() - t
    restored = load_payload(workdir / "model-1" / "model.safetensors")
    bit_exact = set(restored) == set(state1) and all(
        torch.equal(restored[k].view(torch.uint8), state1[k].view(torch.uint8)) for k in state1)
    tied = restored["lm_head.weight"] is restored["model.embed_tokens.weight"]
    say(f"unpacked step 1 from its delta: bit-exact={bit_exact}, tied weights restored={tied}")
    if not bit_exact:
        raise CheckpointError("payload_hash", "demo: unpacked step 1 differs from the packed state")
    summary.update({
        "raw_bytes": m0.total_size, "shards": m0.num_shards,
        "full_compressed_bytes": m0.compressed_size, "delta_compressed_bytes": m1.compressed_size,
        "full_ratio": round(m0.total_size / m0.compressed_size, 3),
        "delta_ratio": round(m1.total_size / m1.compressed_size, 3),
        "pack_full_s": round(t_pack0, 4), "pack_delta_s": round(t_pack1, 4),
        "verify_http_s": round(t_verify, 4), "unpack_s": round(t_unpack, 4),
        "payload_verified": r0.payload_verified and r1.payload_verified,
        "bit_exact": bit_exact, "tied_weights_restored": tied,
        "parent_hash": m1.parent,
    })
    return summary


def cmd_checkpoint_demo(args) -> int:
    import tempfile

    workdir = getattr(args, "workdir", None)
    with tempfile.TemporaryDirectory(prefix="prime-node-ckpt-demo-") as tmp:
        summary = run_checkpoint_roundtrip(workdir or tmp)
    print(json.dumps(summary, indent=2))
    return 0
