"""Attacks on the door and on declining work (issue #25, findings 1 and 7), against a live coordinator over
HTTP with real signed clients (coordinator_harness.RawNode, written from docs/PROTOCOL.md, "Signed requests").

1. One join token admitting many keys: the same signed token spelled another way (base64 padding, the
   standard alphabet, JSON whitespace, key order, unicode escapes, upper-case signature hex) verified and
   hashed differently, so each spelling admitted one more key.
7. Declining work for free: a submission with a policy step outside the window was refused (409) with no
   cost, its prompts re-queued at once and its assignment and rejection rows kept for ever, so one key
   could cycle work -> decline hundreds of times a second and grow the ledger without bound.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, running_coordinator

pytestmark = pytest.mark.timeout(180)


def respellings(token: str) -> dict[str, str]:
    """Other spellings of the same signed document, each one the old decoder accepted."""
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    doc = json.loads(raw)

    def enc(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    out = {
        "json_whitespace": enc(json.dumps(doc, sort_keys=True, indent=1).encode()),
        "key_order": enc(json.dumps(dict(reversed(list(doc.items()))), separators=(",", ":")).encode()),
        "unicode_escape": enc(raw.replace(b'"prime-node/', b'"\\u0070rime-node/')),
        "signature_upper_hex": enc(json.dumps({**doc, "signature": doc["signature"].upper()}, sort_keys=True,
                                              separators=(",", ":")).encode()),
    }
    if {"-", "_"} & set(token):
        out["standard_alphabet"] = base64.b64encode(raw).decode().rstrip("=")
    if len(token) % 4:
        out["padding"] = token + "=" * (-len(token) % 4)
    assert all(s != token for s in out.values())
    return out


async def test_one_join_token_admits_one_key_however_it_is_spelled(tmp_path):
    from protocol.admission import make_join_token

    async with running_coordinator(tmp_path, "admission.mode=token",
                                   "admission.joins_per_address_per_minute=1000") as (coord, base):
        # an expiry whose encoding needs padding (a document of 3n bytes needs none; one more digit changes that)
        expires = int(time.time() * 1000) + 600_000
        token = make_join_token(coord.identity, "local-demo", expires)
        while not len(token) % 4:
            expires = expires * 10 + 7
            token = make_join_token(coord.identity, "local-demo", expires)
        async with aiohttp.ClientSession() as s:
            first = RawNode(base, s)
            st, _ = await first.post("/v1/join", {"token": token})
            assert st == 200
            admitted = []
            for name, spelling in respellings(token).items():
                sybil = RawNode(base, s)
                st, body = await sybil.post("/v1/join", {"token": spelling})
                if st == 200:
                    admitted.append(name)
                else:
                    # refused as used (the same signed document) or as a spelling that is not the one
                    assert (st, body["error"]) in ((403, "token_used"), (403, "bad_token")), (name, st, body)
                assert (coord.ledger.node(sybil.pub) is None) == (st != 200)
            assert admitted == [], f"one token admitted {len(admitted) + 1} keys: {admitted}"
            # the one spelling still re-admits its own key, and admits nobody else
            st, _ = await first.post("/v1/join", {"token": token})
            assert st == 200
            st, body = await RawNode(base, s).post("/v1/join", {"token": token})
            assert (st, body["error"]) == (403, "token_used")


NO_REPLAY = ("verification.fraction=0", "verification.new_node_fraction=0")


async def take_work(node: RawNode, step: int) -> tuple[int, dict | None]:
    return await node.post("/v1/work", {"policy_step": step})


async def decline(node: RawNode, assignment: dict, claimed_step: int) -> tuple[int, dict]:
    """Answer an assignment with well-formed rollouts and a policy step outside the window: the coordinator
    declines it before looking at them."""
    import random

    from tests.integration.coordinator_harness import fake_rollouts

    rollouts = fake_rollouts(assignment, 2, 64, random.Random(0))
    return await node.post("/v1/submit", {"assignment_id": assignment["assignment_id"], "policy_step": claimed_step,
                                          "rollouts": rollouts})


async def test_cycling_work_and_declines_is_throttled_and_penalised(tmp_path):
    """One key took work and answered with a future policy step 400 times in 15 s, reputation unchanged.
    Now a declined assignment keeps its slot (run.decline_hold_seconds) and a step that was never published
    costs reputation_penalty: the key is stopped at max_assignments_per_node declines, then banned."""
    async with running_coordinator(tmp_path, *NO_REPLAY, "run.max_assignments_per_node=2",
                                   "verification.reputation_penalty=0.25") as (coord, base):
        async with aiohttp.ClientSession() as s:
            attacker = RawNode(base, s)
            assert (await attacker.post("/v1/join", {}))[0] == 200
            declined, refused = 0, []
            for _ in range(20):
                st, w = await take_work(attacker, 0)
                if st != 200:
                    refused.append((st, w["error"] if w else None))
                    continue
                st, err = await decline(attacker, w, claimed_step=coord.published_step + 1)
                assert (st, err["error"]) == (409, "stale_policy")
                declined += 1
            assert declined <= 2, f"{declined} work -> decline cycles from one key, none refused"
            assert refused and set(refused) == {(429, "too_many_assignments")}
            node = coord.ledger.node(attacker.pub)
            assert node.reputation == pytest.approx(1.0 - 0.25 * declined) and not node.banned

    # the slots come back after the hold; each never-published step claimed costs 0.25 until the key is banned
    async with running_coordinator(tmp_path / "b", *NO_REPLAY, "run.decline_hold_seconds=0.2",
                                   "verification.reputation_penalty=0.25") as (coord, base):
        async with aiohttp.ClientSession() as s:
            attacker = RawNode(base, s)
            await attacker.post("/v1/join", {})
            deadline = time.monotonic() + 60
            while not coord.ledger.node(attacker.pub).banned:
                assert time.monotonic() < deadline, "the key cycling declines was never banned"
                st, w = await take_work(attacker, 0)
                if st == 429:
                    await asyncio.sleep(0.05)  # the hold (0.2 s) is a clock: poll it
                    continue
                assert st == 200, w
                await decline(attacker, w, claimed_step=coord.published_step + 1)
            st, err = await take_work(attacker, 0)
            assert (st, err["error"]) == (403, "banned")
            assert coord.ledger.rejection_counts().get("stale_policy", 0) == 5  # 1.0 - 5 x 0.25 < 0


async def test_an_honest_stale_submission_costs_little_and_is_not_banned(tmp_path):
    """An honest node becomes stale when steps are published while it generates. Its decline costs
    verification.decline_penalty (0.02: two clean submissions pay it back) and one slot for the hold; it keeps
    its other slot and is never banned for it."""
    import random

    from tests.integration.coordinator_harness import fake_rollouts

    rng = random.Random(0)
    async with running_coordinator(tmp_path, *NO_REPLAY, "run.max_assignments_per_node=2") as (coord, base):
        async with aiohttp.ClientSession() as s:
            slow, fast = RawNode(base, s), RawNode(base, s)
            await slow.post("/v1/join", {})
            await fast.post("/v1/join", {})
            st, held = await take_work(slow, 0)
            assert st == 200
            deadline = time.monotonic() + 90
            while coord.published_step < 3:  # k = 2: theta_0 leaves the window of every open batch
                assert time.monotonic() < deadline, "the run did not reach step 3"
                step = coord.published_step
                st, w = await take_work(fast, step)
                if st in (204, 429):
                    await asyncio.sleep(0.1)
                    continue
                st, _ = await fast.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": step,
                                                       "rollouts": fake_rollouts(w, coord.eos_token_id,
                                                                                 coord.vocab_size, rng)})
                assert st == 200
            st, err = await slow.post("/v1/submit", {
                "assignment_id": held["assignment_id"], "policy_step": 0,
                "rollouts": fake_rollouts(held, coord.eos_token_id, coord.vocab_size, rng)})
            assert (st, err["error"]) == (409, "stale_policy")
            node = coord.ledger.node(slow.pub)
            assert node.reputation == pytest.approx(1.0 - 0.02) and not node.banned
            # it fetches the new step and goes on at once with its other slot
            st, w = await take_work(slow, coord.published_step)
            assert st in (200, 204), w
            st, err = await decline(slow, held, 3)
            assert (st, err["error"]) == (409, "declined")


async def test_declines_leave_a_bounded_ledger(tmp_path):
    """Every decline used to leave an assignment row (its prompts' tokens and seeds) and a rejection row for
    ever. Now a declined assignment's prompts are dropped at once, its row is deleted when its hold ends, and
    the rejections beyond the newest storage.keep_rejections are folded into per-reason totals. Worst case
    here: no hold and no penalty, so nothing but the ledger stops the cycle."""
    n = 120
    async with running_coordinator(tmp_path, *NO_REPLAY, "run.decline_hold_seconds=0",
                                   "verification.reputation_penalty=0", "storage.keep_rejections=20",
                                   "server.rate_limit_per_second=1000", "server.rate_limit_burst=1000",
                                   "admission.joins_per_address_per_minute=1000") as (coord, base):
        async with aiohttp.ClientSession() as s:
            keys = [RawNode(base, s) for _ in range(4)]
            for k in keys:
                await k.post("/v1/join", {})

            async def cycle(k: RawNode, count: int) -> None:
                for _ in range(count):
                    st, w = await take_work(k, 0)
                    assert st == 200, w
                    st, err = await decline(k, w, claimed_step=1)
                    assert st == 409, err

            await asyncio.gather(*(cycle(k, n // len(keys)) for k in keys))
            assert coord.ledger.rejection_counts() == {"stale_policy": n}

            def rows(table: str, where: str = "1") -> int:
                return coord.ledger._exec(f"SELECT COUNT(*) FROM {table} WHERE {where}").fetchone()[0]

            assert rows("assignments", "state = 'declined' AND prompts != '[]'") == 0  # payload dropped at once
            deadline = time.monotonic() + 30
            while rows("assignments") > 0 or rows("rejections") > 20:  # the expiry loop prunes every few s
                assert time.monotonic() < deadline, (rows("assignments"), rows("rejections"))
                await asyncio.sleep(0.2)
            assert coord.ledger.rejection_counts() == {"stale_policy": n}  # counted, not kept row by row
            assert len(coord.status()["recent_rejections"]) == 20
