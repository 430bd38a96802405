"""Attacks at the coordinator's intake (real verification, honest rollouts from the real backend):
replays, re-signed rollouts of another node, a stale step claimed as fresh, and a ban after
repeated failures. The per-rollout attack matrix lives in test_verify_matrix*.py."""
import asyncio
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, running_coordinator

pytestmark = pytest.mark.timeout(240)


def backend_at(coord, step: int):
    from node.worker.backends.transformers_backend import TransformersBackend
    from node.trainer.model import load_model
    from protocol.checkpoint import load_payload

    b = TransformersBackend(load_model(coord.model_dir))
    b.load_state_dict(load_payload(coord.publisher.payload_path(step)), step)
    return b


def honest_rollouts(backend, assignment: dict, eos: int) -> list[dict]:
    from node.worker.backends.base import GenRequest

    reqs = [GenRequest(p["prompt_ids"], seed) for p in assignment["prompts"] for seed in p["seeds"]]
    s = assignment["sampling"]
    results = backend.generate(reqs, temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_tokens"],
                               eos_token_id=eos)
    out, it = [], iter(results)
    for p in assignment["prompts"]:
        for j in range(len(p["seeds"])):
            r = next(it)
            out.append({"prompt_id": p["prompt_id"], "sample_index": j, "completion_ids": r.completion_ids,
                        "logprobs": r.logprobs, "finish_reason": r.finish_reason, "commitment": r.commitment})
    return out


async def test_replay_resign_and_foreign_rollouts(tmp_path):
    async with running_coordinator(tmp_path) as (coord, base):
        async with aiohttp.ClientSession() as s:
            a, b = RawNode(base, s), RawNode(base, s)
            await a.post("/v1/join", {})
            await b.post("/v1/join", {})
            backend = backend_at(coord, 0)
            _, wa = await a.post("/v1/work", {"policy_step": 0})
            _, wb = await b.post("/v1/work", {"policy_step": 0})
            ra = honest_rollouts(backend, wa, coord.eos_token_id)
            # B submits A's rollouts (re-signed with B's key) as the answer to B's own assignment
            st, res = await b.post("/v1/submit", {"assignment_id": wb["assignment_id"], "policy_step": 0, "rollouts": ra})
            assert st == 200 and res["accepted"] == []
            assert {r["reason"] for r in res["rejected"]} == {"unknown_prompt"}  # other prompts, other seeds
            # ... or to A's assignment, signed by B
            st, err = await b.post("/v1/submit", {"assignment_id": wa["assignment_id"], "policy_step": 0, "rollouts": ra})
            assert st == 403 and err["error"] == "not_your_assignment"
            # A's honest submission is accepted; the same signed request replayed is refused (401), and a
            # re-signed copy is a duplicate (409)
            import json

            body = json.dumps({"assignment_id": wa["assignment_id"], "policy_step": 0, "rollouts": ra}).encode()
            h = a.headers("POST", "/v1/submit", body)
            st, res = await a.post("/v1/submit", body=body, headers=h)
            assert st == 200 and len(res["accepted"]) == len(ra), res["rejected"]
            st, err = await a.post("/v1/submit", body=body, headers=h)
            assert st == 401 and err["error"] == "replay"
            st, err = await a.post("/v1/submit", body=body)
            assert st == 409 and err["error"] == "duplicate"
            # B relabels A's rollouts with the prompt ids of a new assignment of its own (other seeds):
            # the replay catches it
            _, wb = await b.post("/v1/work", {"policy_step": 0})
            relabel = {pa["prompt_id"]: pb["prompt_id"] for pa, pb in zip(wa["prompts"], wb["prompts"])}
            forged = [dict(r, prompt_id=relabel[r["prompt_id"]]) for r in ra]
            st, res = await b.post("/v1/submit", {"assignment_id": wb["assignment_id"], "policy_step": 0,
                                                  "rollouts": forged})
            assert st == 200 and res["accepted"] == []
            assert any(r["reason"].startswith("verify_") for r in res["rejected"]), res["rejected"]


async def test_stale_step_claimed_as_fresh_is_rejected_and_cheater_banned(tmp_path):
    async with running_coordinator(tmp_path, "verification.reputation_penalty=0.4") as (coord, base):
        async with aiohttp.ClientSession() as s:
            honest, cheat = RawNode(base, s), RawNode(base, s)
            await honest.post("/v1/join", {})
            await cheat.post("/v1/join", {})
            old = backend_at(coord, 0)
            # train one step with honest rollouts so that θ_1 exists
            while coord.published_step < 1:
                st, w = await honest.post("/v1/work", {"policy_step": 0})
                if st == 204:
                    await asyncio.sleep(0.1)
                    continue
                st, res = await honest.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 0,
                                                           "rollouts": honest_rollouts(old, w, coord.eos_token_id)})
                assert st == 200 and not res["rejected"], res["rejected"]
            t0 = time.monotonic()
            while coord.published_step < 1 and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            # the cheater generates with θ_0 but claims θ_1 (fresh): the replay against θ_1 catches it
            statuses = []
            for _ in range(4):
                st, w = await cheat.post("/v1/work", {"policy_step": 1})
                if st == 403:
                    statuses.append(403)
                    break
                if st == 204:
                    await asyncio.sleep(0.1)
                    continue
                st, res = await cheat.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 1,
                                                          "rollouts": honest_rollouts(old, w, coord.eos_token_id)})
                statuses.append(st)
                if st == 200:
                    assert res["accepted"] == [] and res["rejected"]
                    assert all(r["reason"].startswith("verify_") or r["reason"] == "group_rejected"
                               for r in res["rejected"])
            assert 403 in statuses  # banned after repeated failures
            st, err = await cheat.post("/v1/work", {"policy_step": 1})
            assert st == 403 and err["error"] == "banned"
            node = coord.ledger.node(cheat.pub)
            assert node["banned"] == 1 and node["accepted"] == 0
            reasons = coord.status()["verification"]["rejected_by_reason"]
            assert any(k.startswith("verify_") for k in reasons), reasons
