"""Admission and run binding against a live coordinator (docs/PROTOCOL.md, "Admission" and "Signed
requests"): a new key pays a proof of work in an open run, allowlist and token runs admit only whom they
should, joins per address are limited, and a request captured from one run is refused by a coordinator of
another."""
from __future__ import annotations

import hashlib
import itertools
import json
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, running_coordinator

pytestmark = pytest.mark.timeout(120)


POW_LOG2_N = 4  # a tiny scrypt N: the rules are under test here, the cost in bench/pow_cost.py


def pow_digest(public_hex: str, run_id: str, nonce: bytes) -> bytes:
    """Written from docs/PROTOCOL.md ("Admission"): scrypt(raw public key || run_id bytes || nonce bytes, salt, N, r = 8, p = 1)."""
    return hashlib.scrypt(bytes.fromhex(public_hex) + run_id.encode() + nonce, salt=b"prime-node/join-pow/scrypt-v1",
                          n=2**POW_LOG2_N, r=8, p=1, dklen=32)


def solves(public_hex: str, nonce_hex: str, bits: int, run_id: str = "local-demo") -> bool:
    """Whether the nonce's digest has `bits` leading zero bits."""
    return int.from_bytes(pow_digest(public_hex, run_id, bytes.fromhex(nonce_hex)), "big") >> (256 - bits) == 0


def pow_nonce(public_hex: str, run_id: str, bits: int) -> str:
    """A nonce whose digest has `bits` leading zero bits."""
    for i in itertools.count():
        if solves(public_hex, nonce := i.to_bytes(8, "big").hex(), bits, run_id):
            return nonce


async def test_open_run_new_key_pays_a_proof_of_work(tmp_path):
    async with running_coordinator(tmp_path, "admission.pow_bits=10", f"admission.pow_log2_n={POW_LOG2_N}") \
            as (coord, base):
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/status") as r:
                status = await r.json()
            assert status["run_id"] == "local-demo" and status["admission"] == {"mode": "open", "pow_bits": 10,
                                                                                  "pow_log2_n": POW_LOG2_N}
            node = RawNode(base, s)
            st, body = await node.post("/v1/join", {})
            assert (st, body["error"]) == (403, "pow_required")
            wrong = next(n for n in (f"{i:016x}" for i in itertools.count())
                         if pow_digest(node.pub, "local-demo", bytes.fromhex(n))[0] != 0)
            st, body = await node.post("/v1/join", {"pow": wrong})
            assert (st, body["error"]) == (403, "bad_pow")
            # another key's solution is worth nothing. One key in 2^10 solves the same nonce by chance (it failed a CI
            # run once): the other key is drawn again until it does not, so that the test says what it means
            solution = pow_nonce(node.pub, "local-demo", 10)
            other = RawNode(base, s)
            while solves(other.pub, solution, 10):
                other = RawNode(base, s)
            st, body = await other.post("/v1/join", {"pow": solution})
            assert (st, body["error"]) == (403, "bad_pow")
            st, _ = await node.post("/v1/join", {"pow": solution})
            assert st == 200
            st, _ = await node.post("/v1/join", {})  # a known key re-joins without paying again
            assert st == 200


async def test_allowlist_run(tmp_path):
    async with aiohttp.ClientSession() as s:
        listed = RawNode("", s)
        async with running_coordinator(tmp_path, "admission.mode=allowlist",
                                       f'admission.allowlist=["{listed.pub}"]') as (coord, base):
            listed.base = base
            st, _ = await listed.post("/v1/join", {})
            assert st == 200
            st, body = await RawNode(base, s).post("/v1/join", {})
            assert (st, body["error"]) == (403, "not_allowlisted")


async def test_token_run(tmp_path):
    from protocol.admission import make_join_token
    from protocol.identity import Identity

    async with running_coordinator(tmp_path, "admission.mode=token") as (coord, base):
        now_ms = int(time.time() * 1000)
        token = make_join_token(coord.identity, "local-demo", now_ms + 60_000)
        async with aiohttp.ClientSession() as s:
            a, b = RawNode(base, s), RawNode(base, s)
            st, body = await a.post("/v1/join", {})
            assert (st, body["error"]) == (403, "token_required")
            st, _ = await a.post("/v1/join", {"token": token})
            assert st == 200
            st, _ = await a.post("/v1/join", {"token": token})  # the same key again: fine
            assert st == 200
            st, body = await b.post("/v1/join", {"token": token})  # a token admits one new key
            assert (st, body["error"]) == (403, "token_used")
            expired = make_join_token(coord.identity, "local-demo", now_ms - 1)
            st, body = await b.post("/v1/join", {"token": expired})
            assert (st, body["error"]) == (403, "token_expired")
            forged = make_join_token(Identity.generate(), "local-demo", now_ms + 60_000)
            st, body = await b.post("/v1/join", {"token": forged})
            assert (st, body["error"]) == (403, "bad_token")


async def test_joins_per_address_are_limited(tmp_path):
    async with running_coordinator(tmp_path, "admission.joins_per_address_per_minute=5") as (coord, base):
        async with aiohttp.ClientSession() as s:
            statuses = [(await RawNode(base, s).post("/v1/join", {}))[0] for _ in range(8)]
    assert statuses[:5] == [200] * 5 and statuses[5:] == [429] * 3


async def test_a_request_captured_from_one_run_is_refused_by_another(tmp_path):
    """Before run binding, a signed request was valid at any coordinator for 60 s."""
    async with running_coordinator(tmp_path / "a", "run.run_id=run-a") as (_, base_a), \
            running_coordinator(tmp_path / "b", "run.run_id=run-b") as (_, base_b):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base_a, s, run_id="run-a")
            body = json.dumps({}).encode()
            captured = node.headers("POST", "/v1/join", body)
            node.base = base_b
            st, res = await node.post("/v1/join", body=body, headers=captured)
            assert (st, res["error"]) == (401, "wrong_run")
            relabelled = {**captured, "X-Prime-Run": "run-b"}  # the run id is inside the signed string
            st, res = await node.post("/v1/join", body=body, headers=relabelled)
            assert (st, res["error"]) == (401, "bad_signature")
            node.base = base_a
            st, _ = await node.post("/v1/join", body=body, headers=captured)
            assert st == 200


async def test_worker_nodes_join_with_a_proof_of_work_and_with_a_token(tmp_path):
    from protocol.admission import make_join_token
    from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

    async with running_coordinator(tmp_path / "open", "admission.pow_bits=4", "admission.pow_log2_n=10",
                                   "run.max_steps=1") as (coord, url):
        node = start_worker(tmp_path, "pow", coord, url)
        await wait_for(lambda: node[0].stats.accepted > 0, 120, "the node's first accepted rollouts", coord)
        await stop_workers(node)
    async with running_coordinator(tmp_path / "tok", "admission.mode=token", "run.max_steps=1") as (coord, url):
        token = make_join_token(coord.identity, "local-demo", int(time.time() * 1000) + 600_000)
        node = start_worker(tmp_path, "tok", coord, url, f"worker.join_token={token}")
        await wait_for(lambda: node[0].stats.accepted > 0, 120, "the node's first accepted rollouts", coord)
        await stop_workers(node)
