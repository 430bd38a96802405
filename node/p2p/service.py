"""The libp2p host and everything that runs on it (trio side; owned by the bridge's thread).

TCP + Noise + yamux only: py-libp2p's defaults would also offer plaintext, secio and TLS, and a
peer could pick the plaintext one. Gossipsub carries announcements on one per-run topic, with
libp2p's strict message signing on (so a message's originator is proven) and our validator on
top (so its content is signed by the right key). The shard protocol is served by ShardServer.

Structure (all inside `run`, which the bridge starts in its root nursery):
    host.run(listen) → pubsub service → gossipsub service → nursery{announcement pump}
`run` returns when the bridge sets the stop event; leaving the `async with` blocks closes the
pubsub services, then the listeners and connections, in that order.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from protocol.identity import Identity

from .announce import AnnouncementEvent, decode_announcement, topic_for_run
from .errors import AnnouncementRejected, InvalidMultiaddr, P2PError, PeerUnavailable
from .keys import libp2p_key_pair, node_id_for_peer
from .shard_client import fetch_shard
from .shard_server import ShardServer
from .shard_store import ShardStore
from .shard_wire import PROTOCOL_ID, ShardRequest
from .stats import P2PStats

log = logging.getLogger(__name__)

MAX_MULTIADDR_CHARS = 512
_VALIDATED_CACHE = 1024  # decoded announcements waiting for the pump (it drains them at once)
_LOUD_DROPS = 20  # per reason, then quieter: a spamming peer must not flood the log


@dataclass(frozen=True)
class ServiceSettings:
    listen_addrs: tuple[str, ...]
    run_id: str
    coordinator_key: str | None
    max_concurrent_streams: int
    upload_limit: int
    max_shard_bytes: int
    read_timeout_s: float
    connect_timeout_s: float
    announce_max_age_s: float
    heartbeat_interval_s: int = 1
    # Messages/s gossipsub accepts from one forwarding peer on our topic (py-libp2p's default is
    # 10, which a hub relaying many workers' announcements exceeds; excess is dropped silently).
    gossip_rate_limit: int = 100


def parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    if not isinstance(addr, str) or not addr.startswith("/") or len(addr) > MAX_MULTIADDR_CHARS:
        raise InvalidMultiaddr(f"{str(addr)[:80]!r} is not a multiaddr")
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as e:
        raise InvalidMultiaddr(f"{addr[:80]!r} is not a valid multiaddr: {e}") from None


class P2PService:
    def __init__(self, identity: Identity, settings: ServiceSettings, store: ShardStore | None, stats: P2PStats,
                 on_announcement: Callable[[AnnouncementEvent], None]):
        self.identity = identity
        self.settings = settings
        self.stats = stats
        self.topic = topic_for_run(settings.run_id)
        self._on_announcement = on_announcement
        self._validated: OrderedDict[tuple[bytes, bytes], Any] = OrderedDict()
        self.server = ShardServer(store, stats=stats, max_concurrent=settings.max_concurrent_streams,
                                  max_bytes=settings.max_shard_bytes, read_timeout_s=settings.read_timeout_s,
                                  upload_limit=settings.upload_limit)
        self.host: Any = None
        self.pubsub: Pubsub | None = None
        self.gossipsub: GossipSub | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, stop: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listen = [parse_multiaddr(a) for a in self.settings.listen_addrs]
        key_pair = libp2p_key_pair(self.identity)
        noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        self.host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
            listen_addrs=listen or None,
            # We announce our listen addresses ourselves; "observed" ones of a NATed node are not dialable.
            disable_identify_address_discovery=True,
        )
        self.gossipsub = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12,
            heartbeat_interval=self.settings.heartbeat_interval_s,
            max_messages_per_topic_per_second=float(self.settings.gossip_rate_limit),
        )
        self.pubsub = Pubsub(self.host, self.gossipsub, strict_signing=True, allowed_topics={self.topic})
        self.host.set_stream_handler(TProtocol(PROTOCOL_ID), self.server.handle)
        try:
            async with self.host.run(listen):
                # py-libp2p's auto-connector would keep re-dialling every peer in the peerstore
                # (up to 200 at a time); we dial only whom we decide to (bootstrap, fetch targets).
                await self.host.get_network().auto_connector.stop()
                if listen and not self.host.get_transport_addrs():
                    # py-libp2p logs a failed bind (e.g. port in use) and carries on without a listener.
                    raise P2PError(f"could not listen on {', '.join(map(str, listen))} (address in use?)")
                async with background_trio_service(self.pubsub), background_trio_service(self.gossipsub):
                    await self.pubsub.wait_until_ready()
                    self.pubsub.set_topic_validator(self.topic, self._validate, False)
                    subscription = await self.pubsub.subscribe(self.topic)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, subscription)
                        task_status.started(self.listen_addrs())
                        await stop.wait()
                        nursery.cancel_scope.cancel()
        finally:
            # py-libp2p workaround: Pubsub's seen-message cache starts a sweeper thread that
            # nothing ever stops; without this every host leaks a thread (docs/P2P.md).
            self.pubsub.seen_messages.stop()

    # --- calls from the asyncio side (via the bridge) -----------------------------------------
    def listen_addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()] if self.host is not None else []

    def peer_id(self) -> str:
        return self.host.get_id().to_base58()

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    async def connect(self, addr: str) -> str:
        """Dial `addr` (ending in /p2p/<peer id>); return the peer id once its pubsub stream is up."""
        maddr = parse_multiaddr(addr)
        try:
            info = info_from_p2p_addr(maddr)
        except Exception as e:
            raise InvalidMultiaddr(f"{addr[:80]!r} has no /p2p/<peer id> part: {e}") from None
        if info.peer_id == self.host.get_id():
            raise InvalidMultiaddr(f"{addr[:80]!r} is this node itself")
        try:
            with trio.fail_after(self.settings.connect_timeout_s):
                await self.host.connect(info)
        except trio.TooSlowError:
            raise PeerUnavailable(f"could not connect to {addr[:120]} within {self.settings.connect_timeout_s:.0f} s") from None
        except Exception as e:
            raise PeerUnavailable(f"could not connect to {addr[:120]}: {type(e).__name__}: {e}"[:300]) from None
        # Best effort: announcements flow once the peer's pubsub stream exists (usually ms).
        with trio.move_on_after(self.settings.connect_timeout_s):
            await self.pubsub.wait_for_peer(info.peer_id, timeout=self.settings.connect_timeout_s)
        return info.peer_id.to_base58()

    async def wait_for_mesh(self, peer: str, timeout_s: float) -> bool:
        """True once `peer` is in our gossip mesh for the run topic (so our publishes reach it)."""
        try:
            await self.pubsub.wait_for_mesh(ID.from_base58(peer), self.topic, timeout=timeout_s)
            return True
        except trio.TooSlowError:
            return False

    async def publish(self, data: bytes) -> None:
        await self.pubsub.publish(self.topic, data)

    async def fetch(self, peer: ID, req: ShardRequest, addrs: tuple[str, ...], timeout_s: float | None) -> bytes:
        if addrs and not self.host.get_network().connections.get(peer):
            # Learned from its announcement; the peerstore entry lets new_stream dial it.
            good = []
            for a in addrs:
                try:
                    good.append(parse_multiaddr(a))
                except InvalidMultiaddr:
                    continue
            self.host.get_peerstore().add_addrs(peer, good, 600)
        return await fetch_shard(self.host, peer, req, stats=self.stats, read_timeout_s=self.settings.read_timeout_s,
                                 open_timeout_s=self.settings.connect_timeout_s, timeout_s=timeout_s)

    # --- announcements -------------------------------------------------------------------------
    def _validate(self, forwarder: ID, msg: Any) -> bool:
        """Gossipsub topic validator (sync). Invalid messages are neither delivered nor relayed."""
        origin = ID(msg.from_id)
        try:
            try:
                origin_node: str | None = node_id_for_peer(origin)
            except P2PError:
                origin_node = None
            ann = decode_announcement(msg.data, run_id=self.settings.run_id,
                                      coordinator_key=self.settings.coordinator_key, origin_node_id=origin_node,
                                      max_age_s=self.settings.announce_max_age_s)
        except AnnouncementRejected as e:
            self.stats.count_dropped(e.reason)
            level = logging.INFO if self.stats.dropped().get(e.reason, 0) <= _LOUD_DROPS else logging.DEBUG
            log.log(level, "dropped announcement from %s (via %s): %s: %s", origin, forwarder, e.reason, e)
            return False
        key = (bytes(msg.from_id), bytes(msg.seqno))
        self._validated[key] = ann
        while len(self._validated) > _VALIDATED_CACHE:
            self._validated.popitem(last=False)
        return True

    async def _pump(self, subscription: Any) -> None:
        """Hand validated announcements from other nodes to the asyncio side."""
        me = self.host.get_id().to_bytes()
        while True:
            msg = await subscription.get()
            ann = self._validated.pop((bytes(msg.from_id), bytes(msg.seqno)), None)
            if bytes(msg.from_id) == me or ann is None:
                continue
            self.stats.count_received(ann.kind)
            try:
                self._on_announcement(AnnouncementEvent(ann, ID(msg.from_id).to_base58()))
            except Exception as e:  # a subscriber's bug must not stop the pump
                log.warning("announcement callback failed: %r", e)
