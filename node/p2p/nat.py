"""NATed nodes serve too (#26 item 3): kept outbound connections and circuit relay v2.

A node the join's dial-back found unreachable (docs/P2P.md "Reachability") announces no address of its own.
Two things let it serve anyway:

- **Kept connections** (`NatKeeper`, asyncio side): it keeps libp2p connections open to up to
  `p2p.nat_keep_peers` reachable peers (those that announced a direct address) and to the nodes it was
  told to bootstrap from. A peer that holds a connection to a holder fetches over it (service.fetch dials only
  when not connected), so a reachable node fetches from a NATed one without ever dialling it.
- **Circuit relay v2** (`Relaying`, trio side): the coordinator's libp2p host (and any node with
  `p2p.relay_hop`) relays circuits, within limits. A NATed node makes its own reservations on the relays it
  is connected to (py-libp2p 0.8.1's relay discovery runs once at start and then every 300 s, before
  identify has told it which peers are relays, so its automatic reservations fail with NO_RESERVATION: we do
  not use it) and renews them before they expire; it then announces
  `<relay addr>/p2p-circuit/p2p/<its id>`, and a peer with no connection to it (another home) reaches it
  through the relay.

Only the guarded STOP handler here accepts relayed connections, and only from relays we hold a reservation
on, a bounded number at a time: otherwise any connected peer could open connections to us over its streams.
Importing this module loads neither libp2p nor trio (host.py imports it for `is_circuit`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from .config import P2PConfig
    from .host import P2PNode

log = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
MAX_STOP_HANDSHAKES = 8  # relayed connections being set up at once (each a Noise handshake over a stream)
MAX_RELAYS = 4  # relays a NATed node keeps a reservation on (each announced address names one)


def is_circuit(addr: str) -> bool:
    return CIRCUIT + "/" in addr or addr.endswith(CIRCUIT)


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """`<relay addr with /p2p/<relay id>>/p2p-circuit/p2p/<peer id>`: where peers reach `peer_id` through it."""
    return f"{relay_addr}{CIRCUIT}/p2p/{peer_id}"


def split_circuit(addr: str) -> tuple[str, str | None]:
    """(relay part, target peer id or None) of a circuit address."""
    relay, _, rest = addr.partition(CIRCUIT)
    target = rest[len("/p2p/"):] if rest.startswith("/p2p/") else None
    return relay, target


class Relaying:
    """Circuit relay v2 on one host (trio side): hop if asked, the guarded STOP side always, our reservations,
    and dialling a peer through a relay. py-libp2p's CircuitV2Protocol does the hop and the relaying of bytes;
    reservations and circuit dials are ours (its transport's discovery does not work for us, see above)."""

    def __init__(self, host: Any, cfg: P2PConfig):
        """`cfg`: the host's P2PConfig. A hop if `relay_hop` (None, the worker's role default, is off), within the
        `relay_*` limits: NATed peers holding a slot at once (one per peer: a renewal is not a new one),
        circuits open to one reserved peer at once, a circuit's life in seconds and in bytes (both directions),
        and a reservation's life unless renewed. Hole punching if `hole_punch` and the host listens (the port
        to punch)."""
        from libp2p.relay.circuit_v2.resources import RelayLimits

        self.host = host
        self.hop = hop = bool(cfg.relay_hop)
        self.protocol = _hop_protocol()(host, allow_hop=hop, limits=RelayLimits(
            duration=cfg.relay_circuit_seconds, data=cfg.relay_circuit_bytes,
            max_circuit_conns=cfg.relay_circuits_per_peer, max_reservations=cfg.relay_max_reservations,
            reservation_ttl=cfg.relay_reservation_ttl_s))
        self.reservations: dict[Any, float] = {}  # relay ID -> expiry (unix seconds) of our reservation there
        self._handshakes = 0
        self._locks: dict[Any, Any] = {}
        self.counts = {"reserved": 0, "reserve_failed": 0, "circuits_in": 0, "circuits_out": 0,
                       "circuit_failed": 0, "stop_refused": 0}
        # DCUtR (hole punching over a relayed connection): on when asked, advertising `public_addr` (set from
        # the join's dial-back: the address the coordinator saw us at) with our listen port.
        self.public_ip: str | None = None
        self.dcutr = _dcutr_protocol()(host, self, cfg.allow_private_addrs) if cfg.hole_punch and cfg.listen else None

    async def started(self) -> None:
        from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID

        await self.protocol.event_started.wait()
        # py-libp2p's STOP handler accepts a relayed connection from any peer that opens a STOP stream; ours
        # only from a relay holding our reservation, a bounded number at a time.
        self.host.set_stream_handler(STOP_PROTOCOL_ID, self._guarded_stop)

    async def _guarded_stop(self, stream: Any) -> None:
        relay = stream.muxed_conn.peer_id
        if self.reservations.get(relay, 0) < time.time() or self._handshakes >= MAX_STOP_HANDSHAKES:
            self.counts["stop_refused"] += 1
            await stream.reset()
            return
        self._handshakes += 1
        try:
            await self.protocol._handle_stop_stream(stream)
            self.counts["circuits_in"] += 1
        finally:
            self._handshakes -= 1

    async def reserve(self, relay: Any) -> float:
        """A reservation on `relay` (a connected peer): its expiry in unix seconds. Raises P2PError if refused
        or if the peer does not relay."""
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        from .errors import P2PError

        try:
            stream = await self.host.new_stream(relay, [PROTOCOL_ID])
        except Exception as e:
            self.counts["reserve_failed"] += 1
            raise P2PError(f"{relay} does not relay: {type(e).__name__}: {e}"[:300]) from None
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
        finally:
            with _quietly():
                await stream.close()
        code = resp.status if resp.HasField("status") else 0
        if code != StatusCode.OK:
            self.counts["reserve_failed"] += 1
            raise P2PError(f"relay {relay} refused a reservation: {_status_name(code)}")
        expire = float(resp.reservation.expire) if resp.HasField("reservation") and resp.reservation.expire else 0.0
        expire = expire or time.time() + 60
        self.reservations[relay] = expire
        self.counts["reserved"] += 1
        return expire

    async def dial(self, circuit: Any, peer: Any, *, dial_timeout_s: float) -> None:
        """Connect to `peer` through the relay that `circuit` (a parsed /p2p-circuit multiaddr) names: connect to
        the relay if need be, ask it to CONNECT us to `peer`, and upgrade that stream (Noise + yamux) into a
        connection the swarm serves like any other. One circuit per peer at a time."""
        import multiaddr
        import trio
        from libp2p.connection_types import ConnectionType
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.peer.peerinfo import info_from_p2p_addr
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        from .errors import PeerUnavailable

        relay_part, target = split_circuit(str(circuit))
        if target is not None and target != peer.to_base58():
            raise PeerUnavailable(f"circuit address {str(circuit)[:120]} names another peer")
        info = info_from_p2p_addr(multiaddr.Multiaddr(relay_part))
        if info.peer_id == self.host.get_id() or info.peer_id == peer:
            raise PeerUnavailable("a circuit through ourselves or the target itself")
        lock = self._locks.setdefault(peer, trio.Lock())
        async with lock:
            try:
                if self.host.get_network().connections.get(peer):
                    return  # another fetch made the circuit while we waited
                if not self.host.get_network().connections.get(info.peer_id):
                    self.host.get_peerstore().clear_addrs(info.peer_id)
                    with trio.fail_after(dial_timeout_s):
                        await self.host.connect(info)
                stream = await self.host.new_stream(info.peer_id, [PROTOCOL_ID])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                                 peer=CircuitPeerId(id=peer.to_bytes())))
                    resp = await read_delimited_msg(stream, HopMessage)
                    code = resp.status if resp.HasField("status") else 0
                    if code != StatusCode.OK:
                        raise PeerUnavailable(f"relay {info.peer_id} answered {_status_name(code)}")
                    raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                                        addresses=[circuit])
                    await self.host.upgrade_outbound_connection(raw, peer)
                except BaseException:
                    with _quietly():
                        await stream.reset()
                    raise
                self.counts["circuits_out"] += 1
            except BaseException:
                self.counts["circuit_failed"] += 1
                raise
            finally:
                if not lock.statistics().tasks_waiting:
                    self._locks.pop(peer, None)

    def reserved_nodes(self) -> list[str]:
        """The node ids of the peers holding a live reservation on our hop (none unless we are one): NATed nodes
        that every peer can reach through us, so the coordinator may give them first copies (seeding.py)."""
        from .errors import P2PError
        from .keys import node_id_for_peer

        if not self.hop:
            return []
        out = []
        for peer, r in list(self.protocol.resource_manager._reservations.items()):
            if not r.is_expired():
                try:
                    out.append(node_id_for_peer(peer))
                except P2PError:  # not an Ed25519 peer id: not a node of ours
                    continue
        return out

    def snapshot(self) -> dict:
        now = time.time()
        hop = {"hole_punched": len(self.dcutr._direct_connections)} if self.dcutr is not None else {}
        if self.hop:
            rm = self.protocol.resource_manager
            hop |= {"hop_reservations": sum(1 for r in rm._reservations.values() if not r.is_expired()),
                   "hop_circuits": len(self.protocol._active_relays)}
        return {**self.counts, **hop, "reservations": sum(1 for e in self.reservations.values() if e > now)}


def _hop_protocol() -> type:
    """py-libp2p 0.8.1's CircuitV2Protocol, except that a RESERVE is for the peer that sent it. Stock, a RESERVE
    naming another peer id (its optional `peer` field) reserves for that id: one connection could fill every
    slot (`relay_max_reservations`) with made-up ids, and the one-slot-per-peer limit meant nothing."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

    class OwnReservationsOnly(CircuitV2Protocol):
        async def _handle_reserve(self, stream: Any, msg: Any) -> None:
            msg.ClearField("peer")  # the stock handler then falls back to the connection's peer
            await super()._handle_reserve(stream, msg)

    return OwnReservationsOnly


def _dcutr_protocol() -> type:
    """py-libp2p 0.8.1's DCUtRProtocol with three fixes (tried in the WAN lab, two homes behind separate NAT
    routers; docs/P2P.md "Relaying and hole punching"):
    - it advertised our listen address, `/ip4/0.0.0.0/tcp/<port>` (we switch identify's observed addresses off),
      and the peer dialled 0.0.0.0 from 0.0.0.0:<port>: EADDRNOTAVAIL on every try, no punch in 22 s. Ours
      advertises the address the join's dial-back saw us at, with our listen port (its hole-punch dials leave
      from the listen port, and a home router keeps the port): a direct connection in ~1.5 s in the lab;
    - it dialled whatever addresses the peer sent, and every address of the peer's own records in the
      peerstore: only addresses our policy allows (addrs.py), TCP on an IP literal, at most 4, are kept;
    - (with nothing to advertise, we advertise nothing: the peer then has nothing to dial.)"""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
    from multiaddr import Multiaddr

    from .addrs import multiaddr_allowed

    class OurDCUtR(DCUtRProtocol):
        def __init__(self, host: Any, relaying: "Relaying", allow_private: bool):
            super().__init__(host, dial_timeout=5)
            self._relaying, self._allow_private = relaying, allow_private

        async def _get_observed_addrs(self) -> list[bytes]:
            ip = self._relaying.public_ip
            port = next((p for _, _, p in _tcp_listen(self.host)), None)
            if ip is None or port is None:
                return []
            return [Multiaddr(f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}").to_bytes()]

        def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Any]:
            out = []
            for raw in addr_bytes[:8]:
                try:
                    a = Multiaddr(raw)
                except Exception:
                    continue
                text = str(a)
                parts = text.split("/")
                if (len(parts) == 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp"
                        and multiaddr_allowed(text, self._allow_private)):
                    out.append(a)
            return out[:4]

        async def _perform_hole_punch(self, peer_id: Any, addrs: list[Any], as_responder: bool = False) -> bool:
            # the stock method adds every address in the peerstore for this peer (its own claims) to the dials
            self.host.get_peerstore().clear_addrs(peer_id)
            return await super()._perform_hole_punch(peer_id, self._decode_observed_addrs(
                [a.to_bytes() for a in addrs]), as_responder)

    return OurDCUtR


def _tcp_listen(host: Any) -> list[tuple[int, str, int]]:
    from libp2p.relay.circuit_v2.dcutr import _local_tcp_listen_addrs

    return _local_tcp_listen_addrs(host)


class _quietly:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], Exception)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], Exception)


def _status_name(code: int) -> str:
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

    try:
        return StatusCode(code).name
    except ValueError:
        return f"status {code}"


@dataclass
class NatKeeper:
    """Asyncio side, for a node the dial-back found unreachable: every `interval_s`, keep connections to up to
    `keep` reachable peers (announced a direct address; newest announcers first) plus the bootstrap peers, and
    a fresh reservation on up to MAX_RELAYS connected relays (renewed at half their lifetime); announce the
    circuit addresses of the relays that hold one."""

    node: "P2PNode"
    keep: int
    interval_s: float = 5.0
    reserve: bool = True
    # relay peer -> (its address, expiry, lifetime granted), all unix seconds
    relays: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    not_relays: dict[str, float] = field(default_factory=dict)  # peer -> when it refused (retried after 10 min)
    # set by poke(): tick now instead of at the end of the interval
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        """Something changed (a bootstrap peer or relay was just connected): tick now. The keeper starts at the
        join's dial-back, before the node dials the run's bootstrap, so its first tick finds no relay to reserve
        on; waiting out the interval left a home unservable (announcing nothing) for its first 5 s."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # best effort: the node fetches and serves over what it has
                log.warning("p2p: keeping NAT connections failed: %s", e)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        node = self.node
        if not node.running:
            return
        connected = set(await node.connected_peers())
        # 1. Kept connections to reachable peers (bootstrap peers are dialled by their owner and kept below).
        now = time.monotonic()
        reachable = [p for p in node.table.direct_peers() if p != node.peer_id and not node.recently_failed(p, now)]
        kept = [p for p in reachable if p in connected]
        dials: list[Callable[[], Awaitable[Any]]] = []
        for peer in reachable:
            if len(kept) + len(dials) >= self.keep:
                break
            if peer not in connected:
                addrs = [a for a in node.table.addrs_of(peer) if not is_circuit(a) and "/p2p/" in a
                         and not a.endswith("/http")]
                if addrs:
                    dials.append(functools.partial(self._dial, peer, addrs))
        for addr, peer in node.known_bootstrap():
            if peer not in connected:
                dials.append(functools.partial(self._dial, peer, [addr]))
        if dials:
            await asyncio.gather(*(d() for d in dials))
            connected = set(await node.connected_peers())
        # 2. Reservations on relays we are connected to, renewed at half their lifetime.
        if not self.reserve:
            return
        changed = False
        for relay, (addr, expire, _) in list(self.relays.items()):
            if relay not in connected or expire <= time.time():
                del self.relays[relay]
                changed = True
        candidates = [(addr, peer) for addr, peer in node.known_bootstrap() if peer in connected]
        for addr, peer in candidates:
            held = self.relays.get(peer)
            if held is not None and held[1] - time.time() > max(held[2] / 2, 3 * self.interval_s):
                continue  # renewed at half its lifetime (and never later than 3 ticks before it ends)
            if held is None and len(self.relays) >= MAX_RELAYS:
                continue
            refused = self.not_relays.get(peer)
            if refused is not None and time.monotonic() - refused < 600:
                continue
            try:
                expire = await node.reserve_on(peer)
            except Exception as e:
                self.not_relays[peer] = time.monotonic()
                if held is not None:
                    del self.relays[peer]
                    changed = True
                log.info("p2p: no relay reservation on %s: %s", peer, e)
                continue
            if held is None:
                log.info("p2p: relay reservation on %s (expires in %.0f s); announcing %s", peer,
                         expire - time.time(), circuit_addr(addr, node.peer_id))
                changed = True
            self.relays[peer] = (addr, expire, max(1.0, expire - time.time()))
        if changed:
            node.set_circuit_addrs([circuit_addr(addr, node.peer_id) for addr, _, _ in self.relays.values()])

    async def _dial(self, peer: str, addrs: list[str]) -> None:
        from .errors import P2PError

        try:
            await self.node.connect(addrs[:2], self.node.cfg.dial_timeout_s, chosen=False)  # kept, not asked to relay
        except P2PError as e:
            self.node._note_dial_failed(peer)
            log.debug("p2p: keeping a connection to %s failed: %s", peer, e)
