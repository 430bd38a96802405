"""The checkpoint format's building blocks: hostile safetensors headers, XOR, the bounded pipeline, chains."""
import json
import threading
import time

import numpy as np
import pytest
import torch

from protocol.checkpoint import (CheckpointError, Manifest, check_forward,
                                 load_payload, pack_checkpoint, parse_header, serialize_state, verify_manifest,
                                 xor_into)
from protocol.checkpoint.parallel import BufferPool, ordered_map
from protocol.identity import Identity


def header_bytes(doc: dict, data_size: int) -> bytes:
    text = json.dumps(doc).encode()
    return len(text).to_bytes(8, "little") + text + bytes(data_size)


@pytest.mark.parametrize("doc,data,reason", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, 8, "outside"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "does not match"),
    ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, 8, "unsupported dtype"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "bad shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16, "unaccounted"),
    ({"a": "x"}, 0, "malformed"),
    ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
    ([1, 2], 0, "not an object"),
])
def test_hostile_safetensors_headers_are_refused(doc, data, reason):
    blob = header_bytes(doc, data)
    with pytest.raises(CheckpointError, match=reason) as e:
        parse_header(blob, len(blob))
    assert e.value.code == "bad_payload"


def test_header_length_bomb_is_refused():
    blob = (2 ** 40).to_bytes(8, "little") + b"{}"
    with pytest.raises(CheckpointError, match="impossible"):
        parse_header(blob, len(blob))
    with pytest.raises(CheckpointError) as e:
        load_payload(blob)
    assert e.value.code == "bad_payload"


def test_serialization_is_deterministic_and_standard():
    from safetensors.torch import load

    state = {"z": torch.arange(5, dtype=torch.int32), "a": torch.randn(3, 4).to(torch.bfloat16),
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5)}
    a, b = serialize_state(state), serialize_state(dict(reversed(list(state.items()))))
    assert a == b
    n = int.from_bytes(a[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(a[8:8 + n])
    assert [k for k in header if k != "__metadata__"] == sorted(state)
    got = load(a)  # the reference reader accepts our layout
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_non_contiguous_and_partial_views_are_written_as_copies():
    base = torch.randn(6, 4)
    state = {"t": base.t(), "half": base[:3], "full": base}
    got = load_payload(serialize_state(state))
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert got["half"] is not got["full"]  # different views of one storage are not aliases


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1000003])
def test_xor_into_matches_numpy_and_is_an_involution(n):
    rng = np.random.default_rng(n)
    a = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    orig = bytes(a)
    xor_into(a, b)
    assert bytes(a) == (np.frombuffer(orig, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()
    xor_into(a, b)
    assert bytes(a) == orig


def test_ordered_map_keeps_order_and_bounds_work_in_flight():
    lock = threading.Lock()
    running = peak = 0

    def work(i):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.002 * (i % 3))
        with lock:
            running -= 1
        if i == 7:
            raise ValueError("boom")
        return i * i

    submitted = []

    def items():
        for i in range(20):
            submitted.append(i)
            yield i

    seen = []
    for item, fut in ordered_map(work, items(), threads=2, window=3):
        # At most `window` submitted plus the one being consumed: what sizes the buffer pools (window + 1).
        assert len(submitted) - len(seen) <= 3 + 1
        seen.append((item, fut.exception() is None and fut.result()))
    assert [s[0] for s in seen] == list(range(20)) and peak <= 2
    assert seen[7] == (7, False) and seen[5] == (5, 25)


def test_buffer_pool_reuses_and_caps():
    pool = BufferPool(16, 2)
    a, b = pool.acquire(), pool.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    time.sleep(0.05)
    assert not got  # third acquire waits: the pool never grows past its count
    pool.release(a)
    t.join(5)
    assert got and got[0] is a and len(b) == 16


def _manifest(key, step, parent=None, run_id="r"):
    doc = {"run_id": run_id, "step": step, "parent": parent, "encoding": "full", "base_step": None,
           "dtype": "bfloat16", "compression": {"codec": "zstd", "level": 1}, "shard_size": 4096,
           "total_size": 100, "sha256": "0" * 64, "shards": [{"index": 0, "size": 100, "zsize": 50,
                                                               "sha256": "1" * 64}]}
    from protocol.checkpoint import sign_manifest
    return sign_manifest(key, doc)


def test_forward_checks_across_gaps_runs_and_untrusted_mode():
    key = Identity.generate()
    m1 = _manifest(key, 1)
    m2 = _manifest(key, 2, parent=m1.canonical_hash())
    m5 = _manifest(key, 5, parent="ab" * 32)  # its parent (step 4) is unknown to a holder of step 2
    check_forward(m2, m1)
    check_forward(m5, m2)  # a gap: only forward motion and the run can be checked
    with pytest.raises(CheckpointError) as e:
        check_forward(_manifest(key, 2, parent="cd" * 32), m1)
    assert e.value.code == "parent_chain"
    with pytest.raises(CheckpointError) as e:
        check_forward(_manifest(key, 3, run_id="other"), m2)
    assert e.value.code == "run_mismatch"
    assert verify_manifest(m2, None) == key.public_hex  # None: integrity only, any signer
    with pytest.raises(CheckpointError) as e:
        Manifest.from_dict({**m2.to_dict(), "step": 0})
    assert e.value.code == "manifest_schema" and "parent" in str(e.value)
    with pytest.raises(CheckpointError):
        Manifest.from_json_bytes(b"[]")


def test_pack_payload_out_is_the_next_base(tmp_path):
    key = Identity.generate()
    state = {"w": torch.randn(300, 300).to(torch.bfloat16)}
    m0 = pack_checkpoint(state, tmp_path / "c0", identity=key, step=0, run_id="r", shard_size=64 * 1024,
                         payload_out=tmp_path / "p0")
    assert (tmp_path / "p0").read_bytes() == serialize_state(state)
    with pytest.raises(CheckpointError) as e:  # xor-delta needs a base_step (no parent given here)
        pack_checkpoint(state, tmp_path / "c1", identity=key, step=1, run_id="r", base_payload=tmp_path / "p0")
    assert e.value.code == "base_mismatch"
    m1 = pack_checkpoint(state, tmp_path / "c1", identity=key, step=1, run_id="r", base_payload=tmp_path / "p0",
                         base_step=0, shard_size=64 * 1024)
    assert m1.encoding == "xor-delta" and m1.parent is None and m1.compressed_size < m0.compressed_size / 20
