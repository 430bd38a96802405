"""Bodies of real sizes arriving the way TCP delivers them: in pieces, over time.

A signed request body or a response is only usable whole: one `StreamReader.read(n)` returns what has
arrived so far, so a 3 MB submission or a join response carrying a multi-MB tokenizer.json used to be
cut (401 bad_signature, "invalid RunSpec ... EOF"). Every test here runs real aiohttp servers on
127.0.0.1 and sends real bytes; the last two are the realistic profile (100k-token BPE, 8 x 16 x 512).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.integration.coordinator_harness import RawNode, running_coordinator

pytestmark = pytest.mark.timeout(300)

MB = 1024 * 1024
BPE_VOCAB = 100_352  # >= 100k tokens, a multiple of 256 (the sampler's block size)


# -- helpers ------------------------------------------------------------------------------------------
async def post_in_pieces(base: str, path: str, headers: dict, body: bytes, *, pieces: int, pause: float,
                         chunked: bool) -> tuple[int, dict]:
    """POST over a raw socket: the body in `pieces` writes `pause` seconds apart, with Content-Length or
    chunked transfer encoding. Returns (status, JSON body)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
            "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    size = -(-len(body) // pieces)
    for i in range(pieces):
        part = body[i * size:(i + 1) * size]
        writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
        await writer.drain()
        if i < pieces - 1:
            await asyncio.sleep(pause)
    if chunked:
        writer.write(b"0\r\n\r\n")
    await writer.drain()
    raw = await reader.read()  # Connection: close, so the answer ends at EOF
    writer.close()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, json.loads(payload)


async def post_streamed(session: aiohttp.ClientSession, url: str, headers: dict, body: bytes,
                        *, piece: int = 256 * 1024) -> tuple[int, dict]:
    """POST with aiohttp from an async generator: chunked transfer encoding, no Content-Length."""
    async def gen():
        for i in range(0, len(body), piece):
            yield body[i:i + piece]

    async with session.post(url, data=gen(), headers=headers) as r:
        assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
        return r.status, await r.json()


def padded_work_body(size: int) -> bytes:
    """A /v1/work body of exactly `size` bytes: valid JSON with one field the endpoint does not know."""
    head, tail = b'{"policy_step":0,"pad":"', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


# -- the shared reader ----------------------------------------------------------------------------------
async def test_read_bounded_reads_to_eof_and_stops_past_the_limit():
    from node.aio import read_bounded

    stream = asyncio.StreamReader()

    async def feed(data: bytes, pieces: int):
        size = -(-len(data) // pieces)
        for i in range(pieces):
            await asyncio.sleep(0.05)
            stream.feed_data(data[i * size:(i + 1) * size])
        stream.feed_eof()

    data = bytes(random.Random(0).randbytes(3 * MB))
    feeder = asyncio.create_task(feed(data, 7))
    assert await read_bounded(stream, len(data)) == data  # exactly at the limit: whole
    await feeder

    stream = asyncio.StreamReader()
    stream.feed_data(data)
    stream.feed_eof()
    assert await read_bounded(stream, 1000) is None
    # it consumed limit + 1 bytes, no more
    assert await stream.read() == data[1001:]


# -- server side: signed request bodies -----------------------------------------------------------------
async def test_signed_body_arriving_in_pieces_is_accepted(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node, other = RawNode(base, s), RawNode(base, s)
            join = json.dumps({"node": {"name": "slow-link", "backend": "transformers"}}).encode()
            # two pieces 1 s apart (Content-Length) and three pieces (chunked), concurrently
            (st, spec), (st_other, spec_other) = await asyncio.gather(
                post_in_pieces(base, "/v1/join", node.headers("POST", "/v1/join", join), join,
                               pieces=2, pause=1.0, chunked=False),
                post_in_pieces(base, "/v1/join", other.headers("POST", "/v1/join", join), join,
                               pieces=3, pause=0.5, chunked=True))
            assert (st, st_other) == (200, 200), (spec, spec_other)
            assert spec["node_id"] == node.pub and spec_other["node_id"] == other.pub
            work = b'{"policy_step": 0}'
            st, assignment = await post_in_pieces(base, "/v1/work", node.headers("POST", "/v1/work", work), work,
                                                  pieces=2, pause=0.5, chunked=False)
            assert st == 200, assignment
            assert assignment["batch_step"] == 1 and assignment["prompts"]
            # the same body sent whole still works, and a body changed in transit still fails
            st, _ = await node.post("/v1/work", body=work)
            assert st in (200, 204)
            h = node.headers("POST", "/v1/work", work)
            st, err = await post_in_pieces(base, "/v1/work", h, b'{"policy_step": 1}', pieces=2, pause=0.3,
                                           chunked=False)
            assert st == 401 and err["error"] == "bad_signature"


async def test_multi_mb_signed_body_is_verified_and_the_limit_gives_413(tmp_path):
    limit = 4 * MB
    async with running_coordinator(tmp_path, "verification.fraction=0", f"server.max_body_bytes={limit}") as (_, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            st, _ = await node.post("/v1/join", {})  # an unknown key is refused before its body is read
            assert st == 200
            url = base + "/v1/work"
            big = padded_work_body(3 * MB)
            # ~3 MB, signed correctly: the signature holds, then the endpoint refuses the unknown field
            for send in ("whole", "chunked", "pieces"):
                h = node.headers("POST", "/v1/work", big)
                if send == "whole":
                    st, err = await node.post("/v1/work", body=big, headers=h)
                elif send == "chunked":
                    st, err = await post_streamed(s, url, h, big)
                else:
                    st, err = await post_in_pieces(base, "/v1/work", h, big, pieces=4, pause=0.3, chunked=False)
                assert st == 400, (send, st, err)
                assert err["error"] == "malformed" and "pad" in err["detail"], (send, err)
            # exactly the limit is still read (and refused for its content); one byte more is 413
            at_limit = padded_work_body(limit)
            st, err = await post_streamed(s, url, node.headers("POST", "/v1/work", at_limit), at_limit)
            assert st == 400 and err["error"] == "malformed"
            over = padded_work_body(limit + 1)
            h = node.headers("POST", "/v1/work", over)
            st, err = await node.post("/v1/work", body=over, headers=h)  # Content-Length: refused up front
            assert st == 413 and err["error"] == "too_large" and str(limit + 1) in err["detail"]
            st, err = await post_streamed(s, url, node.headers("POST", "/v1/work", over), over)  # no length
            assert st == 413 and err["error"] == "too_large"
            far_over = padded_work_body(3 * limit)
            st, err = await post_streamed(s, url, node.headers("POST", "/v1/work", far_over), far_over)
            assert st == 413 and err["error"] == "too_large"
            # the server is still fine afterwards
            st, spec = await node.post("/v1/join", {})
            assert st == 200 and spec["node_id"] == node.pub


# -- client side: responses -----------------------------------------------------------------------------
async def serve(routes: dict) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def slow_body(data: bytes, *, pieces: int, pause: float, with_length: bool):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "application/octet-stream"
        if with_length:
            resp.content_length = len(data)
        await resp.prepare(request)
        size = -(-len(data) // pieces)
        for i in range(pieces):
            await resp.write(data[i * size:(i + 1) * size])
            await asyncio.sleep(pause)
        await resp.write_eof()
        return resp
    return handler


async def test_client_reads_multi_mb_responses_whole_and_refuses_above_its_limit():
    from node.worker.client import Unreachable, read_limited
    from node.worker.sources import HttpSource, SourceError

    rng = random.Random(1)
    data = rng.randbytes(5 * MB)
    manifest = json.dumps({"pad": "".join(rng.choices(string.ascii_letters, k=3 * MB))}).encode()
    runner, base = await serve({
        "/pieces-length": slow_body(data, pieces=5, pause=0.2, with_length=True),
        "/pieces-chunked": slow_body(data, pieces=5, pause=0.2, with_length=False),
        "/v1/checkpoints/3/manifest": slow_body(manifest, pieces=3, pause=0.2, with_length=False),
        "/v1/checkpoints/4/manifest": slow_body(b"x" * (8 * MB + 1), pieces=2, pause=0.1, with_length=False),
    })
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/pieces-length", "/pieces-chunked"):
                async with s.get(base + path) as r:
                    got = await read_limited(r, 6 * MB)
                assert len(got) == len(data) and hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
                # above the client's limit: its error, with or without Content-Length
                async with s.get(base + path) as r:
                    with pytest.raises(Unreachable, match="limit"):
                        await read_limited(r, 4 * MB)
                async with s.get(base + path) as r:  # the exact size is within a limit of that size
                    assert len(await read_limited(r, len(data))) == len(data)
            # the same reader behind the checkpoint sources (the worker's fetcher and the relay)
            src = HttpSource(base, "relay", s)
            assert await src.manifest(3) == manifest
            with pytest.raises(SourceError, match="limit"):
                await src.manifest(4)
    finally:
        await runner.cleanup()


# -- the realistic profile ----------------------------------------------------------------------------
def _corpus(n_words: int, seed: int = 0) -> list[str]:
    """Distinct made-up words: BPE merges them until each is one token, so the vocabulary can grow
    past 100k (a natural-language corpus of this size would stop far earlier)."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices(string.ascii_lowercase, k=rng.randint(5, 9))) for _ in range(n_words)})
    return [" ".join(words[i:i + 1000]) for i in range(0, len(words), 1000)]


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (hidden 64, 2 layers, head size 32 like the demo model) with a byte-level BPE tokenizer
    of 100,352 tokens, trained here on a generated corpus (nothing downloaded)."""
    from node.trainer.model import build_tiny_model_dir
    from node.trainer.tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer(_corpus(100_000), BPE_VOCAB)
    assert len(tok) == BPE_VOCAB
    return build_tiny_model_dir(tmp_path_factory.mktemp("bpe-model"), hidden_size=64, layers=2, heads=2,
                                tokenizer=tok)


async def test_join_response_carries_the_multi_mb_tokenizer(tmp_path, bpe_model_dir):
    from tokenizers import Tokenizer

    from node.worker.client import CoordinatorClient
    from protocol import messages as M
    from protocol.identity import Identity

    tokenizer_json = (bpe_model_dir / "tokenizer.json").read_text()
    assert len(tokenizer_json) > 4 * MB
    async with running_coordinator(tmp_path, f"model.path={bpe_model_dir}", "verification.fraction=0") as (coord, base):
        assert coord.vocab_size == BPE_VOCAB
        async with aiohttp.ClientSession() as s:
            spec = await CoordinatorClient(base, Identity.generate(), s).join(M.NodeInfo(name="t"))
    assert spec.tokenizer_files["tokenizer.json"] == tokenizer_json
    tok = Tokenizer.from_str(spec.tokenizer_files["tokenizer.json"])
    assert tok.get_vocab_size() == BPE_VOCAB
    assert spec.model_config_json["vocab_size"] == BPE_VOCAB and spec.eos_token_id == coord.eos_token_id


REAL_RUN = ("run.batch_prompts=8", "run.group_size=16", "run.prompts_per_assignment=8")


def record_submission_sizes(coord) -> list[int]:
    """Bytes of each submission body as the worker's client sends it (CoordinatorClient._signed:
    json.dumps of the request's model_dump), observed where the coordinator receives it."""
    sizes: list[int] = []
    receive = coord.submit

    async def submit(node_id, req):
        sizes.append(len(json.dumps(req.model_dump()).encode()))
        return await receive(node_id, req)

    coord.submit = submit
    return sizes


async def join_response_bytes(base: str) -> int:
    """Size of a join response, read whole by plain aiohttp."""
    async with aiohttp.ClientSession() as s:
        headers = RawNode(base, s).headers("POST", "/v1/join", b"{}")
        async with s.post(base + "/v1/join", data=b"{}", headers=headers) as r:
            body = await r.read()
            assert r.status == 200
    return len(body)


# Tokens per completion in the run with a real worker. The profile's length is 512, but with a
# 100k-token vocabulary, on 2 CPU cores, decoding, verifying and training cost about 3-5, 4 and 7 ms
# per token (measured), so 2 steps of 8 x 16 x 512 tokens would take about half an hour: the real
# worker runs the profile with short completions, and the next test sends the full-length bodies.
REAL_WORKER_MAX_TOKENS = 16


@pytest.mark.slow
async def test_realistic_profile_real_worker_joins_and_trains(tmp_path, bpe_model_dir):
    """A real worker (transformers backend, CPU) joins a run whose tokenizer is a 100k-token BPE (the join
    response is several MB), generates 8 prompts x 16 samples per assignment, every rollout is verified,
    and the trainer takes 2 steps with no rejection."""
    from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

    t0 = time.monotonic()
    async with running_coordinator(
            tmp_path, f"model.path={bpe_model_dir}", *REAL_RUN, f"sampling.max_tokens={REAL_WORKER_MAX_TOKENS}",
            "verification.fraction=1.0", "run.max_steps=2",
            # a random 100k-vocabulary model samples at mean logprob ~ -ln(100352) = -11.5, which the
            # gibberish filter (< -10) drops, and a run with every group dropped never steps
            'trainer.filters.enabled=["repetition"]') as (coord, url):
        sizes = record_submission_sizes(coord)
        join_bytes = await join_response_bytes(url)
        assert join_bytes > 4 * MB
        worker = start_worker(tmp_path, "w", coord, url, "worker.device=cpu", "worker.backend=transformers")
        await wait_for(lambda: coord.published_step >= 2, 240, "2 trainer steps", coord)
        await stop_workers(worker)
        status = coord.status()
        steps = coord.ledger.steps()
    elapsed = time.monotonic() - t0
    assert [r.step for r in steps][:3] == [0, 1, 2]
    assert all(r.metrics["groups"] == 8 for r in steps[1:3]), [r.metrics for r in steps]
    v = status["verification"]
    assert v["rejected"] == 0 and v["rejected_by_reason"] == {}, v
    assert v["accepted"] >= 2 * 8 * 16
    (node,) = [n for n in status["nodes"] if n["accepted"]]  # the other one only measured the join
    assert node["accepted"] >= 2 * 8 * 16 and node["rejected"] == 0
    assert len(sizes) >= 2
    print(f"\nrealistic profile, real worker: {elapsed:.0f} s; join response {join_bytes} bytes; submission "
          f"bodies {sorted(set(sizes))} bytes (8 x 16 x {REAL_WORKER_MAX_TOKENS} tokens)")


@pytest.mark.slow
async def test_realistic_profile_full_length_submissions_accepted(tmp_path, bpe_model_dir):
    """8 prompts x 16 samples x 512 tokens per submission, over real HTTP with signed requests, on
    the 100k-vocabulary run: every rollout is accepted."""
    import torch

    from verify.commitment import make_commitment

    async with running_coordinator(tmp_path, f"model.path={bpe_model_dir}", *REAL_RUN, "sampling.max_tokens=512",
                                   "verification.fraction=0") as (coord, base):
        rng = random.Random(0)
        gen = torch.Generator().manual_seed(0)
        # realistic content: ids across the whole vocabulary, full-precision logprobs, real commitments
        commitments = [make_commitment(torch.randn(512, 64, generator=gen)) for _ in range(4)]
        sizes = []
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            st, _ = await node.post("/v1/join", {})
            assert st == 200
            # Three assignments on θ_0 (the k = 2 window is batches 1-3; the trainer drops these random-model
            # groups as gibberish, so the scheduler may hand out batch 1 again).
            for _ in range(3):
                st, work = await node.post("/v1/work", {"policy_step": 0})
                assert st == 200 and work["batch_step"] in (1, 2, 3)
                assert len(work["prompts"]) == 8 and all(len(p["seeds"]) == 16 for p in work["prompts"])
                rollouts = [{"prompt_id": p["prompt_id"], "sample_index": j,
                             "completion_ids": [rng.randrange(5, BPE_VOCAB) for _ in range(512)],
                             "logprobs": [-rng.uniform(9.0, 14.0) for _ in range(512)],
                             "finish_reason": "length", "commitment": commitments[j % 4]}
                            for p in work["prompts"] for j in range(16)]
                body = json.dumps({"assignment_id": work["assignment_id"], "policy_step": 0,
                                   "rollouts": rollouts}).encode()
                sizes.append(len(body))
                st, res = await node.post("/v1/submit", body=body)
                assert st == 200, res
                assert len(res["accepted"]) == 8 * 16 and res["rejected"] == []
        status = coord.status()
    assert status["verification"]["accepted"] == 3 * 8 * 16 and status["verification"]["rejected"] == 0
    assert min(sizes) > 2 * MB
    print(f"\nfull-length submission bodies (8 x 16 x 512 tokens): {sizes} bytes")
