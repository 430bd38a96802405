"""TrustedManifests decides which manifest bytes to believe, with no IO: pinned key, the asked-for step,
forward motion from what is held, and the parent chain. Real packed and signed manifests; hostile bytes."""
import json

import pytest
import torch

from node.worker.trusted import TrustedManifests
from protocol.checkpoint import CheckpointError, pack_checkpoint
from protocol.identity import Identity
from protocol.signing import canonical_json


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chain")
    key = Identity.generate()
    torch.manual_seed(0)
    manifests, parent = [], None
    for step in range(3):
        state = {"w": torch.randn(64, 32), "b": torch.randn(32)}
        parent = pack_checkpoint(state, tmp / f"c{step}", identity=key, step=step, run_id="r", parent=parent)
        manifests.append(parent)
    return key, manifests


def raw(m) -> bytes:
    return canonical_json(m.to_dict())


def test_a_chain_signed_by_the_pinned_key_is_accepted(chain):
    key, (m0, m1, m2) = chain
    t = TrustedManifests(key.public_hex.upper())  # keys compare case-insensitively
    assert t.accept(raw(m0), 0, newest_held=None, parent=None).canonical_hash() == m0.canonical_hash()
    assert t.accept(raw(m1), 1, newest_held=m0, parent=m0).step == 1
    assert t.accept(raw(m2), 2, newest_held=m0, parent=None).step == 2  # across a gap: forward motion only


def test_another_key_a_wrong_step_a_rollback_and_a_broken_chain_are_refused(chain):
    key, (m0, m1, m2) = chain
    with pytest.raises(CheckpointError):
        TrustedManifests(Identity.generate().public_hex).accept(raw(m1), 1, newest_held=None, parent=None)
    t = TrustedManifests(key.public_hex)
    with pytest.raises(CheckpointError, match="asked for step 2"):
        t.accept(raw(m1), 2, newest_held=None, parent=None)  # a source answering another step
    with pytest.raises(CheckpointError):
        t.accept(raw(m1), 1, newest_held=m2, parent=None)  # rollback to an older step
    with pytest.raises(CheckpointError) as e:
        t.accept(raw(m2), 2, newest_held=m0, parent=m0)  # m2's parent is m1, not m0
    assert e.value.code == "parent_chain"


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(step=d["step"] + 1),                      # signed fields changed after signing
    lambda d: d.update(extra_field=1),                           # not in the schema
    lambda d: d["shards"][0].update(sha256="00" * 32),           # a shard hash swapped
])
def test_tampered_bytes_are_refused(chain, mutate):
    key, (_, m1, _) = chain
    doc = json.loads(raw(m1))
    mutate(doc)
    with pytest.raises(CheckpointError):
        TrustedManifests(key.public_hex).accept(json.dumps(doc).encode(), doc["step"], newest_held=None,
                                                parent=None)


@pytest.mark.parametrize("junk", [b"", b"{", b"[]", b"null", b"[" * 100_000, b'{"step": 1e999}'])
def test_junk_is_a_checkpoint_error_not_a_crash(chain, junk):
    key, _ = chain
    with pytest.raises(CheckpointError):
        TrustedManifests(key.public_hex).accept(junk, 1, newest_held=None, parent=None)
