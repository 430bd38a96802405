"""A read-only aiohttp server (own thread, 127.0.0.1, ephemeral port) serving arbitrary checkpoint
directories at the coordinator's paths, so tests can serve tampered checkpoints to the URL verifier."""
from __future__ import annotations

import asyncio
import threading
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
