"""P2P section of the config tree (owned by node/p2p). Only pydantic here: imported at start-up."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

MIB = 1024 * 1024
# A relay hop's address as the coordinator hands it out: one IP, its TCP port and the hop's peer id (base58).
_HOP_ADDR = re.compile(r"/ip([46])/([^/]+)/tcp/(\d{1,5})/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}")


class P2PConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # All interfaces: what peers may dial is decided by the coordinator's dial-back at join (docs/P2P.md
    # "Reachability"), which announces only an address it reached (a node it cannot reach announces none).
    listen_host: str = "0.0.0.0"
    listen_port: int = Field(0, ge=0, le=65535)
    # False = outbound-only (behind NAT): the node dials peers but accepts no connections.
    listen: bool = True
    # Multiaddrs (with /p2p/<peer id>) dialled at start, besides those the coordinator hands out.
    bootstrap: list[str] = Field(default_factory=list, max_length=64)
    # Public multiaddrs put in this node's announcements (e.g. "/ip4/203.0.113.7/tcp/4001") when
    # the listen address is not what peers can dial (port forwarding, 0.0.0.0). Empty = listen addrs.
    announce_addrs: list[str] = Field(default_factory=list, max_length=8)
    # Also serve and fetch shard bytes over HTTP (node/p2p/http_shards.py): ~15x less CPU per byte than
    # libp2p streams. Served on listen_host:http_port (0 = any free port) and announced with the first
    # address peers can dial (announce_addrs' host if set: forward this port too); also told to the origin,
    # which then names this node to others as the holder of a first copy. libp2p stays for discovery,
    # gossip, outbound-only nodes and any peer whose HTTP server cannot be reached.
    # On by default (docs/BENCHMARKS.md, "WAN lab: N nodes"): a shard costs 14-22x less CPU than over py-libp2p
    # (bench/transport_cost.py); a LoRA step reached 16 loopback nodes in 4.07 s against 5.67 s, a peer shard
    # 0.09 s against 0.94 s (loaded 2-core box). At N = 6, in the WAN lab and on loopback, the planes were within
    # noise of each other (2026-11-27): no case measured where HTTP was slower.
    # Behind NAT it costs nothing and changes nothing: the join's dial-back cannot reach the HTTP port, so
    # the node announces no /http address (P2PNode.apply_reachability), still fetches from reachable peers
    # over HTTP, and serves over the libp2p connections it opened (nat.py). The server it opens has the
    # libp2p plane's limits (max_concurrent_streams, 4 per client address, deadlines, 429 "busy",
    # upload_limit shared by both planes). False: libp2p only, one inbound port.
    http: bool = True
    http_port: int = Field(0, ge=0, le=65535)
    # Shard transfers served at once; further requests are answered "busy" instead of queueing.
    # A slot is taken only once a well-formed request has arrived.
    max_concurrent_streams: int = Field(8, ge=1, le=1024)
    # Shard streams one peer may have open at once (waiting for its request or being served);
    # more get "busy" at once, so a single peer cannot hold every slot. 4 = the worker fetcher's
    # parallel downloads, so an honest worker is never refused by this limit alone.
    max_streams_per_peer: int = Field(4, ge=1, le=1024)
    # Seconds a shard request (≤ 1 KiB, sent with the stream) may take to arrive.
    request_timeout_s: float = Field(2.0, gt=0, le=60)
    # Total bytes/s this node uploads to peers (0 = unlimited).
    upload_limit: int = Field(0, ge=0)
    # Largest compressed shard served or accepted (shards are 32 MiB raw by default: docs/PROTOCOL.md, "Manifest").
    max_shard_bytes: int = Field(64 * MIB, ge=1, le=1024 * MIB)
    # Seconds a single read may stall before the transfer is abandoned (not the whole transfer).
    read_timeout_s: float = Field(10.0, gt=0, le=600)
    connect_timeout_s: float = Field(10.0, gt=0, le=600)
    # Seconds to connect to a peer that is not connected yet (libp2p dial or its HTTP shard server): short, since
    # another holder or the origin can serve instead; a peer whose dial failed is not dialled again for
    # `dial_retry_s` (it may still serve over a connection it opens to us).
    dial_timeout_s: float = Field(3.0, gt=0, le=600)
    dial_retry_s: float = Field(60.0, ge=0, le=3600)
    # The coordinator's dial-back at join (node/coordinator/reachability.py): the limit for each fresh connect.
    dialback_timeout_s: float = Field(3.0, gt=0, le=30)
    # Gossip messages/s accepted from one forwarding peer (a hub relays everyone's announcements);
    # checked before any signature, excess is dropped and counted.
    gossip_rate_limit: int = Field(100, ge=10, le=10_000)
    # Announcements older than this (or this far in the future) are dropped as replays.
    announce_max_age_s: float = Field(600.0, gt=0)
    # Use peer addresses (from `have` announcements, X-Prime-Shard-Addr, X-Prime-Holder) that are loopback,
    # private, link-local, shared or reserved. Off: a stranger could otherwise point every node (and, through
    # the coordinator's X-Prime-Holder, every worker) at 127.0.0.1, 169.254.169.254 or the operator's LAN
    # (node/p2p/addrs.py). Turn it on for a swarm on one machine (configs/local.toml, tests) or one LAN.
    allow_private_addrs: bool = False
    # NATed nodes serve too (docs/P2P.md "Relaying and hole punching", node/p2p/nat.py). A node the join's
    # dial-back found unreachable keeps libp2p connections open to this many reachable peers (0 = none) and
    # serves them over those; it also keeps a circuit relay v2 reservation on the peers it bootstraps from
    # that relay, and announces those circuits.
    nat_keep_peers: int = Field(4, ge=0, le=32)
    # Relay circuits (hop) for NATed nodes. None = by role: on for the coordinator, off for workers.
    relay_hop: bool | None = None
    # A hop's limits: NATed peers holding a reservation (one each), circuits open to one of them at once, and
    # a circuit's life in seconds and in bytes (both directions; the dialler then makes a new one), and how
    # long a reservation lasts unless renewed (NATed nodes renew at half of it).
    relay_max_reservations: int = Field(128, ge=1, le=4096)
    relay_circuits_per_peer: int = Field(4, ge=1, le=64)
    relay_circuit_seconds: int = Field(300, ge=10, le=3600)
    relay_circuit_bytes: int = Field(256 * MIB, ge=MIB, le=16 * 1024 * MIB)
    relay_reservation_ttl_s: int = Field(120, ge=10, le=3600)
    # Coordinator only: the libp2p addresses of circuit relay v2 hops run by `prime-node relay` (each
    # "/ip4/<ip>/tcp/<port>/p2p/<peer id>", the line the relay prints at start), handed to every node in the join
    # response's p2p_bootstrap after our own: NATed nodes reserve a slot on up to 4 of the peers they bootstrap
    # from (docs/P2P.md "Relaying and hole punching"). Every node dials each of them, so the list is short.
    relay_addrs: list[str] = Field(default_factory=list, max_length=8)
    # DCUtR hole punching: over a relayed connection, two NATed nodes try to connect directly (each dials the
    # other's dial-back address at its listen port, from its listen port). Needs `listen` (the port to punch).
    hole_punch: bool = True
    # A log line with the bytes this node served and fetched (and its relay counters) at most this often, when
    # they changed.
    stats_log_s: float = Field(60.0, ge=1, le=3600)

    @model_validator(mode="after")
    def _check_relay_addrs(self) -> P2PConfig:
        """A relay address every node will dial: one TCP address with its peer id, under the address rules every
        other peer address obeys (node/p2p/addrs.py: public IPs only unless allow_private_addrs)."""
        from .addrs import ip_allowed, multiaddr_allowed  # pure ipaddress code, cheap at start-up

        for addr in self.relay_addrs:
            m = _HOP_ADDR.fullmatch(addr)
            if (m is None or not 0 < int(m.group(3)) < 65536 or not ip_allowed(m.group(2), True)
                    or (":" in m.group(2)) != (m.group(1) == "6")):
                raise ValueError(f"p2p.relay_addrs: {addr[:200]!r} is not /ip4|ip6/<ip>/tcp/<port>/p2p/<peer id>")
            if not multiaddr_allowed(addr, self.allow_private_addrs):
                raise ValueError(f"p2p.relay_addrs: {addr[:200]!r} is not a public address (loopback, private and "
                                 "other internal ranges need p2p.allow_private_addrs)")
        return self
