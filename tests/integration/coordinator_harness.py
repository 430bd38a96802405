"""A real coordinator on 127.0.0.1 (ephemeral port) for integration tests, plus a raw signed client
written from docs/PROTOCOL.md, "Signed requests" directly
(cryptography + hashlib), independent of the project's helpers."""
from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

REPO = Path(__file__).resolve().parents[2]


class RawNode:
    """Signs requests exactly as docs/PROTOCOL.md, "Signed requests" says (run-bound v2), nothing else.
    `run_id`: the run of configs/local.toml unless told otherwise (a client learns it from GET /v1/status)."""

    def __init__(self, base: str, session: aiohttp.ClientSession, run_id: str = "local-demo"):
        self.base, self.session, self.run_id = base, session, run_id
        self.key = Ed25519PrivateKey.generate()
        self.pub = self.key.public_key().public_bytes(serialization.Encoding.Raw,
                                                      serialization.PublicFormat.Raw).hex()

    def headers(self, method: str, path: str, body: bytes, *, ts: int | None = None, nonce: str | None = None):
        ts = str(int(time.time() * 1000) if ts is None else ts)
        nonce = nonce or os.urandom(16).hex()
        msg = "\n".join([method, path, ts, nonce, self.run_id, hashlib.sha256(body).hexdigest()]).encode()
        return {"X-Prime-Key": self.pub, "X-Prime-Timestamp": ts, "X-Prime-Nonce": nonce, "X-Prime-Run": self.run_id,
                "X-Prime-Signature": self.key.sign(msg).hex(), "Content-Type": "application/json"}

    async def post(self, path: str, payload=None, *, body: bytes | None = None, headers: dict | None = None):
        body = json.dumps(payload).encode() if body is None else body
        h = headers if headers is not None else self.headers("POST", path, body)
        async with self.session.post(self.base + path, data=body, headers=h) as r:
            raw = await r.read()
            try:
                data = json.loads(raw) if raw else None
            except ValueError:
                data = raw
            return r.status, data


# Settings every coordinator of the running test gets before its own `extra`: tests/conftest.py sets
# ("server.engine_process=false",) for the test modules it lists in ONE_PROCESS_MODULES (and says why), () otherwise.
PINNED: tuple[str, ...] = ()


def test_config(tmp: Path, *extra: str):
    from node.config import load_config

    # The demo's config with its warm start and evaluation off: the tests built on this harness are about an
    # untrained tiny model (test_eval.py turns both on for itself); `extra` comes last and wins.
    return load_config(REPO / "configs/local.toml", [f"storage.dir={tmp / 'coord'}", "trainer.warm_start_steps=0",
                                                     "eval.every_steps=0", *PINNED, *extra])


@asynccontextmanager
async def running_coordinator(tmp: Path, *extra: str):
    from node.coordinator.app import start_server
    from node.coordinator.service import Coordinator
    from protocol.identity import Identity

    coord = Coordinator(test_config(tmp, *extra), Identity.generate())
    runner, port = await start_server(coord, "127.0.0.1", 0)
    try:
        yield coord, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await coord.stop()


def fake_rollouts(assignment: dict, eos: int, vocab: int, rng) -> list[dict]:
    """Structurally valid rollouts (not from the model; their commitments are well-formed but commit to
    random states): for tests that switch verification off."""
    import torch

    from verify.commitment import make_commitment

    max_tokens = assignment["sampling"]["max_tokens"]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    out = []
    for p in assignment["prompts"]:
        for j, _ in enumerate(p["seeds"]):
            n = rng.randint(1, max_tokens - 1)
            ids = [rng.randrange(5, vocab) for _ in range(n)] + [eos]
            out.append({"prompt_id": p["prompt_id"], "sample_index": j, "completion_ids": ids,
                        "logprobs": [-rng.random() * 3 for _ in ids], "finish_reason": "stop",
                        "commitment": make_commitment(torch.randn(len(ids), 16, generator=gen))})
    return out
