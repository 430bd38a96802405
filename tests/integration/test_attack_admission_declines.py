"""Attacks on the door and on declining work (issue #25, findings 1 and 7), against a live coordinator over
HTTP with real signed clients (coordinator_harness.RawNode, written from DESIGN §4).

1. One join token admitting many keys: the same signed token spelled another way (base64 padding, the
   standard alphabet, JSON whitespace, key order, unicode escapes, upper-case signature hex) verified and
   hashed differently, so each spelling admitted one more key.
7. Declining work for free: a submission with a policy step outside the window was refused (409) with no
   cost, its prompts re-queued at once and its assignment and rejection rows kept for ever, so one key
   could cycle work -> decline hundreds of times a second and grow the ledger without bound.
"""
from __future__ import annotations

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
