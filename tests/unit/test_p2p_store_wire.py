"""Shard wire format, shard stores, rate-limit arithmetic, peer table (pure; no hosts)."""
import json
import os

import pytest

from node.p2p.announce import HaveAnnouncement, ManifestAnnouncement
from node.p2p.peer_table import PeerTable
from node.rate_limit import TokenBucket
from node.p2p.shard_store import CallableShardStore, DirectoryShardStore, as_store, manifest_hash
from node.p2p.shard_wire import (
    MAX_REQUEST_BYTES,
    REQUEST_PREFIX,
    BadRequest,
    ShardRequest,
    Status,
    decode_header,
    decode_request,
    encode_error,
    encode_request,
    parse_request_length,
)
from protocol.signing import canonical_json

H = "cd" * 32


def test_request_round_trip():
    req = ShardRequest(step=4, index=17, manifest_hash=H, max_bytes=1 << 20)
    wire = encode_request(req)
    n = parse_request_length(wire[:REQUEST_PREFIX.size])
    assert decode_request(wire[REQUEST_PREFIX.size:REQUEST_PREFIX.size + n]) == req


@pytest.mark.parametrize("length", [0, MAX_REQUEST_BYTES + 1, 2**32 - 1])
def test_request_length_is_bounded(length):
    with pytest.raises(BadRequest):
        parse_request_length(REQUEST_PREFIX.pack(length))


@pytest.mark.parametrize("body", [
    b"not json",
    b'{"step": 1, "index": 2}',                                              # no max_bytes
    b'{"step": 1, "index": 2, "max_bytes": 5, "path": "../../etc/passwd"}',  # extra field
    b'{"step": "1", "index": 2, "max_bytes": 5}',                            # strict types
    b'{"step": 1, "index": -2, "max_bytes": 5}',
    b'{"step": 1, "index": 100000, "max_bytes": 5}',
    b'{"step": 1, "index": 2, "max_bytes": 5, "manifest_hash": "../x"}',
])
def test_bad_requests_are_refused(body):
    with pytest.raises(BadRequest):
        decode_request(body)


def test_response_header_and_unknown_status():
    wire = encode_error(Status.BUSY, "x" * 5000)
    status, length = decode_header(wire[:9])
    assert status is Status.BUSY and length == 1024 == len(wire) - 9
    with pytest.raises(BadRequest):
        decode_header(bytes([99]) + bytes(8))


def _ckpt(root, step, shards, manifest=None):
    d = root / str(step)
    (d / "shards").mkdir(parents=True)
    for i, data in enumerate(shards):
        (d / "shards" / f"{i:05d}.zst").write_bytes(data)
    if manifest is not None:
        (d / "manifest.json").write_bytes(canonical_json(manifest))


def _read(body):
    try:
        return b"".join(body.chunks(7))
    finally:
        body.close()


def test_directory_store_serves_files_and_checks_manifest_hash(tmp_path):
    manifest = {"format": "prime-node/checkpoint/v1", "step": 2, "signature": "ff" * 64}
    _ckpt(tmp_path, 2, [b"shard-zero", b"shard-one"], manifest)
    store = DirectoryShardStore(tmp_path)
    assert _read(store.open(2, 1, None)) == b"shard-one"
    good = manifest_hash(manifest)
    assert good == manifest_hash({**manifest, "signature": "00"})  # the signature is not hashed
    assert _read(store.open(2, 0, good)) == b"shard-zero"
    assert store.open(2, 0, "00" * 32) is None  # same step number, different checkpoint
    assert store.open(2, 2, None) is None
    assert store.open(3, 0, None) is None
    with pytest.raises(ValueError):
        store.shard_path(2, -1)


def test_directory_store_without_manifest_refuses_hash_checked_requests(tmp_path):
    _ckpt(tmp_path, 1, [b"a"])
    store = DirectoryShardStore(tmp_path)
    assert _read(store.open(1, 0, None)) == b"a"
    assert store.open(1, 0, H) is None


def test_directory_store_never_leaves_its_root(tmp_path):
    root = tmp_path / "root"
    secret = tmp_path / "secret"
    secret.write_bytes(b"private key material")
    _ckpt(root, 1, [b"ok"])
    os.symlink(secret, root / "1" / "shards" / "00001.zst")
    (root / "1" / "shards" / "00002.zst").mkdir()  # not a regular file
    store = DirectoryShardStore(root)
    assert store.open(1, 1, None) is None
    assert store.open(1, 2, None) is None
    assert _read(store.open(1, 0, None)) == b"ok"


def test_callable_store_and_as_store(tmp_path):
    store = as_store(lambda step, index: b"x" * index if index else None)
    assert isinstance(store, CallableShardStore)
    assert _read(store.open(0, 3, H)) == b"xxx"
    assert store.open(0, 0, None) is None
    assert isinstance(as_store(tmp_path), DirectoryShardStore)
    assert as_store(None) is None
    assert as_store(store) is store
    with pytest.raises(TypeError):
        as_store(42)


def test_token_bucket_holds_the_rate():
    bucket = TokenBucket(rate=1000, burst=100, now=0.0)
    assert bucket.reserve(100, now=0.0) == 0.0          # the burst passes at once
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.5)  # then debt: wait 0.5 s
    assert bucket.reserve(500, now=0.5) == pytest.approx(0.5)  # debt paid at 0.5, new debt
    # Over a long run, total wait ≈ bytes / rate, whatever the chunking.
    bucket = TokenBucket(rate=10_000, burst=1000, now=0.0)
    t = 0.0
    for _ in range(100):
        t += bucket.reserve(1000, now=t)
    assert t == pytest.approx(99_000 / 10_000)
    with pytest.raises(ValueError):
        TokenBucket(rate=0)


def _have(step, indices, h=H, ts=1, addrs=()):
    return HaveAnnouncement.model_construct(kind="have", run_id="r", step=step, manifest_hash=h, indices=indices,
                                            addrs=list(addrs), ts_ms=ts, signer="0" * 64, signature="0" * 128)


def test_peer_table_union_newest_first_and_bounds():
    table = PeerTable(max_steps=2, max_peers_per_step=2, allow_private_addrs=True)
    table.note_manifest(5, H)  # steps count once signed (test_attack_announcements has the rules)
    table.record_have("A", _have(5, [0, 1], addrs=["/ip4/127.0.0.1/tcp/1"]))
    table.record_have("B", _have(5, [1], addrs=["/ip4/127.0.0.1/tcp/2"]))
    table.record_have("A", _have(5, [2], ts=2, addrs=["/ip4/127.0.0.1/tcp/3"]))
    assert table.peers_with(5, 1) == ["A", "B"]  # A announced most recently
    assert table.peers_with(5, 2) == ["A"] and table.peers_with(5, 0) == ["A"]  # holdings accumulate
    assert table.peers_with(5, 1, manifest_hash="00" * 32) == []
    assert table.addrs_of("A") == ("/ip4/127.0.0.1/tcp/3",)  # the newest announcement's addresses
    assert table.addrs_of("B") == ("/ip4/127.0.0.1/tcp/2",) and table.addrs_of("Z") == ()
    table.record_have("C", _have(5, [1]))
    assert table.peers_with(5, 1) == ["C", "A"]  # B was the oldest announcer: forgotten
    table.record_have("A", _have(6, [0]))
    table.record_have("A", _have(7, [0]))
    table.note_manifest(6, H)
    table.note_manifest(7, H)
    assert table.peers_with(5, 1) == []  # only the newest 2 signed steps are kept
    assert table.peers_with(7, 0) == ["A"]
    table.forget("A")
    assert table.peers_with(7, 0) == []


def test_have_batches_slow_down_as_the_swarm_grows():
    from types import SimpleNamespace

    from node.worker.peers import HaveAnnouncer

    table = PeerTable()
    table.note_manifest(6, H)
    announcer = HaveAnnouncer(SimpleNamespace(table=table, reachable=None), interval=0.3)
    assert announcer.batch_seconds() == 0.3
    for i in range(16):
        table.record_have(f"P{i}", _have(5, [0]))
    table.record_have("P0", _have(6, [1]))
    assert table.peer_count() == 16 and announcer.batch_seconds() == 2.0  # 16 peers / 8 per second
    announcer.p2p.reachable = False  # NATed: waits twice as long to hear of direct holders (P2PNode.worth_naming)
    assert announcer.batch_seconds() == 4.0


def test_peer_table_manifests():
    table = PeerTable()
    assert table.latest_manifest() is None
    for step, h, ts in [(3, "aa" * 32, 5), (4, "bb" * 32, 6), (3, "cc" * 32, 4)]:
        table.record_manifest(ManifestAnnouncement.model_construct(
            kind="manifest", run_id="r", step=step, manifest_hash=h, ts_ms=ts, signer="0" * 64, signature="0" * 128))
    assert table.manifest_hash(3) == "aa" * 32  # an older announcement does not override
    assert table.latest_manifest() == (4, "bb" * 32)


def test_p2p_package_import_is_light():
    import subprocess
    import sys

    code = ("import sys, node.p2p, node.p2p.host, node.p2p.config; "
            "bad = [m for m in ('libp2p', 'trio', 'torch') if m in sys.modules]; print(json.dumps(bad))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_node_arguments_are_checked_up_front():
    from node.p2p.config import P2PConfig
    from node.p2p.errors import P2PError
    from node.p2p.host import P2PNode
    from protocol.identity import Identity

    ident, cfg = Identity.generate(), P2PConfig()
    with pytest.raises(P2PError, match="run id"):
        P2PNode(ident, cfg, run_id="has space")
    with pytest.raises(P2PError, match="coordinator key"):
        P2PNode(ident, cfg, run_id="r", coordinator_key="zz" * 32)
    with pytest.raises(ValueError):
        P2PNode(ident, cfg, run_id="r", shard_root="/tmp", shard_source=lambda s, i: None)
    node = P2PNode(ident, cfg, run_id="r", coordinator_key=ident.public_hex.upper())
    assert node.coordinator_key == ident.public_hex and node.peer_id.startswith("12D3KooW")
