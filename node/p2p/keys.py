"""Bind libp2p peer ids to prime-node node ids.

A node's libp2p key pair *is* its prime-node Ed25519 key, so the peer id (an identity multihash
of the protobuf-encoded public key) and the node id (hex of the raw public key) name the same
key: a peer cannot announce under another node's id without that node's private key.
Imports libp2p, so only the trio side (and tests) import this module.
"""
from __future__ import annotations

from libp2p.crypto.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.peer.id import ID

from protocol.identity import Identity, parse_public_key

from .errors import P2PError


def libp2p_key_pair(identity: Identity) -> KeyPair:
    private = Ed25519PrivateKey.from_bytes(identity.private_bytes_raw())
    return KeyPair(private, private.get_public_key())


def peer_id_for_node(node_id_hex: str) -> ID:
    """The libp2p peer id of the node whose public key is `node_id_hex` (ValueError if malformed)."""
    parse_public_key(node_id_hex)  # validates length/hex/curve point with `cryptography`
    return ID.from_pubkey(Ed25519PublicKey.from_bytes(bytes.fromhex(node_id_hex)))


def node_id_for_peer(peer_id: ID) -> str:
    """The node id bound to `peer_id`; P2PError for a peer id that does not embed an Ed25519 key."""
    public = peer_id.extract_public_key()  # None for hashed (e.g. RSA) or malformed ids
    if public is None or public.get_type() != KeyType.Ed25519:
        raise P2PError(f"peer id {peer_id} is not an Ed25519 peer id")
    return public.to_bytes().hex()


def parse_peer_id(peer: str) -> ID:
    """Accept a base58 peer id ('12D3KooW…') or a node id (64 hex chars)."""
    if len(peer) == 64:
        try:
            return peer_id_for_node(peer)
        except ValueError:
            pass
    try:
        return ID.from_base58(peer)
    except Exception:
        raise P2PError(f"{peer[:80]!r} is neither a peer id nor a node id") from None

