"""Ledger.standing: the per-request check of a signed request's node (node/coordinator/ledger.py)."""
from node.coordinator.ledger import Ledger
from node.coordinator.records import Liveness


def test_standing_follows_joins_bans_and_liveness(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    key = "ab" * 32
    assert ledger.standing(key) is None  # never joined
    ledger.upsert_node(key, 1.0, {"backend": "sim"})
    s = ledger.standing(key)
    assert s is not None and (s.node_id, s.banned, s.policy_step) == (key, False, None)
    ledger.record_liveness([Liveness(key, 1, 7, 10.0, "idle")])
    assert ledger.standing(key).policy_step == 7
    with ledger.transaction() as db:
        db.execute("UPDATE nodes SET banned=1 WHERE node_id=?", (key,))
    assert ledger.standing(key).banned is True
    assert ledger.node(key).banned is True  # the same answer as the whole row
    ledger.close()
