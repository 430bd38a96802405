"""What the join proof of work costs (issue #25, finding 10): one CPU core's native SHA-256 rate (the old
puzzle), scrypt's cost per evaluation at each N (r = 8, p = 1), and the default puzzle's solve time (median of
--solves) and check time, all measured here on one core; GPU costs are estimates from published hashcat rates
(docs/SECURITY.md, "Admission").

    .venv/bin/python bench/pow_cost.py --solves 7
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.admission import check_pow, pow_digest, pow_memory_bytes, solve_pow  # noqa: E402
from protocol.identity import Identity  # noqa: E402


def sha256_rate(seconds: float = 2.0) -> float:
    """hashlib's SHA-256 of the old puzzle's input (key ‖ run ‖ 8-byte nonce, prefix hashed once), one core:
    a lower bound on native speed (the Python loop costs more than the hash)."""
    prefix = hashlib.sha256(os.urandom(32) + b"local-demo")
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i in range(n, n + 100_000):
            h = prefix.copy()
            h.update(i.to_bytes(8, "big"))
            h.digest()
        n += 100_000
    return n / (time.perf_counter() - t0)


def main(args) -> None:
    sha = sha256_rate()
    print(f"hashlib SHA-256 (Python loop), one core: {sha / 1e6:.2f} M/s")
    out = {"sha256_python_loop_per_s": round(sha), "scrypt_ms_per_evaluation": {}}
    key = Identity.generate().public_hex
    for log2_n in range(10, 17):
        ts = []
        for i in range(5):
            t0 = time.perf_counter()
            pow_digest(key, "local-demo", i.to_bytes(8, "big"), log2_n)
            ts.append(time.perf_counter() - t0)
        print(f"scrypt N=2^{log2_n} r=8 p=1 ({pow_memory_bytes(log2_n) >> 20} MiB): "
              f"median {statistics.median(ts) * 1000:.1f} ms per evaluation")
        out["scrypt_ms_per_evaluation"][f"2^{log2_n}"] = round(statistics.median(ts) * 1000, 2)
    solves, checks = [], []
    for _ in range(args.solves):
        key = Identity.generate().public_hex
        t0 = time.perf_counter()
        nonce = solve_pow(key, "local-demo", args.bits, args.log2_n)
        solves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_pow(key, "local-demo", nonce, args.bits, args.log2_n)
        checks.append(time.perf_counter() - t0)
    print(f"puzzle bits={args.bits} N=2^{args.log2_n}: solve median {statistics.median(solves):.2f} s "
          f"(min {min(solves):.2f}, max {max(solves):.2f}, n={len(solves)}); check median "
          f"{statistics.median(checks) * 1000:.1f} ms")
    out.update(bits=args.bits, log2_n=args.log2_n, solve_s=[round(x, 3) for x in solves],
               solve_median_s=round(statistics.median(solves), 3), check_median_ms=round(statistics.median(checks) * 1000, 2))
    res = Path(__file__).resolve().parent / "results" / "pow_cost.json"
    res.write_text(json.dumps(out, indent=2))
    print(f"wrote {res}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--solves", type=int, default=7)
    p.add_argument("--bits", type=int, default=5)
    p.add_argument("--log2-n", type=int, default=14)
    main(p.parse_args())
