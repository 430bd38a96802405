"""Which addresses a stranger may make this node (or, through the coordinator, every node) connect to.

Addresses arrive from untrusted places: the `addrs` of a `have` announcement, a swarm request's
`X-Prime-Shard-Addr` (which the coordinator repeats to others in `X-Prime-Holder`) and a peer's HTTP shard
server. Dialling them as given lets one hostile key point every node at 127.0.0.1, the cloud metadata
service (169.254.169.254) or the operator's private network. So unless `p2p.allow_private_addrs` is on
(loopback demos and tests, a LAN-only swarm), an address is used only if every IP in it is public:
never loopback, private (RFC 1918, ULA), shared (100.64/10), link-local, multicast, unspecified, reserved,
documentation or benchmarking ranges, nor an IPv6 address that embeds one of those (IPv4-mapped, 6to4,
Teredo). Host names (/dns4/...) are refused too: what they resolve to can change after the check.

Pure functions (ipaddress only, no I/O, no libp2p): cheap enough to run on every announcement.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# /ip4|ip6/<literal ip>/tcp/<port>, then what a caller allows after it (tcp_endpoint's `suffix`)
_TCP = r"/(ip4|ip6)/([0-9A-Fa-f.:]{2,45})/tcp/([0-9]{1,5})"
_TCP_SUFFIXES = {"": re.compile(_TCP), "/http": re.compile(_TCP + "/http"),
                 "[/p2p/<id>]": re.compile(_TCP + r"(?:/p2p/[1-9A-HJ-NP-Za-km-z]{1,128})?")}


def tcp_endpoint(addr: object, suffix: str = "") -> tuple[IPAddress, int] | None:
    """(ip, port) of an address of exactly the form /ip4|ip6/<IP literal of that version>/tcp/<port 1-65535>
    followed by `suffix`: "" (nothing), "/http" (a node's HTTP shard server), or "[/p2p/<id>]" (a libp2p address,
    its peer id optional); else None. Form only: whether the IP may be dialled is ip_allowed's or
    multiaddr_allowed's to say."""
    m = _TCP_SUFFIXES[suffix].fullmatch(addr) if isinstance(addr, str) else None
    if m is None:
        return None
    try:
        ip = ipaddress.ip_address(m.group(2))
    except ValueError:
        return None
    port = int(m.group(3))
    return (ip, port) if m.group(1) == f"ip{ip.version}" and 0 < port < 65536 else None

# Multiaddr protocols that take a value, and those that do not, that an allowed address may contain.
# Anything else (dns*, unix, onion, ...) names something we cannot check before dialling.
_WITH_VALUE = frozenset({"ip4", "ip6", "tcp", "udp", "p2p", "ipfs"})
_FLAGS = frozenset({"http", "p2p-circuit", "quic", "quic-v1", "ws", "wss", "tls", "noise"})


def is_public_ip(ip: IPAddress) -> bool:
    """True for an address on the public internet (see the module docstring for what is refused)."""
    if ip.version == 6:
        teredo = ip.teredo
        for embedded in (ip.ipv4_mapped, ip.sixtofour, teredo[1] if teredo else None):
            if embedded is not None and not is_public_ip(embedded):
                return False
        if ip.is_site_local:  # fec0::/10: deprecated, but Python 3.11 still calls it global
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified or ip.is_loopback
                                 or ip.is_link_local or ip.is_private)


def ip_allowed(host: str, allow_private: bool) -> bool:
    """`host` is an IP literal we may connect to. Multicast and unspecified never are (nothing to dial)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_multicast or ip.is_unspecified:
        return False
    return allow_private or is_public_ip(ip)


def multiaddr_allowed(addr: str, allow_private: bool) -> bool:
    """A multiaddr string we may dial: with `allow_private`, anything (libp2p parses it later); else only
    known protocols, at least one IP, and every IP in it public."""
    if not isinstance(addr, str) or not addr.startswith("/"):
        return False
    if allow_private:
        return True
    parts = addr.split("/")[1:]
    seen_ip, i = False, 0
    while i < len(parts):
        proto = parts[i]
        if proto in _FLAGS:
            i += 1
            continue
        if proto not in _WITH_VALUE or i + 1 >= len(parts):
            return False
        value = parts[i + 1]
        if proto in ("ip4", "ip6"):
            if not ip_allowed(value, False) or f"ip{ipaddress.ip_address(value).version}" != proto:
                return False
            seen_ip = True
        i += 2
    return seen_ip


def allowed_addrs(addrs: Iterable[str], allow_private: bool) -> tuple[str, ...]:
    """The addresses of `addrs` we may dial, in their order."""
    return tuple(a for a in addrs if multiaddr_allowed(a, allow_private))
