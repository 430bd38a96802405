"""Contract tests of docs/PROTOCOL.md, "HTTP API" with a raw HTTP client: every status code and the happy path."""
import asyncio
import json
import random
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(180)


async def test_contract_status_codes(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0", "server.max_body_bytes=65536") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            # 403: unknown node on a non-join endpoint
            st, body = await node.post("/v1/work", {"policy_step": 0})
            assert st == 403 and body["error"] == "unknown_node"
            # happy path: join with {} -> run spec
            st, spec = await node.post("/v1/join", {})
            assert st == 200 and spec["node_id"] == node.pub and spec["async_level"] == 2
            assert spec["coordinator_key"] == coord.identity.public_hex and spec["current_step"] == 0
            # 401 bad signature
            body = b'{"policy_step":0}'
            h = node.headers("POST", "/v1/work", body)
            h["X-Prime-Signature"] = "00" * 64
            st, err = await node.post("/v1/work", body=body, headers=h)
            assert st == 401 and err["error"] == "bad_signature"
            # 401 body changed after signing
            h = node.headers("POST", "/v1/work", body)
            st, err = await node.post("/v1/work", body=b'{"policy_step":1}', headers=h)
            assert st == 401
            # 401 skewed clock
            h = node.headers("POST", "/v1/work", body, ts=int(time.time() * 1000) - 120_000)
            st, err = await node.post("/v1/work", body=body, headers=h)
            assert st == 401 and err["error"] == "clock_skew"
            # 200 then 401 replay of the very same request
            h = node.headers("POST", "/v1/work", body)
            st, work = await node.post("/v1/work", body=body, headers=h)
            assert st == 200 and work["batch_step"] == 1 and work["min_policy_step"] == 0
            st, err = await node.post("/v1/work", body=body, headers=h)
            assert st == 401 and err["error"] == "replay"
            # 400 malformed: not JSON, unknown field, wrong type, NaN
            for bad in (b"{", b'{"policy_step":0,"extra":1}', b'{"policy_step":"x"}', b'{"policy_step":NaN}'):
                st, err = await node.post("/v1/work", body=bad)
                assert st == 400 and err["error"] == "malformed", bad
            # 413: body over the limit
            big = b'{"policy_step":0,"pad":"' + b"x" * 70_000 + b'"}'
            st, err = await node.post("/v1/work", body=big)
            assert st == 413
            # submit: a valid submission is accepted per rollout
            rng = random.Random(0)
            rollouts = fake_rollouts(work, coord.eos_token_id, coord.vocab_size, rng)
            st, res = await node.post("/v1/submit", {"assignment_id": work["assignment_id"], "policy_step": 0,
                                                     "rollouts": rollouts})
            assert st == 200 and len(res["accepted"]) == len(rollouts) and res["rejected"] == []
            # 409 duplicate submission
            st, err = await node.post("/v1/submit", {"assignment_id": work["assignment_id"], "policy_step": 0,
                                                     "rollouts": rollouts})
            assert st == 409 and err["error"] == "duplicate"
            # 403 someone else's assignment; 404 unknown assignment
            other = RawNode(base, s)
            await other.post("/v1/join", {})
            st, err = await other.post("/v1/submit", {"assignment_id": work["assignment_id"], "policy_step": 0,
                                                      "rollouts": rollouts})
            assert st == 403 and err["error"] == "not_your_assignment"
            st, err = await other.post("/v1/submit", {"assignment_id": "nope", "policy_step": 0, "rollouts": rollouts})
            assert st == 404
            # per-rollout verdicts: bad rollouts are rejected with a reason, not a 4xx for the whole request
            st, work2 = await other.post("/v1/work", {"policy_step": 0})
            assert st == 200
            rs = fake_rollouts(work2, coord.eos_token_id, coord.vocab_size, rng)
            rs[0]["completion_ids"][0] = coord.vocab_size + 5
            rs[1]["finish_reason"] = "length"
            st, res = await other.post("/v1/submit", {"assignment_id": work2["assignment_id"], "policy_step": 0,
                                                      "rollouts": rs})
            assert st == 200
            reasons = {(r["prompt_id"], r["sample_index"]): r["reason"] for r in res["rejected"]}
            assert reasons[(rs[0]["prompt_id"], 0)] == "token_out_of_vocab"
            assert reasons[(rs[1]["prompt_id"], 1)] == "length_not_reached"
            # logprobs > 0 are malformed as a whole (schema)
            rs2 = [dict(r, logprobs=[0.5] * len(r["completion_ids"])) for r in rs[:1]]
            st, err = await other.post("/v1/submit", {"assignment_id": work2["assignment_id"], "policy_step": 0,
                                                      "rollouts": rs2})
            assert st == 400
            # 409 stale policy: train until step 3 is out, then θ_0 is outside every open batch's window (k = 2)
            await train_until(coord, other, 3, rng)
            st, err = await node.post("/v1/work", {"policy_step": 0})
            assert st == 409 and err["error"] == "stale_policy"
            st, err = await node.post("/v1/work", {"policy_step": 9})  # a conflict with the run, not bad syntax
            assert st == 409 and err["error"] == "unpublished_policy"
            # unsigned GETs: status, metrics, checkpoints, manifest, shards with Range, 404s
            async with s.get(base + "/v1/status") as r:
                assert r.status == 200 and (await r.json())["async_level"] == 2
            async with s.get(base + "/metrics") as r:
                text = await r.text()
                assert r.status == 200 and "prime_step" in text and "prime_rollouts_rejected" in text
            async with s.get(base + "/v1/checkpoints") as r:
                listing = await r.json()
                assert 0 in listing["steps"] and listing["newest"] >= 3
            async with s.get(base + "/v1/checkpoints/0/manifest") as r:
                manifest = await r.json()
                assert manifest["step"] == 0 and manifest["signer"] == coord.identity.public_hex
            z0 = manifest["shards"][0]["zsize"]
            async with s.get(base + "/v1/checkpoints/0/shards/0") as r:
                whole = await r.read()
                assert r.status == 200 and len(whole) == z0
            async with s.get(base + "/v1/checkpoints/0/shards/0", headers={"Range": "bytes=10-99"}) as r:
                assert r.status == 206 and await r.read() == whole[10:100]
                assert r.headers["Content-Range"] == f"bytes 10-99/{z0}"
            async with s.get(base + "/v1/checkpoints/0/shards/0", headers={"Range": f"bytes={z0 + 5}-"}) as r:
                assert r.status == 416
            for path in ("/v1/checkpoints/7/manifest", "/v1/checkpoints/0/shards/999", "/v1/checkpoints/..%2f/manifest",
                         "/v1/checkpoints/-1/manifest", "/nope"):
                async with s.get(base + path) as r:
                    assert r.status in (400, 404), path
                    assert (await r.json())["error"]
            async with s.get(base + "/dashboard") as r:
                assert r.status == 200 and "prime-node" in await r.text()


async def train_until(coord, node: RawNode, step: int, rng) -> None:
    """`node` works and submits (at the newest step) until the coordinator has published `step`."""
    deadline = time.monotonic() + 90
    while coord.published_step < step and time.monotonic() < deadline:
        held = coord.published_step
        st, w = await node.post("/v1/work", {"policy_step": held})
        if st == 204:
            await asyncio.sleep(0.1)
            continue
        assert st == 200, w
        rollouts = fake_rollouts(w, coord.eos_token_id, coord.vocab_size, rng)
        st, _ = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": held,
                                               "rollouts": rollouts})
        assert st == 200
    assert coord.published_step >= step


async def test_stale_policy_is_told_while_the_scheduler_has_not_heard_of_the_newest_step(tmp_path):
    """The training thread publishes a step; the scheduler hears of it on the loop's next turn and until then
    still holds the batch that made it, full. A node whose policy no open batch can use got 204 "no work now"
    through that batch (a CI run of test_contract_status_codes) and would keep asking with weights nobody can use;
    it is told 409 stale_policy, decided against the newest step. The moment is set up by hand: the scheduler one
    step behind, the newest step's batch full in it."""
    async with running_coordinator(tmp_path, "verification.fraction=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node, other = RawNode(base, s), RawNode(base, s)
            for n in (node, other):
                assert (await n.post("/v1/join", {}))[0] == 200
            await train_until(coord, other, 3, random.Random(1))
            sched, newest = coord.scheduler, coord.published_step
            sched.published_step = newest - 1
            sched.waiting_by_batch[newest] = sched.quota()
            st, err = await node.post("/v1/work", {"policy_step": newest - 3})  # k = 2: no batch from `newest` on
            assert st == 409 and err["error"] == "stale_policy", (st, err)


async def test_rate_limit_429(tmp_path):
    async with running_coordinator(tmp_path, "server.rate_limit_per_second=1", "server.rate_limit_burst=5") as (_, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            statuses = [(await node.post("/v1/join", {}))[0] for _ in range(10)]
            assert statuses[:5] == [200] * 5 and statuses[-1] == 429
            st, err = await node.post("/v1/heartbeat", {})
            assert st == 429 and err["error"] == "rate_limited"
            other = RawNode(base, s)  # the limit is per node
            assert (await other.post("/v1/join", {}))[0] == 200


async def test_zstd_bodies_are_signed_as_sent_bounded_and_the_only_encoding(tmp_path):
    """docs/PROTOCOL.md, "Signed requests": a body sent with `Content-Encoding: zstd` is signed as sent and
    decompressed only after its signature, into the content size its frame states, never past the body limit. The
    node's own client compresses a submission (16 rollouts of up to 512 tokens) when the coordinator's status lists
    zstd, and sends it plain to one that does not. No other encoding is decoded: aiohttp used to inflate gzip bodies,
    from anyone, before we saw them."""
    import gzip

    import zstandard

    from node.worker.client import CoordinatorClient
    from protocol import messages as M
    from protocol.identity import Identity

    limit = 1 << 20
    async with running_coordinator(tmp_path, "verification.fraction=0", "sampling.max_tokens=512",
                                   f"server.max_body_bytes={limit}") as (coord, base):
        sent: list[tuple[str, str | None, int]] = []  # (path, Content-Encoding, body bytes) of each request

        async def on_chunk(session, ctx, params):
            ctx.bytes = getattr(ctx, "bytes", 0) + len(params.chunk)

        async def on_end(session, ctx, params):
            sent.append((params.url.path, params.headers.get("Content-Encoding"), getattr(ctx, "bytes", 0)))

        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(on_chunk)
        trace.on_request_end.append(on_end)
        rng = random.Random(1)
        async with aiohttp.ClientSession(trace_configs=[trace]) as s:
            client = CoordinatorClient(base, Identity.generate(), s)
            assert (await client.run_info()).body_encodings == ["zstd"]
            await client.join(M.NodeInfo(name="z"))
            for advertised in (["zstd"], []):  # this coordinator, then as one that predates compressed bodies
                assert client.run is not None
                client.run = client.run.model_copy(update={"body_encodings": advertised})
                work = await client.work(0)
                assert isinstance(work, M.Assignment)
                rollouts = fake_rollouts(work.model_dump(), coord.eos_token_id, coord.vocab_size, rng)
                sub = M.SubmitRequest(assignment_id=work.assignment_id, policy_step=0,
                                      rollouts=[M.RolloutSubmission(**r) for r in rollouts])
                res = await client.submit(sub)
                assert len(res.accepted) == len(rollouts) and res.rejected == []
                raw = len(json.dumps(sub.model_dump()).encode())
                path, encoding, n = sent[-1]
                assert path == "/v1/submit" and raw > 64 * 1024
                if advertised:
                    assert encoding == "zstd" and n < raw / 1.3, (n, raw)
                else:
                    assert encoding is None and n == raw
            assert {e for p, e, _ in sent if p != "/v1/submit"} == {None}  # small bodies go as they are

            node = RawNode(base, s)
            assert (await node.post("/v1/join", {}))[0] == 200

            async def post(payload: bytes, encoding: str, *, signed: bytes | None = None):
                h = node.headers("POST", "/v1/work", payload if signed is None else signed)
                h["Content-Encoding"] = encoding
                return await node.post("/v1/work", body=payload, headers=h)

            work_req = b'{"policy_step":0}'
            st, work = await post(zstandard.ZstdCompressor().compress(work_req), "zstd")
            assert st == 200 and work["batch_step"] >= 1
            # a bomb: 1 KB of zstd that would inflate to 4 MiB, 4x the body limit
            bomb = zstandard.ZstdCompressor().compress(b'{"policy_step":0,"pad":"' + b" " * (4 << 20) + b'"}')
            st, err = await post(bomb, "zstd")
            assert len(bomb) < 2048 and st == 413 and err["error"] == "too_large"
            st, err = await post(b"not zstd at all", "zstd")
            assert st == 400 and err["error"] == "malformed"
            # a streamed frame that does not state its content size (and asks its decoder for a 128 MiB window)
            wide = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(window_log=27))
            cobj = wide.compressobj()
            st, err = await post(cobj.compress(work_req) + cobj.flush(), "zstd")
            assert st == 400 and err["error"] == "malformed" and "content size" in err["detail"], err
            # a frame that states less than it holds: zstd refuses it rather than write past the stated size
            honest = zstandard.ZstdCompressor().compress(b'{"policy_step":0,"pad":"' + b" " * 100_000 + b'"}')
            header = zstandard.get_frame_parameters(honest)
            assert header.content_size > 100_000
            lying = bytearray(honest)
            size_at = lying.find((header.content_size).to_bytes(4, "little"))
            assert size_at > 0
            lying[size_at:size_at + 4] = (1000).to_bytes(4, "little")
            st, err = await post(bytes(lying), "zstd")
            assert st == 400 and err["error"] == "malformed", err
            # signed over the inflated body instead of the bytes sent
            st, err = await post(zstandard.ZstdCompressor().compress(work_req), "zstd", signed=work_req)
            assert st == 401 and err["error"] == "bad_signature"
            # gzip, signed as sent or (as aiohttp's own inflating used to accept) over the inflated body
            for signed in (None, work_req):
                st, err = await post(gzip.compress(work_req), "gzip", signed=signed)
                assert st == 415 and err["error"] == "unsupported_encoding", (signed, st, err)


async def test_a_zstd_body_is_counted_in_the_body_budget_while_it_inflates(tmp_path):
    """A few hundred bytes of zstd may state megabytes: the stated size is reserved in the body budget (BodyBudget)
    while it decompresses, as if the body had been read so; over the budget it is 503 `busy`, not inflated."""
    import zstandard

    async with running_coordinator(tmp_path, "server.max_body_bytes_in_flight=262144") as (_, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            assert (await node.post("/v1/join", {}))[0] == 200
            for pad, status, code in ((400_000, 503, "busy"), (100_000, 400, "malformed")):
                body = zstandard.ZstdCompressor().compress(b'{"policy_step":0,"pad":"' + b" " * pad + b'"}')
                h = node.headers("POST", "/v1/work", body)
                h["Content-Encoding"] = "zstd"
                st, err = await node.post("/v1/work", body=body, headers=h)
                assert len(body) < 1024 and (st, err["error"]) == (status, code), (pad, st, err)


async def test_super_seeding_counts_from_the_end_of_the_first_copy(tmp_path):
    """A joined swarm node's signed shard request gets 429 `seeded` while another node's first copy is in
    flight and for `super_seed_seconds` after it completed; Range requests pass the same gate (the
    claimant's own resumption is served). Unsigned requests (relays, anyone) are served, and never hold a
    first copy: "X-Prime-Swarm: 1" alone used to claim every shard, over and over."""
    async with running_coordinator(tmp_path, "distribution.super_seed_seconds=1.0",
                                   "distribution.origin_upload_limit=100000") as (coord, base):
        path = "/v1/checkpoints/0/shards/0"
        url = base + path
        async with aiohttp.ClientSession() as s:
            a, b = RawNode(base, s), RawNode(base, s)
            for n in (a, b):
                assert (await n.post("/v1/join", {}))[0] == 200

            def signed(node, **extra):
                h = node.headers("GET", path, b"")
                del h["Content-Type"]
                return {**h, "X-Prime-Swarm": "1", **extra}

            async with s.get(base + "/v1/checkpoints/0/manifest") as r:
                zsize = (await r.json())["shards"][0]["zsize"]
            assert zsize > 150_000  # the first copy takes > 1.5 s under the cap: longer than the window
            # anonymous swarm requests are served and claim nothing
            async with s.get(url, headers={"X-Prime-Swarm": "1", "Range": "bytes=0-9"}) as r:
                assert r.status == 206
            async with s.get(url, headers=signed(b, Range="bytes=0-9")) as r:
                assert r.status == 206  # nothing is spreading yet

            async def first_copy():
                async with s.get(url, headers=signed(a)) as r:
                    assert r.status == 200
                    return await r.read(), time.monotonic()

            first = asyncio.create_task(first_copy())
            await asyncio.sleep(0.3)
            async with s.get(url, headers=signed(b)) as r:  # in flight: spreading
                assert r.status == 429 and (await r.json())["error"] == "seeded"
            async with s.get(url, headers=signed(b, Range="bytes=0-9")) as r:  # the same gate for a Range
                assert r.status == 429
            async with s.get(url, headers=signed(a, Range="bytes=0-9")) as r:
                assert r.status == 206  # the claimant's own resumption is served
            async with s.get(url, headers={"X-Prime-Swarm": "1", "Range": "bytes=0-9"}) as r:
                assert r.status == 206  # unsigned: served like any HTTP client
            data, done_at = await first
            assert len(data) == zsize
            c = RawNode(base, s)
            assert (await c.post("/v1/join", {}))[0] == 200
            async with s.get(url, headers=signed(c, Range="bytes=0-9")) as r:
                assert r.status == 429  # within the window after completion
            await asyncio.sleep(max(0.0, done_at + 1.1 - time.monotonic()))
            async with s.get(url, headers=signed(c)) as r:
                assert r.status == 200 and len(await r.read()) == zsize  # the window is over
            # a signature that does not verify is refused, not treated as anonymous
            bad = signed(b)
            bad["X-Prime-Signature"] = "00" * 64
            async with s.get(url, headers=bad) as r:
                assert r.status == 401


async def test_metrics_come_from_their_owners_not_from_building_a_status(tmp_path):
    """Before issue #28 the node and trainer gauges were set only as a side effect of building /v1/status, and
    /metrics built a status to refresh them. Now the components' own collectors are read at the scrape: a
    scrape builds no status and still counts the node that just joined; a status build sets no gauge."""
    async with running_coordinator(tmp_path, "verification.fraction=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            st, _ = await node.post("/v1/join", {})
            assert st == 200
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert coord._status is None  # no status was built for the scrape
            assert 'prime_nodes{state="joined"} 1.0' in text, [ln for ln in text.splitlines() if "nodes" in ln]
            assert "prime_trainer_busy_seconds" in text and "prime_trainer_idle_seconds" in text
            before = coord.metrics.render()
            coord.status()
            assert coord._status is not None
            # what a scrape reads changed only where time moved (the trainer's seconds), never by the build
            strip = [ln for ln in before.decode().splitlines() if not ln.startswith("prime_trainer_")
                     and not ln.startswith("prime_http_requests")]
            after = [ln for ln in coord.metrics.render().decode().splitlines()
                     if not ln.startswith("prime_trainer_") and not ln.startswith("prime_http_requests")]
            assert strip == after
