"""Super-seeding: the origin sends each shard's first copy to one swarm node and defers the others to
peers while that copy spreads. `SuperSeeder` is pure state with an injected clock (no IO), so every
rule is unit-tested; `SeedingGate` puts it in front of the shard route.

A first copy counts only when a *joined node* asked for it in a *signed* request (the caller checks
both and passes the node id; anyone else is served like any HTTP client and never holds a claim), and
only while that node keeps its word: it must announce the shard to its peers (a `have` gossip message,
fed back through `announced`) within `announce_grace_s` of receiving it, or the claim dies and the
shard reopens. A node whose claim died is never counted again for that shard. A node deferred
`max_deferrals` times for a shard is served anyway, so a claim can delay an honest node, not starve it.

First copies go only to nodes others can dial: a node the join's dial-back found unreachable (NATed,
node/coordinator/reachability.py) and that holds no reservation on the coordinator's relay hop (node/p2p/nat.py:
through it every peer can reach the node) is served but never holds a claim, so nobody is deferred to a holder
they cannot connect to. With no such node asking, every node is served by the origin, as without seeding.

A node reached only through a relay circuit (NATed, with a reservation) holds first copies only where fewer than
`MIN_DIRECT_ASKERS` directly dialable nodes asked within `DIRECT_MEMORY_S` (10 minutes); otherwise it is served as
an unservable node is. A copy held behind NAT is fetched over a circuit (home -> relay -> home, a second Noise
layer): 1.39 s per ~140 KB shard in the WAN lab against 0.74 s from a public node, and every other node of the step
pays it. With two direct uplinks or more the first copies spread over those; with one (a home with a forwarded port
beside NATed homes) its uplink alone would carry every copy, so the NATed homes take their share (docs/P2P.md,
"Relaying and hole punching").

First copies are spread over the servable nodes that ask (`SuperSeeder.admit`): a node that already holds more
first copies of a step than another servable node asking lately holds, plus one, is deferred once for a shard that
nobody holds yet, so that the shard's first copy goes to a node with fewer (BitTorrent's super-seeding: each peer
gets different pieces, and every uplink serves). Without it the first node to ask for a step took every shard's
first copy (a delta's shards are all asked at once), the others were deferred to it, fell behind, and asked
last again at the next step: in the WAN lab a reachable home served 6-7 MB while two NATed homes with the same
uplink and round trip served 0-1.3 MB (docs/P2P.md "Relaying and hole punching"). Only once per shard and node:
the deferred node asks again after the planner's origin deferral (2 s) and is then served, with the first copy
if nobody took it meanwhile. With one servable node asking, nothing changes.

Timing: the window counts from the end of the first copy (under a thin uplink one copy can take longer
than the window itself); a copy still in flight after `IN_FLIGHT_WINDOWS` windows stops counting.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from multidict import CIMultiDict

from node.http import HOLDER_HEADER, SHARD_ADDR_HEADER, SHARD_HOLDER_HEADER, SWARM_HEADER, ApiError
from protocol.errors import SignatureError

IN_FLIGHT_WINDOWS = 6
MIN_DIRECT_ASKERS = 2  # directly dialable askers within DIRECT_MEMORY_S from which relayed nodes hold no first copy
# How long a directly dialable node that asked counts for that rule. Not the super-seeding window (10 s): a trainer
# step takes longer than that (17 s at N = 12 in the WAN lab, minutes on a real model), so at each new step the direct
# nodes had expired and a relayed home that asked first took first copies that every other node then fetched over
# relay circuits or waited for (one lab run: 3 steps of 15-25 s instead of ~3). A direct node that has gone costs a
# relayed one at most START_HOLD_S a shard (held for a direct copy that does not come, then served).
DIRECT_MEMORY_S = 600.0
# How long a deferred request may be held for a first copy in flight (SeedingGate._hold): the node's own deferral is
# 2 s (node/worker/planner.py origin_defer_s), and a copy still in flight after 1 s is a slow one, whose holder may
# have its next copy out through gossip just as soon
HOLD_S = 1.0
# How long a request for a shard nobody holds yet may be held for another node's first copy to start and land (the
# spreading rule's deferral, a relayed node's): the node's own origin deferral (node/worker/planner.py
# origin_defer_s), after which it would have asked again and been served. Shorter, the node that asks first came
# back before a far node asked and took the first copy itself (docs/P2P.md: a 1 s Retry-After, NATed share 14 %).
START_HOLD_S = 2.0
MAX_HOLDS = 10_000  # requests held at once (each is one open request): beyond, deferred at once as before
# X-Prime-Shard-Addr values read per request: a node's HTTP shard server and its libp2p address
MAX_SHARD_ADDRS = 2
# X-Prime-Shard-Holder values on a manifest (SeedingGate.manifest_headers): ~110 bytes each, two per shard (a holder's
# HTTP and libp2p addresses); a delta has ~5 shards, a full SmolLM2 checkpoint ~14
MAX_SHARD_HOLDERS = 64


def step_of(key: Hashable) -> Hashable:
    """The group whose first copies are spread over the nodes: a (step, index) key's step. Any other key (the
    swarm simulation's shard indices) is its own group: no spreading."""
    return key[0] if isinstance(key, tuple) and key else key


@dataclass
class _Claim:
    node_id: str
    started: float
    finished: float | None = None
    announced: bool = False


class SuperSeeder:
    def __init__(self, window_s: float, *, announce_grace_s: float | None = None, max_deferrals: int = 3,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000,
                 reachable: Callable[[str], bool | None] = lambda node_id: None,
                 relayed: Callable[[str], bool] = lambda node_id: False):
        self.window = window_s
        self.reachable = reachable  # False: dialled back and not reachable; None (unknown) counts as reachable
        self.relayed = relayed  # True: reachable only through a relay circuit (NATed, with a reservation)
        self.grace = window_s if announce_grace_s is None else announce_grace_s
        self.max_deferrals = max_deferrals
        self.clock = clock
        self.max_keys = max_keys
        self._claims: dict[Hashable, _Claim] = {}
        self._deferred: dict[tuple[Hashable, str], int] = {}
        self._broken: set[tuple[Hashable, str]] = set()  # (shard, node) whose claim died unannounced
        self._groups: dict[Hashable, set[Hashable]] = {}  # step -> its keys that hold a claim (maybe dead)
        # servable nodes that asked for a shard lately -> when (the ones first copies are spread over)
        self._askers: OrderedDict[str, float] = OrderedDict()
        self._direct: OrderedDict[str, float] = OrderedDict()  # not relayed, within DIRECT_MEMORY_S (not the window)

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def _live(self, claim: _Claim, now: float) -> bool:
        if claim.finished is None:
            return now - claim.started < IN_FLIGHT_WINDOWS * self.window
        if not claim.announced and now - claim.finished >= self.grace:
            return False
        return now - claim.finished < self.window

    def _claim(self, key: Hashable) -> _Claim | None:
        claim = self._claims.get(key)
        if claim is not None and not self._live(claim, self.clock()):
            if not claim.announced and claim.finished is not None:
                self._broken.add((key, claim.node_id))
            del self._claims[key]
            self._ungroup(key)
            return None
        return claim

    def _ungroup(self, key: Hashable) -> None:
        group = step_of(key)
        keys = self._groups.get(group)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._groups[group]

    def admit(self, key: Hashable, node_id: str | None) -> bool:
        """Serve this request (True), or tell the node to fetch the shard from a peer (False)."""
        if not self.enabled or node_id is None:
            return True
        servable = self._servable(node_id)
        if servable:
            self._asked(node_id)
        claim = self._claim(key)
        if claim is not None and claim.node_id == node_id:
            return True
        if claim is None:
            if (key, node_id) in self._deferred:
                return True
            if not servable:
                if not self.leaves_to_direct(node_id):
                    return True
            elif not self._has_more(node_id, key):
                return True
            # leave this first copy to a node holding fewer, or to a direct node (once)
            self._defer(key, node_id, 1)
            return False
        n = self._deferred.get((key, node_id), 0) + 1
        if n > self.max_deferrals:
            return True
        self._defer(key, node_id, n)
        return False

    def _defer(self, key: Hashable, node_id: str, n: int) -> None:
        if len(self._deferred) >= self.max_keys:
            self._deferred.clear()
        self._deferred[(key, node_id)] = n

    def leaves_to_direct(self, node_id: str) -> bool:
        """`node_id` is relayed and, with direct nodes asking, holds no first copy: one of them should."""
        return self.relayed(node_id) and self.reachable(node_id) is not False and not self._servable(node_id)

    def _servable(self, node_id: str) -> bool:
        """May `node_id` hold a first copy: reachable or unknown, or relayed while few direct nodes ask."""
        if self.reachable(node_id) is False:
            return False
        if not self.relayed(node_id):
            return True
        self._expire_askers()
        return len(self._direct) < MIN_DIRECT_ASKERS

    def _asked(self, node_id: str) -> None:
        now = self.clock()
        tables = (self._askers, self._direct) if not self.relayed(node_id) else (self._askers,)
        for table in tables:
            table[node_id] = now
            table.move_to_end(node_id)
            while len(table) > self.max_keys:
                table.popitem(last=False)

    def _expire_askers(self) -> None:
        now = self.clock()
        for table, keep in ((self._askers, self.window), (self._direct, max(self.window, DIRECT_MEMORY_S))):
            while table and now - next(iter(table.values())) >= keep:  # oldest first: kept in order of last ask
                table.popitem(last=False)

    def _has_more(self, node_id: str, key: Hashable) -> bool:
        """`node_id` holds more live first copies of `key`'s step than another servable node that asked within
        the window holds, plus one."""
        self._expire_askers()
        held: dict[str, int] = {}
        for k in list(self._groups.get(step_of(key), ())):  # at most the step's shard count
            claim = self._claim(k)
            if claim is not None:
                held[claim.node_id] = held.get(claim.node_id, 0) + 1
        mine = held.get(node_id, 0)
        # O(askers) only for a node holding 2 or more, and it stops at the first asker holding fewer than mine - 1
        # (an asker that was servable when it asked may not be now: relayed, once direct nodes ask)
        return mine >= 2 and any(held.get(n, 0) < mine - 1 and self._servable(n) for n in self._askers if n != node_id)

    def claims(self, group: Hashable) -> list[tuple[Hashable, str, bool]]:
        """The live first copies of a step: (key, holder, whether its copy is complete)."""
        out = []
        for key in list(self._groups.get(group, ())):  # at most the step's shard count
            if (claim := self._claim(key)) is not None:
                out.append((key, claim.node_id, claim.finished is not None))
        return out

    def in_flight(self, key: Hashable) -> str | None:
        """The node whose first copy of `key` the origin is still sending (live, not finished), if any."""
        claim = self._claim(key)
        return claim.node_id if claim is not None and claim.finished is None else None

    def holder(self, key: Hashable) -> str | None:
        """The node whose first copy of `key` is complete and still spreading, if any."""
        claim = self._claim(key)
        return claim.node_id if claim is not None and claim.finished is not None else None

    def started(self, key: Hashable, node_id: str | None) -> None:
        """The origin begins sending `key` to `node_id`: the first copy, if none is spreading."""
        if not self.enabled or node_id is None or (key, node_id) in self._broken or self._claim(key) is not None:
            return
        if not self._servable(node_id):
            return
        if len(self._claims) >= self.max_keys:
            self._expire_all()
        self._claims[key] = _Claim(node_id, self.clock())
        group = step_of(key)
        if group != key:
            if group not in self._groups and len(self._groups) >= self.max_keys:
                self._groups.clear()
            self._groups.setdefault(group, set()).add(key)

    def finished(self, key: Hashable, node_id: str | None) -> None:
        claim = self._claims.get(key)
        if claim is not None and claim.node_id == node_id and claim.finished is None:
            claim.finished = self.clock()

    def failed(self, key: Hashable, node_id: str | None) -> None:
        """The copy did not get out: the next swarm node may have it."""
        claim = self._claims.get(key)
        if claim is not None and claim.node_id == node_id and claim.finished is None:
            del self._claims[key]
            self._ungroup(key)

    def announced(self, node_id: str, keys: Iterable[Hashable]) -> None:
        """`node_id` told its peers it holds these shards (a verified `have` announcement)."""
        for key in keys:
            claim = self._claims.get(key)
            if claim is not None and claim.node_id == node_id:
                claim.announced = True

    def _expire_all(self) -> None:
        now = self.clock()
        for key in [k for k, c in self._claims.items() if not self._live(c, now)]:
            del self._claims[key]
            self._ungroup(key)
        if len(self._claims) >= self.max_keys:
            self._claims.clear()
            self._groups.clear()
        if len(self._broken) >= self.max_keys:
            self._broken.clear()


class SeedingGate:
    """The shard route's gate (node/checkpoint_routes.py `ShardGate`): a swarm request signed by a joined
    node (docs/PROTOCOL.md, "Signed requests"; empty body) goes through the `SuperSeeder`; an unsigned one
    is served like any HTTP client's and never holds a first copy; a signature that does not verify is a 401."""

    def __init__(self, seeder: SuperSeeder, verifier, is_member: Callable[[str], bool], *, max_addrs: int = 100_000,
                 allow_private_addrs: bool = False, verified: Callable[[str, str], bool] | None = None,
                 hold_s: float = HOLD_S, start_hold_s: float = START_HOLD_S, max_holds: int = MAX_HOLDS):
        self.seeder, self.verifier, self.is_member = seeder, verifier, is_member
        # A node deferred while the first copy is still in flight is held (at most `hold_s`) until that copy is
        # out, then told its holder (X-Prime-Holder), instead of being told "not now" with no one to ask: it then
        # waited for the holder's `have` gossip (batched every max(0.3 s, peers / 8 s)) or its 2 s deferral, ~0.7 s
        # of a delta's slowest shard in the WAN lab (docs/BENCHMARKS.md, "Where a delta's fetch goes").
        self.hold_s, self.start_hold_s, self.max_holds = hold_s, start_hold_s, max_holds
        self._copies: dict[Hashable, asyncio.Event] = {}  # a shard with held requests -> set when a copy ends
        self.holds = 0  # requests held now
        # node id -> where it serves shards, as it told us (X-Prime-Shard-Addr on its signed requests): its HTTP
        # shard server (/ip4/<ip>/tcp/<port>/http) and its libp2p address (/ip4/<ip>/tcp/<port>), so a deferred node
        # learns where the first copy went (X-Prime-Holder) instead of waiting for gossip
        self.shard_addrs: OrderedDict[str, str] = OrderedDict()
        self.libp2p_addrs: OrderedDict[str, str] = OrderedDict()
        self.max_addrs = max_addrs
        # p2p.allow_private_addrs: off, an address that is loopback, private, link-local, ... is never repeated
        # (every worker told of it would fetch from it: node/p2p/addrs.py).
        self.allow_private_addrs = allow_private_addrs
        # (node id, address) -> the join's dial-back reached exactly that address (reachability.py); None: no
        # dial-back to consult (addresses are then repeated on the policy check alone)
        self.verified = verified

    def _checked(self, node_id: str, addr: str) -> tuple[str, str] | None:
        """("http" | "libp2p", the address as we repeat it) for an address of `node_id` we may name, else None:
        a literal-IP /http address, or a libp2p TCP address (/ip4/<ip>/tcp/<port>, a /p2p/<id> suffix dropped:
        the deferred node derives the peer id from the node id), that passes the address policy and that the
        join's dial-back reached."""
        from node.p2p.addrs import ip_allowed, tcp_endpoint
        from node.p2p.http_shards import url_of

        if url_of(addr, allow_private=self.allow_private_addrs) is not None:
            kind, named = "http", addr
        else:
            endpoint = tcp_endpoint(addr, "[/p2p/<id>]")
            if endpoint is None or not ip_allowed(str(endpoint[0]), self.allow_private_addrs):
                return None
            ip, port = endpoint
            kind, named = "libp2p", f"/ip{ip.version}/{ip}/tcp/{port}"
        if self.verified is not None and not self.verified(node_id, named):
            return None
        return kind, named

    def _remember_addr(self, node_id: str, addr: str | None) -> None:
        self._remember_addrs(node_id, [addr] if addr is not None else [])

    def _remember_addrs(self, node_id: str, addrs: list[str]) -> None:
        """What a request told replaces what we kept for the node: only addresses that passed the address policy
        and that the join's dial-back reached are ever repeated; a node that now claims none of a kind that does
        loses the one it had. No header at all changes nothing (an unsigned or a Range request may omit it)."""
        if not addrs:
            return
        kept: dict[str, str] = {}
        for addr in addrs[:MAX_SHARD_ADDRS]:
            if (checked := self._checked(node_id, addr)) is not None:
                kept.setdefault(*checked)
        for kind, table in (("http", self.shard_addrs), ("libp2p", self.libp2p_addrs)):
            if kind not in kept:
                table.pop(node_id, None)
                continue
            table[node_id] = kept[kind]
            table.move_to_end(node_id)
            while len(table) > self.max_addrs:
                table.popitem(last=False)

    def _holder_header(self, key, over_http: bool) -> CIMultiDict[str] | None:
        """X-Prime-Holder for a 429, once per address the first holder has: first the one an older node reads
        (it reads only the first value): the holder's HTTP shard server to a node that serves over HTTP itself
        (it told us its own /http address), else its libp2p address (every swarm node dials libp2p); then the
        other one. A node behind NAT tells us no /http address (it serves none) but does fetch over HTTP: named
        only the libp2p address, it took a delta's shards over py-libp2p at 0.6-0.9 s each instead of two round
        trips over HTTP (docs/BENCHMARKS.md, "A NATed node's peer shards over HTTP")."""
        holder = self.seeder.holder(key)
        if holder is None:
            return None
        http, libp2p = self.shard_addrs.get(holder), self.libp2p_addrs.get(holder)
        first = (http if over_http else None) or libp2p or http
        if first is None:
            return None
        return CIMultiDict((HOLDER_HEADER, f"{holder} {addr}") for addr in dict.fromkeys((first, http, libp2p))
                           if addr is not None)

    def manifest_headers(self, request, step: int) -> CIMultiDict[str] | None:
        """X-Prime-Shard-Holder for a manifest asked in a signed swarm request: the holders of the step's first copies
        (in flight or spreading), so that a node that asks after them fetches those shards from peers at once. Before,
        it asked the origin for every shard first, and a round trip later learnt the holder from a 429 (~0.25 s of a
        far home's step in the WAN lab: docs/BENCHMARKS.md, "Holders named with the manifest"). A copy still in flight
        is named only at its holder's HTTP shard server, which waits for a shard of a step it is downloading
        (node/p2p/http_shards.py ARRIVAL_WAIT_S); a complete one at each address the origin has for it, HTTP first.
        Anyone else (unsigned, not a member) gets the manifest alone; a signature that does not verify is a 401."""
        node_id = self._node(request)
        if node_id is None:
            return None
        out: CIMultiDict[str] = CIMultiDict()
        for key, holder, complete in self.seeder.claims(step):
            if holder == node_id or not isinstance(key, tuple):
                continue
            http, libp2p = self.shard_addrs.get(holder), self.libp2p_addrs.get(holder)
            for addr in dict.fromkeys((http, libp2p) if complete else (http,)):
                if addr is not None and len(out) < MAX_SHARD_HOLDERS:
                    out.add(SHARD_HOLDER_HEADER, f"{key[1]} {holder} {addr}")
        return out or None

    def _node(self, request) -> str | None:
        if request.headers.get(SWARM_HEADER) != "1" or not request.headers.get("X-Prime-Signature"):
            return None
        try:
            signer = self.verifier.verify(request.method, request.path_qs, request.headers, b"").signer
        except SignatureError as e:
            raise ApiError(401, e.code, e.detail) from None
        return signer if self.is_member(signer) else None

    async def before(self, request, step: int, index: int) -> tuple | None:
        key, node_id = (step, index), self._node(request)
        told = request.headers.getall(SHARD_ADDR_HEADER, [])
        if node_id is not None:
            self._remember_addrs(node_id, told)
        if not self.seeder.admit(key, node_id):
            over_http = any(a.endswith("/http") for a in told[:MAX_SHARD_ADDRS])  # it runs the HTTP data plane
            # Deferred to a first copy in flight (held until it lands), to one spreading (told its holder at once),
            # or, with nobody holding one, to leave it to a node that holds fewer (SuperSeeder.admit's spreading)
            # or, for a relayed node, to a direct node: held (START_HOLD_S) until another node's first copy starts
            # and lands, and told that holder; served if none starts within the hold. A spreading deferral used to
            # be answered at once with no holder: the node that asks first (the nearest) then waited ~0.9 s for the
            # holder's batched gossip, every step (docs/BENCHMARKS.md, "Holders named with the manifest").
            if self.seeder.holder(key) is None:  # no copy complete: one in flight, or none yet
                await self._hold(key, over_http, for_start=self.seeder.in_flight(key) is None)
                if self.seeder.holder(key) is None and self.seeder.in_flight(key) is None:
                    return self._copy(request, key, node_id)  # no first copy got out meanwhile: this node's
            raise ApiError(429, "seeded", "this shard is already spreading through the swarm; fetch it from a peer",
                           headers=self._holder_header(key, over_http))
        return self._copy(request, key, node_id)

    def _copy(self, request, key: Hashable, node_id: str | None) -> tuple | None:
        # a copy: a GET of the whole shard, or a resumption to its end ("bytes=N-"); not a HEAD or a slice
        if request.method == "GET" and request.headers.get("Range", "-").rstrip().endswith("-"):
            self.seeder.started(key, node_id)
            if self.seeder.in_flight(key) is not None and (event := self._copies.pop(key, None)) is not None:
                event.set()  # requests held for a first copy to start look again
            return key, node_id
        return None

    def _nameable(self, node_id: str) -> bool:
        return node_id in self.libp2p_addrs or node_id in self.shard_addrs

    def _waiting(self, key: Hashable, for_start: bool) -> bool:
        """Whether a held request should wait on: the first copy is in flight to a node we can name to others (an
        unnamed holder is learnt only from its gossip: holding would only delay the answer), or, `for_start`,
        nobody holds one yet."""
        holder = self.seeder.in_flight(key)
        if holder is not None:
            return self._nameable(holder)
        return for_start and self.seeder.holder(key) is None

    async def _hold(self, key: Hashable, over_http: bool, *, for_start: bool = False) -> None:
        """Wait (at most `hold_s`, `start_hold_s` for a shard nobody held) while `_waiting`. The wait is looked at again
        when a first copy of `key` starts (`_copy`) and when any copy of it ends (`after`)."""
        limit = self.start_hold_s if for_start else self.hold_s
        if limit <= 0 or self.holds >= self.max_holds or not self._waiting(key, for_start):
            return
        deadline = asyncio.get_running_loop().time() + limit
        self.holds += 1
        try:
            while self._waiting(key, for_start):
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return
                event = self._copies.setdefault(key, asyncio.Event())
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    return
        finally:
            self.holds -= 1

    def after(self, ticket: tuple | None, sent: bool) -> None:
        if ticket is not None:
            (self.seeder.finished if sent else self.seeder.failed)(*ticket)
            if (event := self._copies.pop(ticket[0], None)) is not None:
                event.set()  # the requests held for this shard look again
