"""The libp2p host and everything that runs on it (trio side; owned by the bridge's thread).

TCP + Noise + yamux only: py-libp2p's defaults would also offer plaintext, secio and TLS, and a
peer could pick the plaintext one. Gossipsub carries announcements on one per-run topic, with
libp2p's strict message signing on (so a message's originator is proven) and our validator on
top (so its content is signed by the right key). The shard protocol is served by ShardServer.

Inbound gossip is checked cheapest first (`GuardedPubsub.push_msg`, before libp2p's own checks):
duplicate? → per-forwarding-peer rate limit → topic and size → JSON, schema, run, key binding,
timestamp → only then the two Ed25519 verifications (libp2p's message signature, then our
document signature in `_validate`). A flood of junk or of excess messages therefore costs no
signature check. Every drop is counted in P2PStats (by reason and by forwarding peer) and logged
through a PeerEventLog: at most one line per peer per minute, never one per message.

Structure (all inside `run`, which the bridge starts in its root nursery):
    host.run(listen) → pubsub service → gossipsub service → nursery{announcement pump}
`run` returns when the bridge sets the stop event; leaving the `async with` blocks closes the
pubsub services, then the listeners and connections, in that order.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections import OrderedDict
from typing import Any, Callable, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from protocol.identity import Identity

from .config import P2PConfig
from .announce import AnnouncementEvent, CheckedAnnouncement, precheck_announcement, topic_for_run, verify_announcement
from .addrs import multiaddr_allowed
from .errors import AnnouncementRejected, InvalidMultiaddr, P2PError, PeerUnavailable
from .keys import libp2p_key_pair, node_id_for_peer
from node.peer_log import PeerEventLog
from node.rate_limit import KeyedRateLimit
from .http_shards import is_http_addr
from . import nat
from .shard_client import fetch_shard
from .shard_server import ShardServer
from .shard_store import ShardStore
from .shard_wire import PROTOCOL_ID, ShardRequest
from .stats import P2PStats

log = logging.getLogger(__name__)

MAX_MULTIADDR_CHARS = 512
_VALIDATED_CACHE = 1024  # decoded announcements waiting for the pump (it drains them at once)
_REJECTED_CACHE = 1024  # ids of messages our validator refused (counted there, not again)
LOG_FLUSH_S = 5.0  # how often due per-peer summary lines are written
# Our per-forwarder gossip limit: gossip_rate_limit messages/s sustained, bursts up to this many
# seconds' worth (a relay's traffic is bursty: our own 8/s pacing sends 8 at once, and the network
# can bunch two seconds' worth together).
GOSSIP_BURST_S = 2.0
# gossipsub's own per-forwarder check (n per sliding second, after validation; it drops silently
# and logs a WARNING per message) is set this many times above ours, so it never fires for what
# we admitted (at most burst + 1 s of rate = 3x in any second): ours is the limit.
GOSSIPSUB_LIMIT_FACTOR = 4
HEARTBEAT_INTERVAL_S = 1  # gossipsub's heartbeat (mesh upkeep, gossip emission), seconds
# At most one log line per peer per this many seconds about what it made us drop or refuse.
PEER_LOG_INTERVAL_S = 60.0


_SIGNED_RECORDS_KEPT = 4096


def remembering(check: Callable[[Any, Any, ID], bool], kept: int = _SIGNED_RECORDS_KEPT) -> Callable[[Any, Any, ID], bool]:
    """`check` (py-libp2p's `maybe_consume_signed_record`) that skips records it has seen pass: the same
    record bytes from the same peer to the same host. Anything new, or refused before, is checked."""
    passed: OrderedDict[tuple[bytes, bytes, bytes], None] = OrderedDict()

    def remembering_check(msg: Any, host: Any, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return check(msg, host, peer_id)
        key = (host.get_id().to_bytes(), peer_id.to_bytes(), bytes(msg.senderRecord))
        if key in passed:
            passed.move_to_end(key)
            return True
        ok = check(msg, host, peer_id)
        if ok:
            passed[key] = None
            if len(passed) > kept:
                passed.popitem(last=False)
        return ok

    remembering_check.remembers = True  # type: ignore[attr-defined]
    return remembering_check


LIBP2P_PATCHED_VERSION = "0.8.1"  # the py-libp2p release patch_libp2p_signed_record_memo was written for


def patch_libp2p_signed_record_memo() -> bool:
    """Put `remembering` in front of py-libp2p's signed-peer-record check, for the whole process. Targets
    libp2p==0.8.1 (pinned in pyproject.toml); called by P2PNode.start (node/p2p/host.py), the one place a
    host is started, never at import. Idempotent: a second call changes nothing.

    The upstream defect: py-libp2p 0.8 attaches the sender's signed peer record to every pubsub RPC and
    verifies its Ed25519 signature on arrival every time, twice for an RPC with control messages
    (`Pubsub.continuously_read_stream`, then `GossipSub.handle_rpc`), although a peer sends the same record
    bytes every time. In a 16-node swarm that was ~10 % of a node's CPU (py-spy); remembering the records
    that passed cut the nodes' CPU in a broadcast round by ~40 % (bench/broadcast.py). Both modules bind
    `maybe_consume_signed_record` by `from ... import`, so the name is replaced in each.

    Returns whether the memo is in place. When upstream no longer has the name (renamed, moved), nothing is
    replaced and this logs a warning and returns False: hosts still work, only slower
    (tests/unit/test_p2p_signed_records.py fails on it, so an upgrade cannot pass CI unnoticed)."""
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module
    from libp2p.pubsub import utils

    targets = (pubsub_module, gossipsub_module)
    if not all(hasattr(m, "maybe_consume_signed_record") for m in (utils, *targets)):
        log.warning("py-libp2p has no maybe_consume_signed_record where libp2p==%s had it: signed peer "
                    "records are checked on every RPC (node/p2p/service.py)", LIBP2P_PATCHED_VERSION)
        return False
    if not getattr(pubsub_module.maybe_consume_signed_record, "remembers", False):
        check = remembering(utils.maybe_consume_signed_record)
        for module in targets:
            setattr(module, "maybe_consume_signed_record", check)
    return True


def patch_libp2p_yamux_window_updates() -> bool:
    """Batch yamux window updates as go-yamux does, for the whole process. Targets libp2p==0.8.1 (as
    patch_libp2p_signed_record_memo); called by P2PNode.start, never at import. Idempotent.

    The upstream defect: py-libp2p 0.8.1's `YamuxStream.read` returns credit to the sender after EVERY read
    ("release on read", on unless PY_YAMUX_RELEASE_ON_READ=0), so a shard read frame by frame sends one
    WINDOW_UPDATE frame back per DATA frame: a Noise message, a socket write on the reader and a read on the
    sender, each a trip through yamux and Noise in Python. With it off, the stream keeps go-yamux's hysteresis
    (an update once half the window has been read; the window still grows to 16 MiB by auto-tuning), so the
    sender is never starved of credit. Measured with bench/p2p_throughput.py: ~20 % less CPU per shard on both
    ends (docs/P2P.md, "Shard throughput over libp2p"). The same module read its PY_YAMUX_* settings with
    os.getenv on every frame (~5 % of a reading client's CPU); they are read once here instead.

    Only the flow-control bookkeeping changes: a peer still cannot send past the window it was given
    (yamux's own check), and every limit of ours (shard sizes, deadlines, per-peer streams) is untouched.
    Returns whether the patch is in place; when upstream no longer has these names, nothing is replaced and
    this logs a warning and returns False (tests/unit/test_p2p_throughput.py fails on it)."""
    import libp2p.stream_muxer.yamux.yamux as yamux

    if not all(callable(getattr(yamux, name, None)) for name in ("_yamux_release_on_read", "_py_yamux_env")):
        log.warning("py-libp2p's yamux has no _yamux_release_on_read/_py_yamux_env where libp2p==%s had them: "
                    "a window update is sent per read (node/p2p/service.py)", LIBP2P_PATCHED_VERSION)
        return False
    if getattr(yamux._yamux_release_on_read, "batched", False):
        return True
    read_once = functools.lru_cache(maxsize=64)(yamux._py_yamux_env)

    def release_on_read() -> bool:
        return False

    release_on_read.batched = True  # type: ignore[attr-defined]
    release_on_read.replaced = yamux._yamux_release_on_read  # type: ignore[attr-defined]  # (for the tests)
    yamux._py_yamux_env = read_once
    yamux._yamux_release_on_read = release_on_read
    return True


def _peer_name(peer_id_bytes: bytes) -> str:
    try:
        return ID(peer_id_bytes).to_base58()
    except Exception:
        return "an unreadable peer id"


def parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    if not isinstance(addr, str) or not addr.startswith("/") or len(addr) > MAX_MULTIADDR_CHARS:
        raise InvalidMultiaddr(f"{str(addr)[:80]!r} is not a multiaddr")
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as e:
        raise InvalidMultiaddr(f"{addr[:80]!r} is not a valid multiaddr: {e}") from None


class GuardedPubsub(Pubsub):
    """Pubsub whose inbound messages pass our cheap checks before libp2p's (signature first) and
    whose silent drops are counted. Own publishes (forwarder = this host) take the stock path."""

    def __init__(self, *args: Any, guard: "P2PService", **kw: Any):
        super().__init__(*args, **kw)
        self._guard = guard

    async def push_msg(self, msg_forwarder: ID, msg: Any) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)
            return
        if self._is_msg_seen(msg):  # a duplicate through another mesh peer: the normal case, free
            return
        if not self._guard.precheck(msg_forwarder, msg):
            return
        try:
            await super().push_msg(msg_forwarder, msg)
        except BaseException:  # cancelled (shutdown): forget it, count nothing
            self._guard.settled(msg_forwarder, msg, accepted=None)
            raise
        self._guard.settled(msg_forwarder, msg, accepted=self._is_msg_seen(msg))


# gossipsub v1.2's IDONTWANT is for large messages (the spec's own words); go-libp2p sends it only for messages
# of at least this many bytes (GossipSubIDontWantMessageThreshold), py-libp2p 0.8.1 for every message.
IDONTWANT_MIN_BYTES = 1024


class RunGossipSub(GossipSub):
    """py-libp2p 0.8.1's GossipSub with two of its behaviours changed, each by an override (nothing is patched):

    - Peer exchange is ignored. We never ask for it (do_px is off), but py-libp2p dials every peer a PRUNE's PX
      list names, at the addresses of a signed record the sender can make for any key of its own: one hostile
      peer could make us dial anywhere. Peers come from verified announcements instead.
    - IDONTWANT only for a message of at least IDONTWANT_MIN_BYTES, as go-libp2p. py-libp2p tells every mesh
      peer "don't send me this" for every message it receives: one more RPC (Noise, yamux, a signed peer
      record, all in Python) per mesh peer per announcement, to save resending a few hundred bytes. A `have`
      is ~0.5 KB; in the WAN lab at N = 12 these RPCs were ~1/8 of a node's time holding the GIL (py-spy).
      A message the cache cannot name (another message-id function) keeps py-libp2p's behaviour."""

    async def _do_px(self, px_peers: Any) -> None:
        return None

    async def _emit_idontwant_for_message(self, msg_id: bytes, topic_ids: Any) -> None:
        msg = self.mcache.get(msg_id)  # publish() put it there just before calling this
        if msg is not None and len(msg.data) < IDONTWANT_MIN_BYTES:
            return
        await super()._emit_idontwant_for_message(msg_id, topic_ids)


class P2PService:
    """`cfg`: the host's P2PConfig, read here where each setting is used (P2PNode passes it whole). The rest is
    the host's: its listen multiaddrs, run, coordinator key, shard store, counters, the callback for
    validated announcements, and the upload cap's tokens when its HTTP shard server shares them
    (rate_limit.SharedBucket)."""

    def __init__(self, identity: Identity, cfg: P2PConfig, *, run_id: str, coordinator_key: str | None,
                 listen_addrs: Sequence[str], store: ShardStore | None, stats: P2PStats,
                 on_announcement: Callable[[AnnouncementEvent], None], upload_bucket: Any = None):
        self.identity = identity
        self.cfg = cfg
        self.run_id, self.coordinator_key = run_id, coordinator_key
        self._listen = tuple(listen_addrs)
        self.stats = stats
        self.topic = topic_for_run(run_id)
        self._on_announcement = on_announcement
        self._validated: OrderedDict[tuple[bytes, bytes], Any] = OrderedDict()
        self._rejected: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        # Pre-checked, waiting for the signature checks (popped within the same push_msg call).
        self._prechecked: OrderedDict[tuple[bytes, bytes], CheckedAnnouncement] = OrderedDict()
        self.gossip_limit = KeyedRateLimit(cfg.gossip_rate_limit, cfg.gossip_rate_limit * GOSSIP_BURST_S)
        self.drop_log = PeerEventLog(log, "announcements dropped", interval_s=PEER_LOG_INTERVAL_S)
        self.server = ShardServer(store, stats=stats, max_concurrent=cfg.max_concurrent_streams,
                                  max_bytes=cfg.max_shard_bytes, read_timeout_s=cfg.read_timeout_s,
                                  upload_limit=cfg.upload_limit, request_timeout_s=cfg.request_timeout_s,
                                  max_streams_per_peer=cfg.max_streams_per_peer,
                                  log_interval_s=PEER_LOG_INTERVAL_S, upload_bucket=upload_bucket)
        self.host: Any = None
        self.pubsub: Pubsub | None = None
        self.gossipsub: GossipSub | None = None
        self.relay: nat.Relaying | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, stop: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listen = [parse_multiaddr(a) for a in self._listen]
        key_pair = libp2p_key_pair(self.identity)
        noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        self.host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            listen_addrs=listen or None,
            # We announce our listen addresses ourselves; "observed" ones of a NATed node are not dialable.
            disable_identify_address_discovery=True,
        )
        self.gossipsub = RunGossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12,
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            max_messages_per_topic_per_second=float(self.cfg.gossip_rate_limit * GOSSIPSUB_LIMIT_FACTOR),
            # py-libp2p's adaptive gossip stretches a 1 s heartbeat to 30-60 s whenever a mesh is below its
            # degree (any swarm under 7 peers): mesh upkeep and gossip then stall, the message cache is not
            # trimmed and each new subscriber is replayed hundreds of stale announcements
            # (docs/benchmarks/history.md, "Broadcast: how the N = 16 round went from 70 s to 10 s").
            adaptive_gossip_enabled=False,
        )
        self.pubsub = GuardedPubsub(self.host, self.gossipsub, strict_signing=True, allowed_topics={self.topic},
                                    guard=self)
        self.host.set_stream_handler(TProtocol(PROTOCOL_ID), self.server.handle)
        try:
            async with self.host.run(listen):
                # py-libp2p's auto-connector would keep re-dialling every peer in the peerstore
                # (up to 200 at a time); we dial only whom we decide to (bootstrap, fetch targets).
                await self.host.get_network().auto_connector.stop()
                if listen and not self.host.get_transport_addrs():
                    # py-libp2p logs a failed bind (e.g. port in use) and carries on without a listener.
                    raise P2PError(f"could not listen on {', '.join(map(str, listen))} (address in use?)")
                self.relay = nat.Relaying(self.host, self.cfg)
                async with contextlib.AsyncExitStack() as services:
                    for service in (self.pubsub, self.gossipsub, self.relay.protocol, self.relay.dcutr):
                        if service is not None:
                            await services.enter_async_context(background_trio_service(service))
                    await self.relay.started()
                    await self.pubsub.wait_until_ready()
                    self.pubsub.set_topic_validator(self.topic, self._validate, False)
                    subscription = await self.pubsub.subscribe(self.topic)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, subscription)
                        nursery.start_soon(self._flush_logs)
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

    def is_connected(self, peer: ID) -> bool:
        return bool(self.host.get_network().connections.get(peer))

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    async def connect(self, addr: str, timeout_s: float | None = None) -> str:
        """Dial `addr` (ending in /p2p/<peer id>); return the peer id once its pubsub stream is up."""
        limit = timeout_s or self.cfg.connect_timeout_s
        maddr = parse_multiaddr(addr)
        try:
            info = info_from_p2p_addr(maddr)
        except Exception as e:
            raise InvalidMultiaddr(f"{addr[:80]!r} has no /p2p/<peer id> part: {e}") from None
        if info.peer_id == self.host.get_id():
            raise InvalidMultiaddr(f"{addr[:80]!r} is this node itself")
        if not self.host.get_network().connections.get(info.peer_id):
            # Dial the address we were given, not whatever the peerstore picked up about this peer (its
            # signed peer record, identify): those are the peer's own claims, never filtered.
            self.host.get_peerstore().clear_addrs(info.peer_id)
        try:
            with trio.fail_after(limit):
                await self.host.connect(info)
        except trio.TooSlowError:
            raise PeerUnavailable(f"could not connect to {addr[:120]} within {limit:.1f} s") from None
        except Exception as e:
            raise PeerUnavailable(f"could not connect to {addr[:120]}: {type(e).__name__}: {e}"[:300]) from None
        # Best effort: announcements flow once the peer's pubsub stream exists (usually ms).
        assert self.pubsub is not None  # set by run() before anything is called
        with trio.move_on_after(self.cfg.connect_timeout_s):
            await self.pubsub.wait_for_peer(info.peer_id, timeout=self.cfg.connect_timeout_s)
        return info.peer_id.to_base58()

    async def wait_for_mesh(self, peer: str, timeout_s: float) -> bool:
        """True once `peer` is in our gossip mesh for the run topic (so our publishes reach it)."""
        assert self.pubsub is not None  # set by run() before anything is called
        try:
            await self.pubsub.wait_for_mesh(ID.from_base58(peer), self.topic, timeout=timeout_s)
            return True
        except trio.TooSlowError:
            return False

    async def publish(self, data: bytes) -> None:
        assert self.pubsub is not None  # set by run() before anything is called
        await self.pubsub.publish(self.topic, data)

    async def fetch(self, peer: ID, req: ShardRequest, addrs: tuple[str, ...], timeout_s: float | None) -> bytes:
        if not self.host.get_network().connections.get(peer):
            # Learned from its announcement (and allowed by the address policy); the peerstore entry lets
            # new_stream dial it, and only it: the peer's own records in the peerstore are not dialled.
            good: list[multiaddr.Multiaddr] = []
            circuits: list[multiaddr.Multiaddr] = []
            for a in addrs:
                if is_http_addr(a) or not multiaddr_allowed(a, self.cfg.allow_private_addrs):
                    continue  # the HTTP data plane's address, or one a stranger must not make us dial
                try:
                    (circuits if nat.is_circuit(a) else good).append(parse_multiaddr(a))
                except InvalidMultiaddr:
                    continue
            if not good and circuits:  # a NATed holder: through a relay it keeps a reservation on (nat.py)
                await self._dial_circuit(peer, circuits)
                return await fetch_shard(self.host, peer, req, stats=self.stats,
                                         read_timeout_s=self.cfg.read_timeout_s,
                                         open_timeout_s=self.cfg.connect_timeout_s, timeout_s=timeout_s)
            if not good:
                raise PeerUnavailable(f"peer {peer.to_base58()} is not connected and announced no address we may dial")
            self.host.get_peerstore().clear_addrs(peer)
            self.host.get_peerstore().add_addrs(peer, good, 600)
            # The dial under its own short limit (not the stream-open one): an address nobody answers at
            # (NAT, an unforwarded port) used to cost connect_timeout_s (10 s) per fetch attempt.
            limit = self.cfg.dial_timeout_s
            try:
                with trio.fail_after(limit):
                    await self.host.connect(PeerInfo(peer, good))
            except trio.TooSlowError:
                raise PeerUnavailable(f"could not dial {peer.to_base58()} within {limit:.1f} s") from None
            except Exception as e:
                raise PeerUnavailable(f"could not dial {peer.to_base58()}: {type(e).__name__}: {e}"[:300]) from None
        return await fetch_shard(self.host, peer, req, stats=self.stats, read_timeout_s=self.cfg.read_timeout_s,
                                 open_timeout_s=self.cfg.connect_timeout_s, timeout_s=timeout_s)

    async def _dial_circuit(self, peer: ID, circuits: list[multiaddr.Multiaddr]) -> None:
        """Connect to `peer` through the first relay of `circuits` that works (each within dial_timeout_s)."""
        assert self.relay is not None  # set by run() before anything is called
        limit = self.cfg.dial_timeout_s
        errors = []
        for circuit in circuits[:2]:
            try:
                with trio.fail_after(limit * 2):  # the relay's dial, then the relay's stream to the peer
                    await self.relay.dial(circuit, peer, dial_timeout_s=limit)
                return
            except trio.TooSlowError:
                errors.append(f"{circuit}: no circuit within {2 * limit:.1f} s")
            except Exception as e:
                errors.append(f"{circuit}: {type(e).__name__}: {e}")
        raise PeerUnavailable(f"could not reach {peer.to_base58()} through a relay: {'; '.join(errors)}"[:300])

    async def reserve(self, relay: str) -> float:
        """Reserve a slot on `relay` (connected) for peers to reach us through it; the reservation's expiry."""
        assert self.relay is not None  # set by run() before anything is called
        try:
            with trio.fail_after(self.cfg.connect_timeout_s):
                return await self.relay.reserve(ID.from_base58(relay))
        except trio.TooSlowError:
            raise P2PError(f"relay {relay} did not answer a reservation within "
                           f"{self.cfg.connect_timeout_s:.0f} s") from None

    def set_public_ip(self, ip: str | None) -> None:
        """The address the join's dial-back saw us at: what DCUtR advertises (with our listen port)."""
        if self.relay is not None:
            self.relay.public_ip = ip

    def relay_stats(self) -> dict:
        return self.relay.snapshot() if self.relay is not None else {}

    def relay_reserved_nodes(self) -> list[str]:
        return self.relay.reserved_nodes() if self.relay is not None else []

    # --- announcements -------------------------------------------------------------------------
    def precheck(self, forwarder: ID, msg: Any) -> bool:
        """Everything that costs no signature check, before libp2p's: rate, topic, size, content."""
        if not self.gossip_limit.allow(forwarder):
            self._drop(forwarder, msg, "rate_limited", f"over {self.cfg.gossip_rate_limit} messages/s")
            return False
        if len(msg.topicIDs) != 1 or msg.topicIDs[0] != self.topic:
            self._drop(forwarder, msg, "wrong_topic", f"topics {list(msg.topicIDs)[:4]!r}"[:200], penalize=True)
            return False
        try:
            checked = self._precheck_content(msg)
        except AnnouncementRejected as e:
            self._drop(forwarder, msg, e.reason, str(e), penalize=True)
            return False
        self._prechecked[(bytes(msg.from_id), bytes(msg.seqno))] = checked
        while len(self._prechecked) > _VALIDATED_CACHE:
            self._prechecked.popitem(last=False)
        return True

    def _validate(self, forwarder: ID, msg: Any) -> bool:
        """Gossipsub topic validator (sync). Invalid messages are neither delivered nor relayed."""
        key = (bytes(msg.from_id), bytes(msg.seqno))
        try:
            checked = self._prechecked.pop(key, None)
            if checked is None:  # our own publish, or pre-checked long ago
                checked = self._precheck_content(msg)
            ann = verify_announcement(checked)
        except AnnouncementRejected as e:
            self._drop(forwarder, msg, e.reason, str(e))
            self._rejected[key] = None
            while len(self._rejected) > _REJECTED_CACHE:
                self._rejected.popitem(last=False)
            return False
        self._validated[key] = ann
        while len(self._validated) > _VALIDATED_CACHE:
            self._validated.popitem(last=False)
        return True

    def settled(self, forwarder: ID, msg: Any, *, accepted: bool | None) -> None:
        """After pubsub handled a pre-checked message: if it was refused and our validator did not
        say so (libp2p's message signature check, its peer score, a cached verdict), count it.
        `accepted=None`: handling was interrupted; only forget it."""
        key = (bytes(msg.from_id), bytes(msg.seqno))
        self._prechecked.pop(key, None)
        if key in self._rejected:
            del self._rejected[key]
        elif accepted is False:
            self._drop(forwarder, msg, "libp2p_rejected", "gossip message signature, peer score or an earlier verdict")

    def _precheck_content(self, msg: Any) -> CheckedAnnouncement:
        try:
            origin_node: str | None = node_id_for_peer(ID(msg.from_id))
        except (P2PError, ValueError, TypeError):
            origin_node = None
        return precheck_announcement(msg.data, run_id=self.run_id, coordinator_key=self.coordinator_key,
                                     origin_node_id=origin_node, max_age_s=self.cfg.announce_max_age_s)

    def _drop(self, forwarder: ID, msg: Any, reason: str, detail: str, *, penalize: bool = False) -> None:
        peer = forwarder.to_base58()  # cached on the connection's ID object
        self.stats.count_dropped(reason, peer)
        origin = bytes(msg.from_id)
        if origin != forwarder.to_bytes():  # named only if a line is written (base58 is slow)
            self.drop_log.note(peer, reason, lambda: f"{detail} (originated by {_peer_name(origin)})")
        else:
            self.drop_log.note(peer, reason, detail)
        scorer = getattr(self.gossipsub, "scorer", None) if penalize else None
        if scorer is not None:  # what pubsub does for a message its validators refuse
            scorer.on_invalid_message(forwarder, self.topic)

    async def _flush_logs(self) -> None:
        while True:
            await trio.sleep(LOG_FLUSH_S)
            self.drop_log.flush()
            self.server.refusal_log.flush()

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
