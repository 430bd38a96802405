"""What a worker pays for its rollouts' activation commitments (verify/commitment.py), and a verifier for checking
them: one chunk at a time (how the worker built them until 2026-11-28), one rollout at a time, and a whole
generation batch at once (`make_commitments`, what both backends call now), side by side in one run on the same
hidden states, byte-identical output checked.

Shapes: the gpu-example submission (8 prompts x 16 samples x 512 tokens at SmolLM2-135M's width of 576: 2,048
chunks of 32 tokens) and the demo's (16 samples x 8 tokens at the tiny model's 128). Per mode: CPU seconds (min of
the repeats), and wall seconds beside another Python thread that is busy half the time (the worker's event loop and
libp2p thread run beside generation) and, on 16 rollouts, beside one that never blocks (the GIL's worst case).

    .venv/bin/python bench/commitment_cost.py [--repeats 3]
Writes bench/results/commitment_cost.json.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verify.commitment import (  # noqa: E402
    ChunkProof, _topk_by_magnitude, bf16_bits, choose_modulus, chunk_bounds, encode_proofs, interpolate,
    make_commitment, make_commitments, parse_commitment, points_per_chunk, score_commitment)

SHAPES = {"gpu-example": (128, 512, 576), "demo": (16, 8, 128)}


def one_chunk_at_a_time(hiddens: list[torch.Tensor]) -> list[bytes]:
    """The worker's path before 2026-11-28: every chunk interpolated by itself."""
    out = []
    for hidden in hiddens:
        proofs = []
        for s, e in chunk_bounds(hidden.shape[0]):
            bits = bf16_bits(hidden[s:e])
            bits = np.where((bits & 0x7F80) == 0x7F80, 0x7FC0, bits)
            idx = _topk_by_magnitude(bits, points_per_chunk(len(bits)))
            vals = bits[idx]
            p = choose_modulus(idx, int(vals.max()))
            proofs.append(ChunkProof(p, interpolate(idx % p, vals, p)))
        out.append(encode_proofs(proofs))
    return out


def beside(fn, busy_ms: float, sleep_ms: float) -> float:
    """Wall seconds of fn while another Python thread works `busy_ms` and then sleeps `sleep_ms`, over and over (as
    an event loop does between its sockets' events); sleep_ms = 0: a thread that never blocks, the worst case (the
    GIL changes hands only every switch interval, 5 ms, so every numpy call that lets the GIL go waits that long to
    get it back)."""
    stop = threading.Event()

    def other():
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < busy_ms / 1e3:
                pass
            if sleep_ms:
                time.sleep(sleep_ms / 1e3)

    th = threading.Thread(target=other)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for shape, (n, tokens, width) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        hiddens = [torch.randn(tokens, width, generator=gen) for _ in range(n)]
        chunks = n * len(chunk_bounds(tokens))
        expected = [bytes(b) for b in one_chunk_at_a_time(hiddens)]
        batched = make_commitments(hiddens)
        assert [base64.b64decode(c) for c in batched] == expected, "outputs differ"
        modes = {"one chunk at a time (before)": lambda hs: one_chunk_at_a_time(hs),
                 "one rollout at a time": lambda hs: [make_commitment(h) for h in hs],
                 "the whole batch (now)": lambda hs: make_commitments(hs)}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):  # interleaved: other load on the box hits every mode alike
            for m, fn in modes.items():
                t0 = time.process_time()
                fn(hiddens)
                cpu[m].append(time.process_time() - t0)
        half = {m: beside(lambda: fn(hiddens), 1.0, 1.0) for m, fn in modes.items()}
        few = hiddens[:16]  # the worst case only on 16 rollouts: it takes minutes on more
        spin = {m: beside(lambda: fn(few), 1.0, 0.0) for m, fn in modes.items()}
        proofs = [parse_commitment(c) for c in batched]
        t0 = time.process_time()
        for pr, h in zip(proofs, hiddens):
            score_commitment(pr, h)
        score_s = time.process_time() - t0
        base = min(cpu["one chunk at a time (before)"])
        for m in modes:
            rows.append({"shape": shape, "rollouts": n, "tokens": tokens, "width": width, "chunks": chunks,
                         "mode": m, "cpu_s": round(min(cpu[m]), 4),
                         "ms_per_chunk": round(min(cpu[m]) / chunks * 1e3, 3),
                         "speedup": round(base / min(cpu[m]), 2), "wall_s_beside_a_half_busy_thread": round(half[m], 3),
                         "wall_s_16_rollouts_beside_a_never_blocking_thread": round(spin[m], 2)})
        rows.append({"shape": shape, "rollouts": n, "tokens": tokens, "width": width, "chunks": chunks,
                     "mode": "verifier: score every rollout", "cpu_s": round(score_s, 4),
                     "ms_per_chunk": round(score_s / chunks * 1e3, 3)})
    print(f"{'shape':12} {'chunks':>6} {'mode':32} {'CPU s':>7} {'ms/chunk':>8} {'speedup':>7} "
          f"{'beside a 50 % busy thread, s':>28} {'16 rollouts beside a spinning thread, s':>39}")
    for r in rows:
        print(f"{r['shape']:12} {r['chunks']:>6} {r['mode']:32} {r['cpu_s']:>7.3f} {r['ms_per_chunk']:>8.3f} "
              f"{r.get('speedup', ''):>7} {r.get('wall_s_beside_a_half_busy_thread', ''):>28} "
              f"{r.get('wall_s_16_rollouts_beside_a_never_blocking_thread', ''):>39}")
    out = REPO / "bench" / "results" / "commitment_cost.json"
    out.write_text(json.dumps({"rows": rows, "torch_threads": 1, "repeats": args.repeats,
                               "when": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
