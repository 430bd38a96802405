"""Announcement schema and signature checks (pure; no hosts)."""
import json

import pytest

from node.p2p.announce import (
    MAX_ANNOUNCEMENT_BYTES,
    HaveAnnouncement,
    ManifestAnnouncement,
    decode_announcement,
    encode_have_announcement,
    encode_manifest_announcement,
    topic_for_run,
)
from node.p2p.errors import AnnouncementRejected
from protocol.identity import Identity
from protocol.signing import canonical_json, sign_document

COORD = Identity.generate()
PEER = Identity.generate()
OTHER = Identity.generate()
H = "ab" * 32
NOW = 1_800_000_000_000


def decode(data, *, origin=PEER.node_id, run_id="run-1", now=NOW):
    return decode_announcement(data, run_id=run_id, coordinator_key=COORD.public_hex, origin_node_id=origin,
                               max_age_s=600, now_ms=now)


def reason(data, **kw):
    with pytest.raises(AnnouncementRejected) as e:
        decode(data, **kw)
    return e.value.reason


def test_topic_is_per_run():
    assert topic_for_run("run-1") == "/prime-node/run-1/announce"


def test_manifest_round_trip_from_any_relay():
    data = encode_manifest_announcement(COORD, run_id="run-1", step=7, manifest_hash=H, ts_ms=NOW)
    ann = decode(data, origin=OTHER.node_id)  # who gossiped it does not matter, the signature does
    assert isinstance(ann, ManifestAnnouncement)
    assert (ann.step, ann.manifest_hash, ann.signer) == (7, H, COORD.public_hex)


def test_have_round_trip_sorts_and_dedups_indices():
    data = encode_have_announcement(PEER, run_id="run-1", step=3, manifest_hash=H, indices=[5, 1, 5, 0],
                                    addrs=["/ip4/127.0.0.1/tcp/4001/p2p/x"], ts_ms=NOW)
    ann = decode(data)
    assert isinstance(ann, HaveAnnouncement)
    assert ann.indices == [0, 1, 5] and ann.addrs == ["/ip4/127.0.0.1/tcp/4001/p2p/x"]


def test_manifest_signed_by_a_worker_is_dropped():
    data = encode_manifest_announcement(PEER, run_id="run-1", step=7, manifest_hash=H, ts_ms=NOW)
    assert reason(data) == "wrong_key"


def test_manifest_with_no_trusted_coordinator_is_dropped():
    data = encode_manifest_announcement(COORD, run_id="run-1", step=7, manifest_hash=H, ts_ms=NOW)
    with pytest.raises(AnnouncementRejected, match="coordinator"):
        decode_announcement(data, run_id="run-1", coordinator_key=None, origin_node_id=None, max_age_s=600,
                            now_ms=NOW)


def test_have_signed_by_another_key_than_the_sender_is_dropped():
    data = encode_have_announcement(OTHER, run_id="run-1", step=3, manifest_hash=H, indices=[1], ts_ms=NOW)
    assert reason(data, origin=PEER.node_id) == "wrong_key"
    assert reason(data, origin=None) == "wrong_key"


def test_tampered_field_breaks_the_signature():
    doc = json.loads(encode_have_announcement(PEER, run_id="run-1", step=3, manifest_hash=H, indices=[1], ts_ms=NOW))
    doc["indices"] = [1, 2, 3]
    assert reason(canonical_json(doc)) == "bad_signature"


def test_unsigned_malformed_and_oversized_are_dropped():
    unsigned = {"kind": "have", "run_id": "run-1", "step": 1, "manifest_hash": H, "indices": [0], "ts_ms": NOW}
    assert reason(canonical_json(unsigned)) == "unsigned"
    assert reason(b"\xff\xfe not json") == "malformed"
    assert reason(b"[1, 2]") == "malformed"
    assert reason(b'{"signature": NaN, "signer": 1}') == "malformed"
    assert reason(b" " * (MAX_ANNOUNCEMENT_BYTES + 1)) == "too_large"


@pytest.mark.parametrize("change", [
    {"extra": 1},                    # extra="forbid"
    {"step": "3"},                   # strict: no coercion of what was signed
    {"step": -1},
    {"indices": []},
    {"indices": [100_000]},
    {"indices": list(range(5000))},
    {"manifest_hash": "AB" * 32},     # lowercase hex only
    {"kind": "other"},
    {"addrs": ["not-a-multiaddr"]},
    {"run_id": "../etc"},
])
def test_schema_violations_are_dropped_even_when_signed(change):
    doc = {"kind": "have", "run_id": "run-1", "step": 3, "manifest_hash": H, "indices": [1], "addrs": [], "ts_ms": NOW}
    doc.update(change)
    assert reason(canonical_json(sign_document(PEER, doc))) == "malformed"


def test_other_run_and_stale_are_dropped():
    data = encode_have_announcement(PEER, run_id="run-2", step=3, manifest_hash=H, indices=[1], ts_ms=NOW)
    assert reason(data) == "wrong_run"
    old = encode_have_announcement(PEER, run_id="run-1", step=3, manifest_hash=H, indices=[1], ts_ms=NOW - 601_000)
    assert reason(old) == "stale"
    future = encode_have_announcement(PEER, run_id="run-1", step=3, manifest_hash=H, indices=[1], ts_ms=NOW + 601_000)
    assert reason(future) == "stale"


def test_encoder_refuses_what_peers_would_drop():
    with pytest.raises(ValueError, match="invalid"):
        encode_have_announcement(PEER, run_id="run-1", step=3, manifest_hash=H, indices=[])
    with pytest.raises(ValueError, match="invalid"):
        encode_manifest_announcement(COORD, run_id="run-1", step=3, manifest_hash="xyz")


def test_node_id_and_peer_id_name_the_same_key():
    from node.p2p.keys import libp2p_key_pair, node_id_for_peer, parse_peer_id, peer_id_for_node
    from libp2p.peer.id import ID

    pid = ID.from_pubkey(libp2p_key_pair(PEER).public_key)
    assert peer_id_for_node(PEER.node_id) == pid
    assert node_id_for_peer(pid) == PEER.node_id
    assert parse_peer_id(pid.to_base58()) == pid == parse_peer_id(PEER.node_id)
    from node.p2p.errors import P2PError

    with pytest.raises(P2PError):
        parse_peer_id("not a peer")
