"""Errors of the p2p layer. All are PrimeNodeError: one human sentence, no traceback needed.

A fetch failure tells the caller what to do next: `ShardBusy` / `ShardFetchTimeout` /
`PeerUnavailable` mean "try another peer (or this one later)", `ShardNotFound` means "this peer
does not have it", `ShardTooLarge` / `ShardProtocolError` mean "this peer misbehaves".
"""
from __future__ import annotations

from protocol.errors import PrimeNodeError


class P2PError(PrimeNodeError):
    """Base class of every p2p failure."""


class P2PNotRunning(P2PError):
    """The node was not started, or has been stopped."""


class InvalidMultiaddr(P2PError):
    pass


class PeerUnavailable(P2PError):
    """Could not reach the peer, or it went away mid-transfer."""


class ShardFetchError(P2PError):
    """A shard request failed; `peer`, `step` and `index` say which."""

    def __init__(self, message: str, *, peer: str = "", step: int = -1, index: int = -1):
        super().__init__(message)
        self.peer = peer
        self.step = step
        self.index = index


class ShardNotFound(ShardFetchError):
    pass


class ShardBusy(ShardFetchError):
    pass


class ShardTooLarge(ShardFetchError):
    pass


class ShardFetchTimeout(ShardFetchError):
    pass


class ShardPeerGone(ShardFetchError, PeerUnavailable):
    """The connection broke before the whole shard arrived."""


class ShardProtocolError(ShardFetchError):
    """The peer answered something that is not the shard protocol."""


class AnnouncementRejected(P2PError):
    """A gossip announcement failed validation; `reason` is a short counter key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
