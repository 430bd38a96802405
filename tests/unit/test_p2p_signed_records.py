"""The memo in front of py-libp2p's signed-peer-record check (node/p2p/service.py): real hosts, real Ed25519
envelopes. What passed once is not checked again; anything else still is, forged records included."""
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


def test_the_memo_is_installed_once_in_both_pubsub_modules():
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module

    installed = pubsub_module.maybe_consume_signed_record
    assert installed.remembers and gossipsub_module.maybe_consume_signed_record is installed
    service._remember_signed_records()
    assert pubsub_module.maybe_consume_signed_record is installed
