"""How long one uncached GET /v1/status takes to build as the ledger grows: 1k / 10k / 45k nodes
(45k: the number of keys one client joined at ~950/s before admission control), 1,000 published steps.

The target (#9): <= 50 ms at 10k nodes. The document counts all nodes in SQL and lists only the 200 most
recently seen; the HTTP routes (/v1/status, /metrics) rebuild it at most once a second.

Run: .venv/bin/python bench/status_scale.py  -> bench/results/status_scale.json
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def measure(n_nodes: int, n_steps: int, repeats: int = 7) -> dict:
    from node.config import load_config
    from node.coordinator.ledger import now_ms
    from node.coordinator.service import Coordinator
    from protocol.identity import Identity

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/local.toml", [f"storage.dir={tmp}", "run.max_steps=1"])
        coord = Coordinator(cfg, Identity.generate())
        await coord.start()
        try:
            t = now_ms()
            with coord.ledger.transaction() as db:
                db.executemany(
                    "INSERT INTO nodes(node_id, joined_ms, last_seen_ms, reputation, info, submissions, accepted, "
                    "tokens_per_s, state, policy_step) VALUES(?,?,?,?,?,?,?,?,?,?)",
                    [(os.urandom(32).hex(), t, t - (i % 120) * 1000, 1.0, "{}", i % 3, 16 * (i % 3), 10.0,
                      "generating" if i % 2 else "idle", 0) for i in range(n_nodes)])
                for step in range(1, n_steps + 1):
                    m = {"reward_mean": 0.1, "staleness_hist": {"0": 4, "1": 3, "2": 1}, "loss_tokens": 512}
                    db.execute("INSERT INTO steps(step, published_ms, manifest_hash, encoding, base_step, "
                               "compressed_bytes, metrics) VALUES(?,?,?,?,?,?,?)",
                               (step + 1000, t, "0" * 64, "xor-delta", step + 999, 1000, json.dumps(m)))
            times, size = [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                doc = coord.status()
                times.append(time.perf_counter() - t0)
                size = len(json.dumps(doc))
            return {"nodes": n_nodes, "steps": n_steps, "median_ms": round(1000 * statistics.median(times), 1),
                    "max_ms": round(1000 * max(times), 1), "document_bytes": size,
                    "nodes_listed": len(doc["nodes"]), "nodes_total": doc["nodes_total"]}
        finally:
            await coord.stop()


def main() -> None:
    rows = [asyncio.run(measure(n, 1000)) for n in (1_000, 10_000, 45_000)]
    print(f"{'nodes':>7} {'steps':>6} {'median ms':>10} {'max ms':>8} {'bytes':>9} {'listed':>7}")
    for r in rows:
        print(f"{r['nodes']:>7} {r['steps']:>6} {r['median_ms']:>10} {r['max_ms']:>8} {r['document_bytes']:>9} "
              f"{r['nodes_listed']:>7}")
    out = ROOT / "bench/results/status_scale.json"
    out.write_text(json.dumps({"benchmark": "status_scale", "target_ms_at_10k": 50, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
