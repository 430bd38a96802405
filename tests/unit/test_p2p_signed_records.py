"""The memo in front of py-libp2p's signed-peer-record check (node/p2p/service.py): real hosts, real Ed25519
envelopes. What passed once is not checked again; anything else still is, forged records included."""
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.pubsub import utils
from libp2p.pubsub.pb import rpc_pb2

import node.p2p.service as service


def test_a_record_that_passed_is_not_checked_again_and_a_forged_one_is_refused():
    calls = []

    def counted(msg, host, peer_id):
        calls.append(bytes(msg.senderRecord))
        return utils.maybe_consume_signed_record(msg, host, peer_id)

    check = service.remembering(counted, kept=2)
    a, b, c = (new_host(key_pair=create_new_key_pair()) for _ in range(3))
    record, _ = env_to_send_in_RPC(a)
    rpc = rpc_pb2.RPC(senderRecord=record)
    assert check(rpc, b, a.get_id()) and check(rpc, b, a.get_id())
    assert len(calls) == 1  # the second time is remembered
    assert check(rpc, c, a.get_id()) and len(calls) == 2  # another host checks for itself
    forged = bytearray(record)
    forged[-5] ^= 1
    for _ in range(2):  # a refused record is never remembered
        assert not check(rpc_pb2.RPC(senderRecord=bytes(forged)), b, a.get_id())
    assert len(calls) == 4
    assert not check(rpc, b, b.get_id())  # a's record claimed by another peer: checked, refused
    assert check(rpc_pb2.RPC(), b, a.get_id())  # no record: py-libp2p's own answer (accept)


def test_importing_the_service_patches_nothing():
    """No import-time side effect: a fresh interpreter that imports node.p2p.service (and so libp2p) still
    has py-libp2p's own check in both pubsub modules."""
    code = ("import node.p2p.service, libp2p.pubsub.pubsub as p, libp2p.pubsub.gossipsub as g, "
            "libp2p.pubsub.utils as u; "
            "assert p.maybe_consume_signed_record is u.maybe_consume_signed_record, 'pubsub patched at import'; "
            "assert g.maybe_consume_signed_record is u.maybe_consume_signed_record, 'gossipsub patched at import'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_patch_still_applies_to_the_libp2p_in_use():
    """patch_libp2p_signed_record_memo replaces a module global; it only takes effect while upstream still
    calls the check through that global, from the two places it was written for (libp2p==0.8.1). An
    upgrade that renames, moves or inlines the check fails here rather than silently undoing the memo."""
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module

    assert metadata.version("libp2p") == service.LIBP2P_PATCHED_VERSION, \
        "libp2p was upgraded: re-check patch_libp2p_signed_record_memo's defect, then its target version"
    for name, method in (("Pubsub.continuously_read_stream", pubsub_module.Pubsub.continuously_read_stream),
                         ("GossipSub.handle_rpc", gossipsub_module.GossipSub.handle_rpc)):
        assert "maybe_consume_signed_record" in method.__code__.co_names, \
            f"{name} no longer calls maybe_consume_signed_record by its module global: the patch misses it"


def test_the_memo_is_installed_once_in_both_pubsub_modules():
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module

    assert service.patch_libp2p_signed_record_memo()
    installed = pubsub_module.maybe_consume_signed_record
    assert installed.remembers and gossipsub_module.maybe_consume_signed_record is installed
    assert service.patch_libp2p_signed_record_memo()  # idempotent
    assert pubsub_module.maybe_consume_signed_record is installed
    assert gossipsub_module.maybe_consume_signed_record is installed


async def test_starting_a_host_installs_the_memo(monkeypatch):
    """The entry point: P2PNode.start applies the patch (a process that only imports libp2p does not)."""
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module

    from node.p2p.host import P2PNode
    from protocol.identity import Identity
    from tests.p2p_helpers import p2p_config

    for module in (pubsub_module, gossipsub_module):  # as a fresh process has them; restored after the test
        monkeypatch.setattr(module, "maybe_consume_signed_record", utils.maybe_consume_signed_record)
    node = P2PNode(Identity.generate(), p2p_config(listen=False, allow_private_addrs=True), run_id="run-memo")
    try:
        await node.start()
        assert getattr(pubsub_module.maybe_consume_signed_record, "remembers", False)
        assert gossipsub_module.maybe_consume_signed_record is pubsub_module.maybe_consume_signed_record
    finally:
        await node.stop()
