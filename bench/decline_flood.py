"""Ledger size under a flood of declined work (issue #25, finding 7): N work -> decline cycles against a real
coordinator on 127.0.0.1 (signed clients over HTTP, coordinator_harness), then the ledger's rows and file size
before and after one prune (the coordinator prunes every 5 s on its own; here it is called once at the end so
the numbers are the worst case between two prunes).

Worst case for the ledger: run.decline_hold_seconds=0 and no reputation penalty (an attacker with as many
keys as it likes: nothing but the ledger stops the cycle), the demo's config otherwise (configs/local.toml:
2 prompts of 8 samples per assignment).

    .venv/bin/python bench/decline_flood.py --declines 10000 --keys 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator  # noqa: E402


def ledger_numbers(coord) -> dict:
    q = lambda sql: coord.ledger._exec(sql).fetchone()[0]  # noqa: E731
    return {"assignments": q("SELECT COUNT(*) FROM assignments"),
            "assignment_bytes": q("SELECT COALESCE(SUM(LENGTH(prompts)), 0) FROM assignments"),
            "rejections": q("SELECT COUNT(*) FROM rejections"),
            "requeued": q("SELECT COUNT(*) FROM requeued_prompts"),
            "pages_in_use_bytes": q("PRAGMA page_count") * q("PRAGMA page_size") - q("PRAGMA freelist_count")
            * q("PRAGMA page_size"),
            "file_bytes": (coord.root / "ledger.sqlite").stat().st_size}


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with running_coordinator(Path(tmp), "verification.fraction=0", "verification.new_node_fraction=0",
                                       "run.decline_hold_seconds=0", "verification.reputation_penalty=0",
                                       "verification.decline_penalty=0", "server.rate_limit_per_second=100000",
                                       "server.rate_limit_burst=100000",
                                       "admission.joins_per_address_per_minute=100000") as (coord, base):
            before = ledger_numbers(coord)
            async with aiohttp.ClientSession() as s:
                keys = [RawNode(base, s) for _ in range(args.keys)]
                for k in keys:
                    await k.post("/v1/join", {})
                rng = random.Random(0)
                done, payload = 0, 0

                async def cycle(k: RawNode, count: int) -> None:
                    nonlocal done, payload
                    for _ in range(count):
                        st, w = await k.post("/v1/work", {"policy_step": 0})
                        assert st == 200, (st, w)
                        payload += len(json.dumps([{k: p[k] for k in ("prompt_id", "prompt_ids", "seeds")}
                                                   for p in w["prompts"]]))
                        st, _ = await k.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": 1,
                                                            "rollouts": fake_rollouts(w, coord.eos_token_id,
                                                                                      coord.vocab_size, rng)})
                        assert st == 409
                        done += 1

                t0 = time.monotonic()
                await asyncio.gather(*(cycle(k, args.declines // args.keys) for k in keys))
                dt = time.monotonic() - t0
            flooded = ledger_numbers(coord)
            t1 = time.monotonic()
            pruned = await coord._prune_ledger()
            prune_s = time.monotonic() - t1
            after = ledger_numbers(coord)
            print(f"{done} declines from {args.keys} keys in {dt:.1f} s ({done / dt:.0f}/s); prune took "
                  f"{prune_s * 1000:.0f} ms: {pruned}")
            print(f"{'':>22} {'start':>12} {'after flood':>12} {'after prune':>12}")
            for key in before:
                print(f"{key:>22} {before[key]:>12,} {flooded[key]:>12,} {after[key]:>12,}")
            print(f"prompt payload an assignment row held for ever before the fix: {payload / done:.0f} bytes "
                  f"({payload:,} bytes for {done} declines)")
            print("rejections by reason:", coord.ledger.rejection_counts())
            res = Path(__file__).resolve().parent / "results" / "decline_flood.json"
            res.write_text(json.dumps({"declines": done, "keys": args.keys, "seconds": round(dt, 1),
                                       "prune_ms": round(prune_s * 1000, 1), "start": before, "after_flood": flooded,
                                       "after_prune": after, "payload_bytes_per_decline_before_fix": round(payload / done)},
                                      indent=2, default=str))
            print(f"wrote {res}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--declines", type=int, default=10_000)
    p.add_argument("--keys", type=int, default=8)
    asyncio.run(main(p.parse_args()))
