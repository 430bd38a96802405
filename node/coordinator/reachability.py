"""The join's dial-back: is a node reachable from the internet, tested instead of assumed (#26).

At join a node lists the TCP ports it listens on (`NodeInfo.listen_ports`: libp2p, HTTP shard server); the
coordinator opens a fresh TCP connection to each, at the address the join came from, and answers in the
RunSpec (`Reachability`). A fresh connect, not the connection the join came in on: py-libp2p 0.8.1's AutoNAT
v1 dials back over the incoming connection and so calls every NATed node reachable.

What a stranger can make the coordinator do with it (every server assumes strangers):
- Connect only to the requester's own observed IP (never an address from the request), only to the ports
  it listed (at most 2 per join), and send nothing: a connect, then close.
- At most `per_minute` dials per observed IP (two per join at the default join limit, so a shared address such
  as a carrier-grade NAT cannot be used to scan the other customers behind it), at most MAX_IN_FLIGHT at once
  (more are answered "not tried"), each bounded by `timeout_s`. Addresses the coordinator's address policy
  refuses (loopback, private, ... unless p2p.allow_private_addrs: node/p2p/addrs.py) are not dialled.
- The join waits for its dial-back (up to `timeout_s`, both ports at once) but the event loop does not: the
  connects are ordinary non-blocking sockets.
"""
from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from node.p2p.addrs import ip_allowed
from node.rate_limit import KeyedRateLimit
from protocol import messages as M

MAX_IN_FLIGHT = 64  # dial-backs at once; past this a join is answered "not tried" instead of queued
MAX_NODES = 100_000  # results remembered (least recently joined forgotten first)


@dataclass(frozen=True)
class NodeReach:
    observed_ip: str
    libp2p: bool | None
    http: bool | None
    http_port: int | None
    libp2p_port: int | None = None  # the libp2p port dialled (super-seeding names it: seeding.py X-Prime-Holder)


def observed_ip(remote: str | None) -> str | None:
    """The IP literal of a request's peer address, IPv4-mapped IPv6 written as IPv4; None if not an IP."""
    try:
        ip = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


async def tcp_connects(ip: str, port: int, timeout_s: float) -> bool:
    """A fresh TCP connection to ip:port completes within `timeout_s` (then it is closed; nothing is sent)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass
    return True


class DialBack:
    def __init__(self, *, timeout_s: float = 3.0, per_minute: int = 20, allow_private: bool = False,
                 connect: Callable[[str, int, float], Awaitable[bool]] = tcp_connects,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.allow_private = allow_private
        self._connect = connect
        self._limit = KeyedRateLimit(per_minute / 60.0, per_minute, max_keys=MAX_NODES, clock=clock)
        self._in_flight = 0
        self._nodes: OrderedDict[str, NodeReach] = OrderedDict()

    async def check(self, node_id: str, remote: str | None, ports: M.ListenPorts | None) -> M.Reachability | None:
        """Dial `remote` (the join's peer address) back at the listed ports; None if `remote` is not an IP."""
        ip = observed_ip(remote)
        if ip is None:
            return None
        wanted = {k: p for k, p in (("libp2p", ports.libp2p), ("http", ports.http)) if p is not None} if ports else {}
        results: dict[str, bool | None] = {"libp2p": None, "http": None}
        dial = {k: p for k, p in wanted.items() if self._may_dial(ip)}
        if dial and self._in_flight + len(dial) <= MAX_IN_FLIGHT:
            self._in_flight += len(dial)
            try:
                ok = await asyncio.gather(*(self._connect(ip, p, self.timeout_s) for p in dial.values()))
            finally:
                self._in_flight -= len(dial)
            results.update(zip(dial, ok))
        self._remember(node_id, NodeReach(ip, results["libp2p"], results["http"], wanted.get("http"),
                                          wanted.get("libp2p")))
        return M.Reachability(observed_ip=ip, **results)

    def _may_dial(self, ip: str) -> bool:
        return ip_allowed(ip, self.allow_private) and self._limit.allow(ip)

    def _remember(self, node_id: str, reach: NodeReach) -> None:
        self._nodes[node_id] = reach
        self._nodes.move_to_end(node_id)
        while len(self._nodes) > MAX_NODES:
            self._nodes.popitem(last=False)

    def reachable(self, node_id: str) -> bool | None:
        """Whether the node's libp2p port was dialled back at its last join (None: unknown or not tried)."""
        reach = self._nodes.get(node_id)
        return reach.libp2p if reach is not None else None

    def http_addr_verified(self, node_id: str, addr: str) -> bool:
        """`addr` is an address of this node the dial-back reached: its HTTP shard server
        (/ip4/<ip>/tcp/<port>/http) or, since super-seeding names libp2p holders too, its libp2p port
        (/ip4/<ip>/tcp/<port>, a /p2p/<peer id> suffix allowed). (The name predates the libp2p form; the
        coordinator's app wires it into the seeding gate.)"""
        reach = self._nodes.get(node_id)
        parts = addr.split("/")
        if reach is None or len(parts) < 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            return False
        if observed_ip(parts[2]) != reach.observed_ip or not parts[4].isdigit():
            return False
        if len(parts) == 6 and parts[5] == "http":
            return bool(reach.http) and reach.http_port is not None and parts[4] == str(reach.http_port)
        if len(parts) == 5 or (len(parts) == 7 and parts[5] == "p2p"):
            return bool(reach.libp2p) and reach.libp2p_port is not None and parts[4] == str(reach.libp2p_port)
        return False
