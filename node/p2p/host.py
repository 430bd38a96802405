"""`P2PNode`: the asyncio face of the libp2p host (which runs on trio in its own thread).

    node = P2PNode(identity, cfg.p2p, run_id="run-1",      # cfg.p2p: P2PConfig (node/p2p/config.py)
                   coordinator_key=COORD_HEX, shard_root=Path("ckpts"))
    addrs = await node.start()                      # ["/ip4/127.0.0.1/tcp/40123/p2p/12D3Koo…"]
    await node.connect(bootstrap_addrs)             # -> peer ids reached
    sub = node.subscribe()                          # async iterator of AnnouncementEvent
    await node.announce_have(step, [0, 1, 2], manifest_hash)
    data = await node.fetch_shard(peer_id, step, index, max_bytes, manifest_hash=h)
    node.peers_with(step, index, manifest_hash=h)   # from announcements, newest first
    await node.stop()

The coordinator runs one too and calls `await node.announce_manifest(step, manifest_hash)`.
`p2p.listen = false` makes an outbound-only node (it can still fetch from peers it dials, and serve
them over those connections). Peer ids are base58 libp2p ids; a node id (64 hex) is accepted wherever a
peer is expected, since both name the same Ed25519 key. Importing this module is cheap: libp2p
and trio load when the node starts.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import re
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from protocol.identity import Identity, parse_public_key

from .announce import (
    AnnouncementEvent,
    HaveAnnouncement,
    ManifestAnnouncement,
    encode_have_announcement,
    encode_manifest_announcement,
)
from .bridge import TrioBridge
from .config import P2PConfig
from .errors import P2PError, P2PNotRunning, PeerUnavailable, ShardPeerGone
from .peer_table import PeerTable
from .shard_store import ShardGetter, ShardStore, as_store
from .stats import P2PStats

log = logging.getLogger(__name__)

RUN_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # the announcement schema's RunId
NAT_INTERVAL_S = 5.0  # a NATed node's keeper (nat.py) checks its connections and reservations this often
# The longest a thread that wants the GIL waits for a busy one to hand it over (CPython's default: 5 ms). The libp2p
# host runs on its own trio thread; a shard request wakes it ~10 times per end (frames, window updates, the bridge),
# and each wake-up waited for the GIL behind a worker's generation thread: a 128 KiB peer shard took 92 ms with a
# busy Python thread in both processes, 48 ms at 1 ms (HTTP plane: 21 -> 13 ms; bench/p2p_throughput.py --gil-busy,
# docs/P2P.md, "Shard throughput over libp2p"). Lowered, never raised, when a host starts: process-wide.
GIL_SWITCH_INTERVAL_S = 0.001
# Our own announcements per second. Gossipsub drops, without telling anyone, what a peer sends
# beyond its per-forwarder limit (10/s in stock py-libp2p, which we apply to ourselves as well):
# pacing here turns a would-be silent loss into a short wait.
PUBLISH_PER_SECOND = 8
GOSSIP_DIALS = 8  # announcers a node dials itself (gossipsub's mesh degree is 6, up to 12)
# A fetcher asks at most this many holders for a shard, direct ones first (node/worker/peers.py PeerSource), before
# it defers: a NATed node's `have` for a shard with this many direct holders known would never be used
# (P2PNode.worth_naming).
HOLDER_TRIES = 4
SUBSCRIBER_LOG_INTERVAL_S = 60.0  # "subscriber is behind" is logged at most this often per subscription


WILDCARD_IPS = ("0.0.0.0", "::")  # "all interfaces" to a listener, "this machine" to a dialer


def _ip_of(addr: str) -> str | None:
    """The IP literal of /ip4/<ip>/... or /ip6/<ip>/..., else None."""
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


class AnnouncementSubscription:
    """Async iterator over announcements from other nodes. Bounded: when the consumer falls behind
    by `maxsize` events, new ones are dropped (and counted) rather than buffered without limit."""

    _END = object()

    def __init__(self, node: "P2PNode", maxsize: int):
        self._node = node
        self._queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.dropped = 0
        self.closed = False
        self._logged_at: float | None = None
        self._logged_dropped = 0

    def _offer(self, event: AnnouncementEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            self._node.stats.count_undelivered()
            now = time.monotonic()
            if self._logged_at is None or now - self._logged_at >= SUBSCRIBER_LOG_INTERVAL_S:
                log.warning("p2p: announcement subscriber is behind; %d dropped (%d since the last report)",
                            self.dropped, self.dropped - self._logged_dropped)
                self._logged_at, self._logged_dropped = now, self.dropped

    def _end(self) -> None:
        self.closed = True
        while True:  # make room for the end marker; the consumer is gone or the node stopped
            try:
                self._queue.put_nowait(self._END)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()

    def close(self) -> None:
        self._node._subscriptions.discard(self)
        self._end()

    def __aiter__(self) -> "AnnouncementSubscription":
        return self

    async def __anext__(self) -> AnnouncementEvent:
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(self._END)  # later calls also end
            raise StopAsyncIteration
        return item

    async def get(self, timeout: float | None = None) -> AnnouncementEvent:
        """Next announcement; StopAsyncIteration once closed, asyncio.TimeoutError after `timeout`."""
        return await asyncio.wait_for(self.__anext__(), timeout)


class P2PNode:
    def __init__(self, identity: Identity, cfg: P2PConfig, *, run_id: str, coordinator_key: str | None = None,
                 shard_root: str | os.PathLike | None = None, shard_source: ShardStore | ShardGetter | None = None,
                 name: str | None = None, nat_interval_s: float = NAT_INTERVAL_S, relay_reserve: bool = True):
        """`cfg` is the node's `[p2p]` section (node/p2p/config.py), taken whole and read where each setting is
        used: a new p2p setting is a field there plus its use, nothing in between (tests/unit/test_p2p_settings.py
        fails on a field nobody reads or on one copied into a parameter list). `cfg.relay_hop` None means off
        here; the coordinator and the relay resolve their role's default before passing it. The other arguments
        are not settings: who we are (identity, run, the coordinator's key), what we serve (a shard directory
        or source), the trio thread's name, and the NAT keeper's cadence and whether it reserves relay slots
        (tests shorten the one and turn off the other)."""
        if shard_root is not None and shard_source is not None:
            raise ValueError("give shard_root or shard_source, not both")
        if not RUN_ID_RE.fullmatch(run_id):
            raise P2PError(f"run id {run_id[:80]!r} must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        if coordinator_key is not None:
            try:
                parse_public_key(coordinator_key)
            except ValueError as e:  # a typo here would silently drop every manifest announcement
                raise P2PError(f"coordinator key is not an Ed25519 public key: {e}") from None
        # Our own copy: the values a host started with stay its values, whatever the caller's object does later.
        self.cfg = cfg.model_copy(deep=True)
        self.identity = identity
        self.run_id = run_id
        self.coordinator_key = coordinator_key.lower() if coordinator_key else None
        self.store = as_store(shard_root if shard_root is not None else shard_source)
        # peer -> (when our last dial to it failed, the addresses it had announced then) (bounded): not dialled
        # again for dial_retry_s, and ranked last, unless it announces other addresses (recently_failed)
        self._dial_failed: collections.OrderedDict[str, tuple[float, tuple[str, ...]]] = collections.OrderedDict()
        # The join's dial-back verdict on our libp2p port (apply_reachability): None until told.
        self.reachable: bool | None = None
        self.stats = P2PStats()
        # Peers' addresses (announced, or hinted by the origin) that are loopback/private/link-local are
        # dropped unless allowed (addrs.py): strangers must not steer this node at internal services.
        self.table = PeerTable(allow_private_addrs=cfg.allow_private_addrs)
        self._bridge = TrioBridge(name or identity.node_id[:8])
        self._service: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscriptions: set[AnnouncementSubscription] = set()
        self._listeners: list[Callable[[AnnouncementEvent], None]] = []
        self._published: collections.deque[float] = collections.deque()
        self._publish_lock = asyncio.Lock()
        self.listen_addrs: list[str] = []
        self.announce_addrs: list[str] = []  # what we announce now (the dial-back and relay circuits change it)
        # The HTTP data plane (http_shards.py): served if we listen and hold shards, used towards every
        # peer that announces it, until it fails for that peer (then libp2p carries its shards).
        self._http_server: Any = None
        self._http_port_bound: int | None = None
        self._http_session: Any = None
        self._http_failed: set[str] = set()
        # One upload cap for both planes: libp2p's streams and the HTTP server take from the same tokens.
        self._upload_bucket = None
        if cfg.http and cfg.upload_limit > 0:
            from node.rate_limit import SharedBucket

            self._upload_bucket = SharedBucket(cfg.upload_limit, burst=max(64 * 1024, cfg.upload_limit * 0.05))
        # Announcers we dialled so that gossip has more paths than the bootstrap hub (shard fetches over
        # libp2p used to make those connections as a side effect; over HTTP they do not).
        self._dialled: set[str] = set()
        self._dials: set[asyncio.Task] = set()
        # NATed nodes serve too (nat.py): kept connections to reachable peers, relay reservations, circuits.
        self._nat_interval_s, self._relay_reserve = nat_interval_s, relay_reserve
        # Peers we chose to connect to (bootstrap: the coordinator, relays): kept and asked for reservations.
        self._chosen: collections.OrderedDict[str, str] = collections.OrderedDict()  # peer -> the address reached
        self._nat_task: asyncio.Task | None = None
        self.nat_keeper: Any = None
        self._totals_task: asyncio.Task | None = None

    @property
    def listen_multiaddrs(self) -> list[str]:
        """Where the host listens (port 0: any free one): [] for an outbound-only node (`listen = false`)."""
        return [f"/ip4/{self.cfg.listen_host}/tcp/{self.cfg.listen_port}"] if self.cfg.listen else []

    # --- lifecycle -----------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @functools.cached_property
    def peer_id(self) -> str:
        from .keys import peer_id_for_node

        return peer_id_for_node(self.identity.node_id).to_base58()

    @property
    def running(self) -> bool:
        return self._bridge.running

    async def start(self) -> list[str]:
        """Start the host and dial `bootstrap` (best effort); return the listen multiaddrs (with
        /p2p/<peer id>; empty if outbound-only). A P2PNode is started once: make a new one to restart."""
        from .service import P2PService  # libp2p + trio load here, not at import
        from .service import patch_libp2p_signed_record_memo, patch_libp2p_yamux_window_updates

        patch_libp2p_signed_record_memo()  # process-wide, idempotent: py-libp2p 0.8.1's defects, worked around
        patch_libp2p_yamux_window_updates()
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._loop = asyncio.get_running_loop()
        self._service = P2PService(self.identity, self.cfg, run_id=self.run_id, coordinator_key=self.coordinator_key,
                                   listen_addrs=self.listen_multiaddrs, store=self.store, stats=self.stats,
                                   on_announcement=self._from_trio, upload_bucket=self._upload_bucket)
        try:
            self.listen_addrs = await self._bridge.start(self._service.run)
        except OSError as e:  # e.g. the listen port is taken
            raise P2PError(f"p2p host could not start on {self.listen_multiaddrs}: {e}") from None
        self.announce_addrs = self._addrs_to_announce()
        if self.cfg.http:
            await self._start_http()
        log.info("p2p node %s listening on %s", self.peer_id, self.listen_addrs or "nothing (outbound-only)")
        self._totals_task = asyncio.get_running_loop().create_task(self._log_totals(), name="p2p-totals")
        if self.cfg.bootstrap:
            try:
                await self.connect(self.cfg.bootstrap)
            except P2PError as e:  # the coordinator's list may be stale; the node can run without peers
                log.warning("p2p bootstrap: %s", e)
        return list(self.listen_addrs)

    @property
    def http_shard_addr(self) -> str | None:
        """Our HTTP shard server's announced address (/ip4/<ip>/tcp/<port>/http), if we serve one."""
        from .http_shards import is_http_addr

        return next(filter(is_http_addr, self.announce_addrs), None) if self._http_server else None

    @property
    def origin_shard_addrs(self) -> list[str]:
        """Where we serve shards, as told to the origin with our swarm shard requests (X-Prime-Shard-Addr) so that
        super-seeding can name us as a first holder: our HTTP shard server first (an older origin reads only the
        first), then our first direct libp2p address (not a relay circuit). The origin repeats only what its
        join's dial-back reached (node/coordinator/seeding.py)."""
        from .http_shards import is_http_addr
        from .nat import is_circuit

        http = self.http_shard_addr
        direct = next((a for a in self.announce_addrs if not is_http_addr(a) and not is_circuit(a)), None)
        return [a for a in (http, direct) if a is not None]

    async def _start_http(self) -> None:
        """Fetch over HTTP from peers that offer it; serve ours if we listen and hold shards. It is announced
        with an address peers can dial: an announce override's host, a listen host that is not a wildcard,
        or (apply_reachability) the address the coordinator dialled it back at."""
        import aiohttp

        from ..aio import counted_session
        from .http_shards import HttpShardServer, http_addr

        self._http_session = counted_session(connector=aiohttp.TCPConnector(limit=64, limit_per_host=8),
                                             auto_decompress=False)
        host = next((h for h in map(_ip_of, self.announce_addrs) if h and h not in WILDCARD_IPS), None)
        listen_host = next((_ip_of(a) for a in self.listen_multiaddrs), None)
        if self.store is None or not self.listen_addrs or listen_host is None:
            return
        cfg = self.cfg
        self._http_server = HttpShardServer(self.store, stats=self.stats, max_concurrent=cfg.max_concurrent_streams,
                                            max_bytes=cfg.max_shard_bytes, read_timeout_s=cfg.read_timeout_s,
                                            upload_limit=cfg.upload_limit, upload_bucket=self._upload_bucket)
        try:
            port = await self._http_server.start(listen_host, cfg.http_port)
        except OSError as e:  # the node still serves over libp2p
            log.warning("p2p: HTTP shard server could not listen on %s:%s (%s); serving over libp2p only",
                        listen_host, cfg.http_port, e)
            self._http_server = None
            return
        self._http_port_bound = port
        if host is not None:
            self.announce_addrs = [*self.announce_addrs[:7], http_addr(host, port)]

    @property
    def http_session(self) -> Any:
        """The HTTP client for peers' shard servers (None without `p2p.http`, or before start)."""
        return self._http_session

    def listen_ports(self) -> dict[str, int | None]:
        """The TCP ports we accept connections on, for the coordinator's dial-back (messages.ListenPorts)."""
        tcp = next((a.split("/")[4] for a in self.listen_addrs if a.split("/")[3:4] == ["tcp"]), None)
        return {"libp2p": int(tcp) if tcp else None,
                "http": self._http_port_bound if self._http_server is not None else None}

    def apply_reachability(self, observed_ip: str, libp2p: bool | None, http: bool | None) -> list[str]:
        """The join's dial-back (docs/P2P.md "Reachability"): announce exactly what the coordinator reached, the
        address it saw us at with the ports it dialled back (and only if our address policy would let a peer
        dial it), or nothing if it reached neither. A port not tried (None) keeps what we announced; so does
        an operator's `announce_addrs` (port forwarding to other ports: the operator's word). Returns what we
        announce from now on."""
        from .addrs import multiaddr_allowed
        from .http_shards import http_addr, is_http_addr

        self.reachable = libp2p
        if self._service is not None:  # what DCUtR advertises for hole punching (nat.py), with our listen port
            self._service.set_public_ip(observed_ip)
        if libp2p is False and not self.cfg.announce_addrs:
            self._start_nat_keeper()
        elif libp2p and self._nat_task is not None:
            self._nat_task.cancel()
            self._nat_task = None
        if self.cfg.announce_addrs or (libp2p is None and http is None):
            return self.announce_addrs
        proto = "ip6" if ":" in observed_ip else "ip4"
        ports = self.listen_ports()
        addrs = [a for a in self.announce_addrs if (is_http_addr(a) and http is None)
                 or (not is_http_addr(a) and libp2p is None)]
        if libp2p and ports["libp2p"]:
            addrs.insert(0, f"/{proto}/{observed_ip}/tcp/{ports['libp2p']}/p2p/{self.peer_id}")
        if http and ports["http"]:
            addrs.append(http_addr(observed_ip, ports["http"]))
        self.announce_addrs = [a for a in addrs if multiaddr_allowed(a, self.cfg.allow_private_addrs)][:8]
        return self.announce_addrs

    def _start_nat_keeper(self) -> None:
        """Unreachable: keep connections to reachable peers and relay reservations (nat.py), from now on."""
        from .nat import NatKeeper

        keep = self.cfg.nat_keep_peers
        if self._nat_task is not None or (keep <= 0 and not self._relay_reserve) or not self.running:
            return
        self.nat_keeper = NatKeeper(self, keep=keep, interval_s=self._nat_interval_s, reserve=self._relay_reserve)
        self._nat_task = asyncio.get_running_loop().create_task(self.nat_keeper.run(), name="p2p-nat")

    def set_circuit_addrs(self, circuits: Sequence[str]) -> None:
        """Announce these relay circuits (nat.py) in place of the circuits announced before."""
        from .nat import is_circuit

        self.announce_addrs = [*(a for a in self.announce_addrs if not is_circuit(a)), *circuits][:8]

    def known_bootstrap(self) -> list[tuple[str, str]]:
        """(address, peer) of the peers this node chose to connect to (bootstrap: the coordinator, relays)."""
        return [(addr, peer) for peer, addr in self._chosen.items()]

    def recently_failed(self, peer: str, now: float | None = None) -> bool:
        """Our dial to `peer` failed less than dial_retry_s ago, at the addresses it announces now. A failure is
        remembered for the addresses that failed: a NATed holder asked before its relay reservation (it announced
        nothing) or through a relay since dropped is tried again as soon as it announces a new circuit (in the
        WAN lab the first kind kept two homes from fetching from each other for 60 s, the whole run)."""
        failed = self._dial_failed.get(peer)
        return (failed is not None and (now or time.monotonic()) - failed[0] < self.cfg.dial_retry_s
                and failed[1] == self.table.addrs_of(peer))

    async def reserve_on(self, relay: str) -> float:
        """A circuit relay v2 reservation on `relay` (connected); its expiry in unix seconds (raises P2PError)."""
        return await self._bridge.call(self._service.reserve, relay)

    async def relay_stats(self) -> dict:
        """Circuit relay counters (nat.Relaying.snapshot): reservations made and refused, circuits in and out,
        and for a hop, the reservations and circuits it holds now."""
        return await self._bridge.call(self._async(self._service.relay_stats))

    async def relay_reserved_nodes(self) -> list[str]:
        """Node ids holding a live reservation on our hop: reachable through us (empty unless we are a hop)."""
        return await self._bridge.call(self._async(self._service.relay_reserved_nodes))

    async def _log_totals(self) -> None:
        """One line with the bytes served and fetched (and the relay counters) every `stats_log_s` in which
        they changed: what an operator (and the WAN lab) reads to see whether this node serves."""
        last = None
        while True:
            await asyncio.sleep(self.cfg.stats_log_s)
            t = self.stats.totals()
            try:
                relay = await self.relay_stats()
            except P2PError:
                relay = {}
            now = (t["bytes_served"], t["bytes_fetched"], tuple(sorted(relay.items())))
            if now != last:
                last = now
                log.info("p2p totals: served %d bytes, fetched %d bytes (%s); relay %s; announcements received %s;"
                         " have shards named %d, kept quiet %d", t["bytes_served"], t["bytes_fetched"],
                         {True: "reachable", False: "NATed", None: "reach ?"}[self.reachable], relay,
                         t["announcements_received"], t["have_shards_named"], t["have_shards_quiet"])

    def addrs_at(self, ip: str) -> list[str]:
        """Our libp2p address at `ip` (one of this machine's, e.g. where a request reached us) for a wildcard
        listener: [] if we do not listen."""
        ports = self.listen_ports()
        if not ports["libp2p"]:
            return []
        return [f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{ports['libp2p']}/p2p/{self.peer_id}"]

    def _addrs_to_announce(self) -> list[str]:
        """What peers should dial: the operator's public addresses if given, else our listen addresses
        minus wildcard ones (0.0.0.0 / :: mean "all interfaces" here, and "this machine" to a dialer)."""
        suffix = f"/p2p/{self.peer_id}"
        if self.cfg.announce_addrs:
            return [a if a.endswith(suffix) else a + suffix for a in self.cfg.announce_addrs][:8]
        return [a for a in self.listen_addrs if _ip_of(a) not in WILDCARD_IPS][:8]

    async def stop(self) -> None:
        """Stop the host, end every subscription, join the thread. Idempotent."""
        for task in (self._nat_task, self._totals_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._nat_task = self._totals_task = None
        for task in list(self._dials):
            task.cancel()
        await asyncio.gather(*self._dials, return_exceptions=True)
        if self._http_server is not None:
            await self._http_server.stop()
            self._http_server = None
        if self._http_session is not None:
            await self._http_session.close()
            self._http_session = None
        await self._bridge.stop()
        for sub in list(self._subscriptions):
            sub._end()
        self._subscriptions.clear()

    async def __aenter__(self) -> "P2PNode":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # --- peers ---------------------------------------------------------------------------------
    async def connect(self, addrs: Iterable[str], timeout_s: float | None = None, *, chosen: bool = True) -> list[str]:
        """Dial every multiaddr (each ending in /p2p/<peer id>) at once (each within `timeout_s`, default
        connect_timeout_s); return the peer ids reached. Raises PeerUnavailable only if addresses were given
        and none could be reached. `chosen` (bootstrap, relays; not announcers dialled for gossip): a NATed
        node keeps these connections and asks these peers for relay reservations (nat.py)."""
        addrs = list(addrs)
        if not self.running:
            raise P2PNotRunning("start the p2p node before connecting")
        results = await asyncio.gather(*(self._bridge.call(self._service.connect, a, timeout_s) for a in addrs),
                                       return_exceptions=True)
        reached, errors = [], []
        for addr, r in zip(addrs, results):
            if isinstance(r, BaseException):
                if not isinstance(r, P2PError):
                    raise r
                errors.append(str(r))
                log.warning("p2p: %s", r)
            else:
                reached.append(r)
                if chosen:
                    self._chosen[r] = addr
                    self._chosen.move_to_end(r)
                    while len(self._chosen) > 16:
                        self._chosen.popitem(last=False)
        if chosen and reached and self.nat_keeper is not None:
            self.nat_keeper.poke()  # a new relay to reserve on: now, not at the keeper's next tick (nat.py)
        if addrs and not reached:
            raise PeerUnavailable(f"could not reach any of {len(addrs)} peers: {errors[0]}")
        return reached

    async def connected_peers(self) -> list[str]:
        return await self._bridge.call(self._async(self._service.connected_peers))

    async def wait_for_mesh(self, peer: str, timeout_s: float = 5.0) -> bool:
        """True once `peer` is in our gossip mesh (our announcements then reach it directly)."""
        return await self._bridge.call(self._service.wait_for_mesh, self._peer_id(peer).to_base58(), timeout_s)

    # --- announcements -------------------------------------------------------------------------
    def subscribe(self, maxsize: int = 256) -> AnnouncementSubscription:
        """Announcements from other nodes from now on (already validated). Close it when done."""
        if not self.running:
            raise P2PNotRunning("start the p2p node before subscribing")
        sub = AnnouncementSubscription(self, maxsize)
        self._subscriptions.add(sub)
        return sub

    def add_listener(self, callback: Callable[[AnnouncementEvent], None]) -> None:
        """Call `callback(event)` on the asyncio loop for every announcement from other nodes."""
        self._listeners.append(callback)

    async def announce_manifest(self, step: int, manifest_hash: str) -> None:
        """Coordinator only: "the signed manifest for `step` is available" (signed with our key)."""
        data = encode_manifest_announcement(self.identity, run_id=self.run_id, step=step, manifest_hash=manifest_hash)
        self.table.note_manifest(step, manifest_hash)  # our own publishes are not delivered back to us
        await self._publish(data)

    async def announce_have(self, step: int, indices: Iterable[int], manifest_hash: str) -> None:
        """ "I hold shards `indices` of `step`" (signed with our key, which is our peer id), naming only those
        worth naming (`worth_naming`); nothing is published if none is."""
        named = self.worth_naming(step, indices, manifest_hash)
        if not named:
            return
        data = encode_have_announcement(self.identity, run_id=self.run_id, step=step, manifest_hash=manifest_hash,
                                        indices=named, addrs=self.announce_addrs)
        await self._publish(data)

    def worth_naming(self, step: int, indices: Iterable[int], manifest_hash: str) -> list[int]:
        """The shards of `indices` a `have` of ours should name: all of them, unless the coordinator's dial-back
        found us unreachable; then those with fewer than HOLDER_TRIES direct holders known to us. Every `have`
        reaches every node (N of them a step, each received up to the mesh degree times), and a fetcher asks at most
        HOLDER_TRIES holders, direct ones first: our `have` for the other shards would cost every node its gossip
        and never be used. (In the WAN lab at N = 24, gossip was over half of a public node's time holding the GIL,
        and the 15 NATed homes served nothing: docs/BENCHMARKS.md, "Where a node's CPU goes as N grows".)"""
        wanted = sorted(set(indices))
        named = wanted
        if self.reachable is False:
            now = time.monotonic()
            named = [i for i in wanted if sum(1 for p in self.table.peers_with(step, i, manifest_hash)
                                              if self.holder_rank(p, now) == 0) < HOLDER_TRIES]
        self.stats.count_have_shards(named=len(named), quiet=len(wanted) - len(named))
        return named

    def note_manifest(self, step: int, manifest_hash: str) -> None:
        """A manifest this node verified against the coordinator's key (the fetcher calls it): peers' `have`s
        for `step` count from now on even if the coordinator's `manifest` gossip never reached us."""
        self.table.note_manifest(step, manifest_hash)

    async def _publish(self, data: bytes) -> None:
        async with self._publish_lock:  # one sliding window of PUBLISH_PER_SECOND per node
            while len(self._published) >= PUBLISH_PER_SECOND:
                wait = self._published[0] + 1.0 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._published.popleft()
            await self._bridge.call(self._service.publish, data)
            self._published.append(time.monotonic())

    def peers_with(self, step: int, index: int, manifest_hash: str | None = None) -> list[str]:
        """Holders, newest announcer first within each rank: those that announced a direct address (reachable:
        since #26 a node announces only what the coordinator dialled back), then NATed ones reachable through a
        relay circuit (nat.py), then those that announced neither (they serve only over connections already
        open), then those whose dial failed lately."""
        now = time.monotonic()
        return sorted(self.table.peers_with(step, index, manifest_hash), key=lambda p: self.holder_rank(p, now))

    def holder_rank(self, peer: str, now: float | None = None) -> int:
        """0: announced a direct address; 1: only relay circuits; 2: nothing (serves over open connections);
        3: our dial failed lately. A caller that shuffles holders sorts by this after (peers.py)."""
        from .nat import is_circuit

        if self.recently_failed(peer, now):
            return 3
        addrs = self.table.addrs_of(peer)
        if not addrs:
            return 2
        return 1 if all(is_circuit(a) for a in addrs) else 0

    def _note_dial_failed(self, peer: str) -> None:
        self._dial_failed[peer] = (time.monotonic(), self.table.addrs_of(peer))
        self._dial_failed.move_to_end(peer)
        while len(self._dial_failed) > 4096:
            self._dial_failed.popitem(last=False)

    def manifest_hash(self, step: int) -> str | None:
        """The manifest hash the coordinator announced for `step`, if any."""
        return self.table.manifest_hash(step)

    def latest_manifest(self) -> tuple[int, str] | None:
        return self.table.latest_manifest()

    def _from_trio(self, event: AnnouncementEvent) -> None:
        """Called on the trio thread for each validated announcement: hop over to asyncio."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _deliver(self, event: AnnouncementEvent) -> None:
        ann = event.announcement
        if isinstance(ann, ManifestAnnouncement):
            self.table.record_manifest(ann)
        elif isinstance(ann, HaveAnnouncement):
            # Bounded by the signed steps we know (peer_table.py): a `have` for a step outside that window,
            # or for a manifest the coordinator did not sign, is neither kept nor passed on.
            if not self.table.record_have(event.peer_id, ann):
                return
            self._maybe_dial(event.peer_id, self.table.usable_addrs(ann.addrs))
        for sub in list(self._subscriptions):
            sub._offer(event)
        for cb in list(self._listeners):
            try:
                cb(event)
            except Exception as e:
                log.warning("announcement listener failed: %r", e)

    def _maybe_dial(self, peer: str, addrs: Sequence[str]) -> None:
        """With the HTTP data plane on, connect to up to GOSSIP_DIALS announcers: shard fetches no longer open
        libp2p connections, and gossip would otherwise only run through the star around the bootstrap node
        (most announcements never arrived: docs/benchmarks/history.md, "Broadcast: how the N = 16 round went
        from 70 s to 10 s")."""
        if (self._http_server is None or peer in self._dialled or len(self._dialled) >= GOSSIP_DIALS
                or not self.running):
            return
        from .http_shards import is_http_addr

        from .nat import is_circuit

        dialable = [a for a in addrs if "/p2p/" in a and not is_http_addr(a) and not is_circuit(a)]
        if not dialable:
            return
        self._dialled.add(peer)
        task = asyncio.get_running_loop().create_task(self._dial(dialable))
        self._dials.add(task)
        task.add_done_callback(self._dials.discard)

    async def _dial(self, addrs: list[str]) -> None:
        try:
            await self.connect(addrs[:2], self.cfg.dial_timeout_s, chosen=False)
        except P2PError as e:  # best effort: gossip still reaches us through the others
            log.debug("p2p: dialling an announcer failed: %s", e)

    # --- shards --------------------------------------------------------------------------------
    async def fetch_shard(self, peer: str, step: int, index: int, max_bytes: int, *,
                          manifest_hash: str | None = None, timeout_s: float | None = None) -> bytes:
        """The compressed bytes of shard `index` of `step` from `peer` (unverified: check the sha256
        against the signed manifest). Raises ShardNotFound / ShardBusy / ShardTooLarge /
        ShardFetchTimeout / ShardPeerGone / PeerUnavailable / ShardProtocolError."""
        from .shard_wire import ShardRequest

        pid = self._peer_id(peer)
        name = pid.to_base58()
        req = ShardRequest(step=step, index=index, manifest_hash=manifest_hash,
                           max_bytes=min(max_bytes, self.cfg.max_shard_bytes))
        addrs = self.table.addrs_of(name)
        data = await self._fetch_http(name, req, addrs)
        if data is not None:
            return data
        if self.recently_failed(name):
            # Remembered: not dialled again for a while, unless it has since connected to us (a NATed peer can).
            if not await self._bridge.call(self._async(lambda: self._service.is_connected(pid))):
                ago = time.monotonic() - self._dial_failed[name][0]
                raise PeerUnavailable(f"peer {name} could not be dialled {ago:.0f} s ago")
        try:
            return await self._bridge.call(self._service.fetch, pid, req, addrs, timeout_s)
        except ShardPeerGone:
            raise
        except PeerUnavailable:
            self._note_dial_failed(name)
            raise

    async def _fetch_http(self, peer: str, req: Any, addrs: tuple[str, ...]) -> bytes | None:
        """The shard over the peer's HTTP shard server, or None to use libp2p (it offers none, or its
        server could not be reached or did not speak the protocol: then libp2p for that peer from now on).
        An answer ("busy", "not here", "too large") is the peer's and is raised as over libp2p."""
        from .errors import ShardPeerGone, ShardFetchTimeout, ShardProtocolError
        from .http_shards import fetch_shard_http, pick_url

        if self._http_session is None or req.manifest_hash is None or peer in self._http_failed:
            return None
        url = pick_url(addrs, allow_private=self.cfg.allow_private_addrs)
        if url is None:
            return None
        try:
            return await fetch_shard_http(self._http_session, url, peer=peer, step=req.step, index=req.index,
                                          manifest_hash=req.manifest_hash, max_bytes=req.max_bytes, stats=self.stats,
                                          read_timeout_s=self.cfg.read_timeout_s,
                                          connect_timeout_s=self.cfg.dial_timeout_s,
                                          on_have=lambda held: self._heard_have(peer, req, held))
        except (ShardPeerGone, ShardFetchTimeout, ShardProtocolError) as e:
            self._http_failed.add(peer)
            log.info("p2p: HTTP to %s failed (%s); using libp2p for it", peer, e)
            return None

    def _heard_have(self, peer: str, req: Any, held: list[int]) -> None:
        """The peer's HTTP shard server said which shards of the step it holds (the fetcher looks again after
        every fetch, so no listener is called)."""
        self.table.record_hint(peer, req.step, req.manifest_hash, held)

    def _peer_id(self, peer: str) -> Any:
        from .keys import parse_peer_id

        return parse_peer_id(peer)

    @staticmethod
    def _async(fn: Callable[[], Any]) -> Callable[[], Any]:
        async def run() -> Any:
            return fn()

        return run
