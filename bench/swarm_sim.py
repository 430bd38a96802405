"""Swarm simulation: a discrete-event, flow-level network model driving the REAL shard planner
(node.worker.planner.ShardPlanner) and the REAL super-seeder (node.coordinator.seeding.SuperSeeder,
with the simulated clock injected), to see how a checkpoint broadcast behaves at N = 16 ... 4,000
nodes on internet links, which the real benchmark (bench/broadcast.py, 16 processes on 2 cores)
cannot reach.

    python bench/swarm_sim.py [--quick]
    python bench/swarm_sim.py --nat 0.6 --notify-s 5.06 [--relay] [--budget-s S]
Writes bench/results/swarm_sim.json and docs/swarm_sim.png (--relay: swarm_sim.json "relay_rows" only).

Model (every number is a parameter of `Case`):
* Links ("internet" mix): 60 % home (down U(20, 100) Mbit/s, up U(5, 40)), 30 % fiber (symmetric
  U(300, 1000) Mbit/s), 10 % datacenter (symmetric U(1, 10) Gbit/s). The origin's uploads together
  are capped at `origin_cap` (1 Gbit/s by default). Round-trip times 10-200 ms, fixed per peer pair
  (and per node to the origin).
* Bandwidth: flow level. A transfer's rate is min(sender's uplink / its active uploads, receiver's
  downlink / its active downloads), recomputed for the flows of both ends whenever a flow starts or
  ends. (Not max-min fair: capacity a sender-limited flow leaves unused at the receiver is not
  handed to the receiver's other flows, so times are, if anything, pessimistic.) A transfer starts
  one RTT after it is requested.
* Checkpoint: shards of 32 MiB (DistributionConfig.shard_size, what the publisher cuts); the
  wire bytes are taken as the checkpoint size (bf16 barely compresses at zstd level 1). A delta
  (xor-delta) keeps the same shards, each 1/30 of the bytes (`delta_fraction`).
* Each node: the worker's fetcher loop: `parallel` = 4 download slots over one ShardPlanner
  (rarest first among shards peers announced, one origin slot, deferrals), peers tried as PeerSource
  does (up to 4 random holders; a holder serving `upload_slots` = 8 transfers answers "busy", which
  costs an RTT; all busy -> the planner's deferral), then the coordinator. A node keeps serving
  once done.
* Origin: super-seeding as node/coordinator/seeding.py (the real class: first copy of each shard to
  one swarm node, "429 seeded" to the others for `super_seed_s` = 10 s after that copy, served anyway
  after 3 deferrals); a refusal costs an RTT.
* "have" gossip: a shard a node verified becomes visible to every node (and the origin's seeder)
  after the HaveAnnouncer's batch delay (uniform in [0, max(interval, min(5, N/8))] s, the real
  formula) plus log6(N) gossip hops of the mean RTT. One global view (identical events aggregated:
  everyone learns a "have" at the same instant).
* Churn (`churn_mean_s`): every node leaves after an exponential time (mean 1 h by default) and is
  replaced at once by a fresh node with an empty store and a new link draw. A leaving node's
  transfers fail (its receivers' planners get `failed`, the slot retries after 1 s) and its shards
  leave the view at once. Churn stops once every node present at t = 0 that did not leave holds the
  checkpoint; the run ends when every node present holds it.
* NAT (`nat_share`, issue #26): that share of all nodes, drawn from the homes, cannot be dialled. Each keeps
  connections to `nat_keep_peers` = 4 reachable nodes (p2p.nat_keep_peers) and serves them over those; it
  fetches from any reachable node (it dials out). Without `relay`, a NATed holder serves nobody else (no
  NATed node fetches from another), and the super-seeder's `reachable` callback says False for it, so it
  never holds a first copy (the coordinator's dial-back, node/coordinator/reachability.py).
* Relay circuits (`relay`, with NAT; docs/P2P.md "Relaying and hole punching"): every NATed node holds a
  reservation on the coordinator's hop, so the super-seeder counts it as servable (the coordinator's
  `can_serve`, node/coordinator/service.py) and any node fetches from it. A peer with no direct connection
  to a NATed holder (not one of its kept peers, no punched hole yet) goes through the hop: the transfer
  starts one extra RTT later (the CONNECT) and its rate is also capped by the hop's share, `relay_cap`
  (default: the origin's cap) divided among all relayed flows at once. After a pair's first relayed
  transfer a hole is punched (DCUtR) with probability `punch_fraction` (0.7: most home routers keep the
  source port) and the pair's later transfers are direct. The fetcher ranks holders it can reach directly
  before relayed ones (P2PNode.peers_with). `relay_first_copies = False` (a what-if, not what the coordinator
  does): circuits as above, but the seeder still gives first copies to reachable nodes only.

Not modelled: TCP dynamics (slow start, loss, RTT-limited windows), CPU cost (hashing, Noise,
py-libp2p: the cause of the real N = 16 miss), the hop's limits other than bandwidth
(relay_max_reservations = 128 per hop, circuits per peer, a circuit's byte and time caps: every NATed node
is taken to hold a reservation, as with enough `p2p.relay_addrs` hops), the network core (only
the edges are bottlenecks), gossip loss, stale "have" views after a peer leaves, the manifest and
listing round trips, nodes that lie, the fetcher's 0.25 s polling (slots wake on news or deadlines,
which is the same decision earlier).

Approximations for speed: a slot told "busy" by every holder it tried for BUSY_STREAK shards in a row
sleeps until one of those holders frees an upload slot or the shard gets a new holder (the real slot
re-polls every 0.2 s); a completion is re-scheduled only when its flow got > 2 % faster; 16 GB at
N >= 1,000 moves groups of 8 or 16 real shards as one (`shard_for`); N = 4,000 runs have a 150 s
wall-clock budget and are reported as not finished past it. Runs are not bit-reproducible (flows sit
in sets ordered by memory address).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from node.coordinator.seeding import SuperSeeder  # noqa: E402
from node.worker.planner import Pick, ShardPlanner, Wait  # noqa: E402

MIB = 1 << 20
MBIT = 125_000.0  # bytes/s
SHARD_BYTES = 32 * MIB  # node/config.py DistributionConfig.shard_size (what the publisher cuts)
MIX = [  # (share, name, down range Mbit/s, up range Mbit/s or None = symmetric)
    (0.6, "home", (20, 100), (5, 40)),
    (0.3, "fiber", (300, 1000), None),
    (0.1, "datacenter", (1000, 10000), None),
]


@dataclass
class Case:
    nodes: int
    checkpoint_bytes: int
    kind: str = "full"  # "full" | "delta"
    mode: str = "swarm"  # "swarm" | "origin" (HTTP from the origin only) | "relay" (one relay in front)
    churn_mean_s: float = 0.0  # mean session length; 0 = no churn
    origin_cap: float = 1000 * MBIT
    shard_bytes: int = SHARD_BYTES
    delta_fraction: float = 1 / 30
    links: str = "internet"  # "internet" (MIX) | "loopback" (every node `loopback_rate` both ways)
    loopback_rate: float = 100e6
    rtt_range: tuple = (0.010, 0.200)
    parallel: int = 4
    upload_slots: int = 8
    super_seed_s: float = 10.0
    have_interval: float = 0.3  # HaveAnnouncer(interval): 0.3 in the worker, 0.05 in bench/broadcast.py
    seed: int = 0
    max_sim_s: float = 10 * 86400
    budget_s: float = 0.0  # wall-clock limit of one run (0 = none): large cases that do not fit are reported so
    # NAT (issue #26): this share of all nodes, drawn from the homes, cannot be dialled. A NATed node keeps
    # connections to `nat_keep_peers` reachable nodes (p2p.nat_keep_peers) and serves only them; a NATed node
    # cannot fetch from another NATed one (relay circuits are not modelled).
    nat_share: float = 0.0
    nat_keep_peers: int = 4
    # Relay circuits (with NAT): NATed nodes hold a reservation on the coordinator's hop, get first copies and
    # serve everyone; a relayed transfer costs an extra RTT and shares `relay_cap` (0: the origin's cap) with the
    # other relayed flows; after a pair's first one, `punch_fraction` of pairs get a direct connection (DCUtR).
    relay: bool = False
    relay_cap: float = 0.0
    punch_fraction: float = 0.7
    relay_first_copies: bool = True  # False: circuits, but the seeder gives first copies to reachable nodes only
    # Before its first shard request a node learns of the step (`notify_s` after publication, then the
    # announcement's gossip hops) and spends `step_rtts` round trips to the origin (the listing and manifest).
    notify_s: float = 0.0
    step_rtts: float = 0.0
    # Explicit links instead of the mix (the WAN lab's sites, bench/wan.py): (up B/s, down B/s, one-way s,
    # NATed) per node; the RTT between two nodes is 2 * (one-way a + one-way b), to the origin 2 * one-way.
    sites: tuple = ()


class OverBudget(RuntimeError):
    pass


class Flow:
    __slots__ = ("s", "r", "pick", "rem", "rate", "last", "ver", "server", "live", "started", "ev_rate", "hop")

    def __init__(self, s, r, pick, size, server, hop=None):
        self.s, self.r, self.pick, self.rem, self.server = s, r, pick, float(size), server
        self.rate, self.last, self.ver, self.live, self.started, self.ev_rate = 0.0, 0.0, 0, True, False, 0.0
        self.hop = hop  # the relay hop this flow goes through (its uplink is shared by every relayed flow)


class Node:
    __slots__ = ("id", "cls", "up", "down", "rtt_o", "planner", "held", "idle", "ups", "downs", "reserved",
                 "active", "joined", "done_t", "initial", "holds", "server", "sent", "parked", "waiters", "wake_t",
                 "ow", "natted", "kept")

    def __init__(self, nid, cls, up, down, rtt_o):
        self.id, self.cls, self.up, self.down, self.rtt_o = nid, cls, up, down, rtt_o
        self.planner = None
        self.held = 0
        self.idle = 0
        self.ups: set = set()  # flows sending bytes
        self.downs: set = set()
        self.reserved = 0  # upload slots taken (requested or sending)
        self.active = True
        self.joined = 0.0
        self.done_t = None
        self.initial = False
        self.holds: list = []  # shards visible to others as held by this node
        self.server = None  # where this node's HTTP fetches go (origin or relay)
        self.sent = 0.0
        self.parked = 0  # slots asleep after BUSY_STREAK all-busy answers in a row
        self.waiters = deque()  # sleeping slots (Sleeper) this node told "busy"
        self.wake_t = -1.0
        self.ow = rtt_o / 2  # one way to the core (explicit sites)
        self.natted = False
        self.kept: set = set()  # a NATed node: the reachable nodes it keeps connections to (and serves)


# event kinds
WAKE, FSTART, FEND, DEFER, HAVE, LEAVE, JOIN, RETRY, BUSY = range(9)
BUSY_STREAK = 2  # a slot told "busy" by every holder it tried for this many shards in a row sleeps


class Sleeper:
    __slots__ = ("node", "shard", "alive")

    def __init__(self, node, shard):
        self.node, self.shard, self.alive = node, shard, True


class Sim:
    def __init__(self, case: Case):
        self.c = case
        self.rng = random.Random(case.seed)
        self.now = 0.0
        self.q: list = []
        self.seq = 0
        size = case.checkpoint_bytes * (case.delta_fraction if case.kind == "delta" else 1.0)
        self.num_shards = max(1, math.ceil(case.checkpoint_bytes / case.shard_bytes))
        self.shard_size = size / self.num_shards
        self.total = size
        self.swarm = case.mode == "swarm"
        # The coordinator's `can_serve`: a NATed node is servable only through a relay reservation.
        self.seeder = (SuperSeeder(case.super_seed_s, clock=lambda: self.now, reachable=self.servable)
                       if self.swarm else None)
        self.nodes: list[Node] = []
        self.origin = Node(-1, "origin", case.origin_cap, float("inf"), 0.0)
        self.origin.held = self.num_shards
        self.relay = None
        self.holders: dict[int, int] = {}  # the gossip view: shard -> how many peers announced it
        self.holder_list: list[list[int]] = [[] for _ in range(self.num_shards)]
        self.holder_pos: list[dict[int, int]] = [{} for _ in range(self.num_shards)]
        self.idle_nodes: set[int] = set()
        self.shard_waiters: dict[int, list] = {}
        self.origin_bytes = 0.0
        self.peer_bytes = 0.0
        self.events = 0
        self.churning = case.churn_mean_s > 0
        self.leaves = self.joins = 0
        self.takes = 0
        self.waiting_initial = self.waiting_all = 0  # present nodes not yet holding the checkpoint
        n = case.nodes
        self.gossip_batch = max(case.have_interval, min(5.0, n / 8.0))
        self.gossip_hops = max(1, math.ceil(math.log(max(n, 2), 6)))
        self.mean_rtt = sum(case.rtt_range) / 2 if case.links == "internet" else case.rtt_range[0]
        if case.sites:
            self.mean_rtt = 2 * 2 * sum(x[2] for x in case.sites) / len(case.sites)
        self.nat = case.nat_share > 0 or any(x[3] for x in case.sites)
        self.natted_bytes = 0.0  # served by NATed nodes
        self.relaying = case.relay and self.nat
        self.hop = None  # the coordinator's relay hop: a node whose uplink is what relayed flows share
        if self.relaying:
            cap = case.relay_cap or case.origin_cap
            self.hop = Node(-3, "hop", cap, cap, 0.0)
        self.punched: dict[tuple[int, int], bool] = {}  # pair -> a hole was punched after its first circuit
        self.relayed_bytes = 0.0
        self.relayed_transfers = 0
        self.origin_sends = 0  # shard transfers the origin began
        self.origin_sends_held = 0  # ... of a shard some peer held (in the view) that this node could not use

    def servable(self, node_id) -> bool | None:
        """The super-seeder's `reachable` callback, as the coordinator's `can_serve`: False for a NATed node
        without a relay reservation (here: without `relay`), None (unknown: servable) otherwise."""
        if isinstance(node_id, int) and 0 <= node_id < len(self.nodes) and self.nodes[node_id].natted:
            return None if self.relaying and self.c.relay_first_copies else False
        return None

    # ---- plumbing -------------------------------------------------------------------------------
    def push(self, t, kind, a=None, b=None):
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, kind, a, b))

    def rtt(self, a: Node, b: Node) -> float:
        if a is self.origin or a is self.relay:
            return b.rtt_o
        if b is self.origin or b is self.relay:
            return a.rtt_o
        if self.c.sites:
            return 2 * (a.ow + b.ow)
        lo, hi = self.c.rtt_range
        x, y = (a.id, b.id) if a.id < b.id else (b.id, a.id)
        h = ((x * 2654435761) ^ (y * 40503 + 0x9E3779B9)) & 0xFFFFFFFF
        return lo + (hi - lo) * ((h * 2246822519) & 0xFFFF) / 0xFFFF

    def new_node(self, initial: bool) -> Node:
        c, rng = self.c, self.rng
        natted = False
        if c.sites:
            up, down, ow, natted = c.sites[len(self.nodes) % len(c.sites)]
            cls = "home" if natted else "public"
            node = Node(len(self.nodes), cls, up, down, 2 * ow)
            node.natted = natted
            return self._added(node, initial)
        if c.links == "loopback":
            cls, up, down = "loopback", c.loopback_rate, c.loopback_rate
        else:
            x, acc = rng.random(), 0.0
            for share, cls, dr, ur in MIX:
                acc += share
                if x < acc:
                    break
            down = rng.uniform(*dr) * MBIT
            up = down if ur is None else rng.uniform(*ur) * MBIT
        node = Node(len(self.nodes), cls, up, down, rng.uniform(*c.rtt_range))
        home_share = MIX[0][0]
        node.natted = cls == "home" and c.nat_share > 0 and rng.random() < min(1.0, c.nat_share / home_share)
        return self._added(node, initial)

    def _added(self, node: Node, initial: bool) -> Node:
        node.joined, node.initial = self.now, initial
        if node.natted and self.nodes:  # it dials out to a few reachable nodes and keeps the connections
            reach = [n.id for n in self.rng.sample(self.nodes, min(len(self.nodes), 8 * self.c.nat_keep_peers))
                     if n.active and not n.natted]
            node.kept = set(reach[:self.c.nat_keep_peers])
        node.server = self.origin
        self.nodes.append(node)
        self.waiting_all += 1
        self.waiting_initial += initial
        return node

    def start_fetching(self, node: Node) -> None:
        node.planner = ShardPlanner(self.num_shards, range(self.num_shards), swarm=self.swarm,
                                    rng=random.Random(self.rng.random()))
        node.idle = min(self.c.parallel, self.num_shards)
        start = self.c.notify_s + self.c.step_rtts * node.rtt_o
        if start > 0 and node.initial:
            if self.swarm:  # the step's announcement reaches it after the gossip's hops
                start += self.gossip_hops * self.mean_rtt
            node.wake_t = self.now + start
            self.push(node.wake_t, WAKE, node)
            return
        self.wake(node)

    def usable(self, holder: Node, node: Node) -> bool:
        """Whether `node` can fetch from `holder` over a direct connection: a NATed holder is reached only by
        the reachable nodes it keeps connections to, or (relay circuits) a peer it punched a hole to; a NATed
        node dials out to any reachable holder."""
        if holder.natted:
            return node.id in holder.kept or self.punched.get(self.pair(holder, node), False)
        return True

    @staticmethod
    def pair(a: Node, b: Node) -> tuple[int, int]:
        return (a.id, b.id) if a.id < b.id else (b.id, a.id)

    # ---- bandwidth --------------------------------------------------------------------------------
    def settle(self, f: Flow) -> None:
        if f.rate > 0:
            f.rem -= f.rate * (self.now - f.last)
        f.last = self.now

    def reshare(self, node: Node, up: bool) -> None:
        """New rates for the flows of one end. The completion event is re-scheduled only when a flow got
        more than 2 % faster than when it was scheduled (a slower flow's event fires early and is
        re-scheduled then), so a completion is at most 2 % of its remaining time late."""
        now = self.now
        hop = self.hop
        for f in (node.ups if up else node.downs):
            rate = min(f.s.up / len(f.s.ups), f.r.down / len(f.r.downs))
            if f.hop is not None:
                rate = min(rate, hop.up / len(hop.ups))
            if rate != f.rate:
                f.rem -= f.rate * (now - f.last)
                f.last = now
                f.rate = rate
                if rate > f.ev_rate * 1.02:
                    self.schedule(f)

    def schedule(self, f: Flow) -> None:
        f.ver += 1
        f.ev_rate = f.rate
        self.push(self.now + max(f.rem, 0.0) / f.rate, FEND, f, f.ver)

    def flow_begin(self, f: Flow) -> None:
        if not f.live:
            return
        f.started, f.last = True, self.now
        f.s.ups.add(f)
        f.r.downs.add(f)
        if f.hop is not None:
            f.hop.ups.add(f)
            self.reshare(f.hop, True)
        self.reshare(f.s, True)
        self.reshare(f.r, False)

    def release(self, s: Node) -> None:
        """An upload slot of `s` is free: the first slot it told "busy" that still sleeps looks again."""
        s.reserved -= 1
        w = s.waiters
        while w:
            if self.unpark(w.popleft()):
                return

    def unpark(self, sl: Sleeper) -> bool:
        if not sl.alive:
            return False
        sl.alive = False
        node = sl.node
        if not node.active:
            return False
        node.parked -= 1
        node.idle += 1
        self.push(max(self.now, node.planner.peers_wait.get(sl.shard, 0.0)), WAKE, node)
        return True

    def flow_stop(self, f: Flow) -> None:
        """Take a flow out of both ends and reshare."""
        f.live = False
        self.release(f.s)
        if f.started:
            self.settle(f)
            f.s.ups.discard(f)
            f.r.downs.discard(f)
            if f.hop is not None:
                f.hop.ups.discard(f)
                self.reshare(f.hop, True)
            self.reshare(f.s, True)
            self.reshare(f.r, False)

    # ---- the fetcher's slots -----------------------------------------------------------------------
    def wake(self, node: Node) -> None:
        """Run the node's idle download slots until one is told to wait (slots are interchangeable)."""
        p = node.planner
        while node.idle > 0 and node.active:
            self.takes += 1
            pick = p.take(self.now, self.holders)
            if isinstance(pick, Wait):
                self.idle_nodes.add(node.id)
                t = pick.until
                if t is not None and not (self.now <= node.wake_t <= t):  # one timed wake per deadline
                    node.wake_t = t
                    self.push(t, WAKE, node)
                return
            node.idle -= 1
            self.dispatch(node, pick)
        self.idle_nodes.discard(node.id)

    def dispatch(self, node: Node, pick: Pick, streak: int = 0) -> None:
        i = pick.index
        if self.swarm and self.holders.get(i, 0) > 0:  # PeerSource: up to 4 random holders, busy ones cost an RTT
            lst = self.holder_list[i]
            if self.relaying:  # every holder: those reachable directly first, then relayed (P2PNode.peers_with)
                cand = self.rng.sample(lst, min(16, len(lst)))
                direct = [h for h in cand if self.usable(self.nodes[h], node)]
                tries = (direct + [h for h in cand if h not in direct])[:4] if len(direct) < 4 else direct[:4]
            elif self.nat:  # NATed holders only for those they keep connections to (PeerSource ranks reachable first)
                cand = self.rng.sample(lst, min(16, len(lst)))
                tries = [h for h in cand if self.usable(self.nodes[h], node)][:4]
            else:
                tries = self.rng.sample(lst, min(4, len(lst)))
            if tries:  # (none usable: the origin, as when nobody holds it)
                delay = 0.0
                for hid in tries:
                    h = self.nodes[hid]
                    rtt = self.rtt(node, h)
                    relayed = self.relaying and h.natted and not self.usable(h, node)
                    if relayed:  # a circuit through the hop: CONNECT first (one more round trip)
                        rtt *= 2
                    if h.reserved < self.c.upload_slots:
                        self.transfer(h, node, pick, delay + rtt, server=False, hop=self.hop if relayed else None)
                        return
                    delay += rtt
                self.push(self.now + delay, BUSY, node, (pick, streak + 1, tries))  # every holder tried was busy
                return
        server = node.server
        if server is self.relay and self.relay is not None:
            self.transfer(server, node, pick, node.rtt_o, server=True)
            return
        if self.seeder is not None and not self.seeder.admit(i, node.id):  # 429 seeded
            self.push(self.now + node.rtt_o, DEFER, node, pick)
            return
        if self.seeder is not None:
            self.seeder.started(i, node.id)
        self.origin_sends += 1
        self.origin_sends_held += self.holders.get(i, 0) > 0
        self.transfer(self.origin, node, pick, node.rtt_o, server=True)

    def busy(self, node: Node, pick: Pick, streak: int, tries: list) -> None:
        """Every holder tried was busy: the planner defers the shard (peers_wait) and the slot takes the
        next one; after BUSY_STREAK such answers in a row it sleeps until a holder it tried frees an
        upload slot or the shard gets a new holder (the real slot re-polls every 0.2 s: the same
        outcome without the extra "busy" round trips)."""
        node.planner.deferred(pick, self.now)
        if streak < BUSY_STREAK:
            self.takes += 1
            nxt = node.planner.take(self.now, self.holders)
            if isinstance(nxt, Pick):
                self.dispatch(node, nxt, streak)
                return
            node.idle += 1
            self.wake(node)
            return
        sl = Sleeper(node, pick.index)
        node.parked += 1
        for hid in tries:
            self.nodes[hid].waiters.append(sl)
        self.shard_waiters.setdefault(pick.index, deque()).append(sl)

    def transfer(self, s: Node, r: Node, pick: Pick, delay: float, server: bool, hop: Node | None = None) -> None:
        f = Flow(s, r, pick, self.shard_size, server, hop)
        s.reserved += 1
        self.push(self.now + delay, FSTART, f)

    def flow_end(self, f: Flow) -> None:
        self.flow_stop(f)
        node, pick = f.r, f.pick
        if f.s is self.origin:
            self.origin_bytes += self.shard_size
            if self.seeder is not None:
                self.seeder.finished(pick.index, node.id)
        else:
            self.peer_bytes += self.shard_size if not f.server else 0.0
            if f.s.natted:
                self.natted_bytes += self.shard_size
            if f.hop is not None:  # the pair's first circuit: DCUtR punches a hole, or the pair stays relayed
                self.relayed_bytes += self.shard_size
                self.relayed_transfers += 1
                key = self.pair(f.s, f.r)
                if key not in self.punched:
                    self.punched[key] = self.rng.random() < self.c.punch_fraction
        f.s.sent += self.shard_size
        node.planner.done(pick)
        node.held += 1
        if self.swarm:
            delay = self.rng.uniform(0, self.gossip_batch) + self.gossip_hops * self.mean_rtt
            self.push(self.now + delay, HAVE, node, pick.index)
        if node.held == self.num_shards:
            node.done_t = self.now
            if node is not self.relay:
                self.waiting_all -= 1
                self.waiting_initial -= node.initial
            self.on_done(node)
        node.idle += 1
        self.wake(node)

    def on_done(self, node: Node) -> None:
        if node is self.relay:  # the relay lists the step once it mirrored all of it
            for n in self.nodes:
                if n is not self.relay:
                    self.start_fetching(n)

    def have(self, node: Node, i: int) -> None:
        if not node.active:
            return
        pos = self.holder_pos[i]
        pos[node.id] = len(self.holder_list[i])
        self.holder_list[i].append(node.id)
        node.holds.append(i)
        n = self.holders.get(i, 0) + 1
        self.holders[i] = n
        self.seeder.announced(node.id, [i])
        ws = self.shard_waiters.get(i)
        if ws:  # a new holder: up to `upload_slots` slots sleeping on this shard look again
            k = 0
            while ws and k < self.c.upload_slots:
                k += self.unpark(ws.popleft())
        if n == 1:  # news: a shard nobody held; one idle slot per waiting node looks again
            for nid in list(self.idle_nodes):
                nd = self.nodes[nid]
                if i in nd.planner.remaining:
                    self.wake(nd)

    # ---- churn --------------------------------------------------------------------------------------
    def leave(self) -> None:
        live = [n for n in self.nodes if n.active and n is not self.relay]
        node = self.rng.choice(live)
        node.active = False
        self.leaves += 1
        if node.done_t is None:
            self.waiting_all -= 1
            self.waiting_initial -= node.initial
        self.idle_nodes.discard(node.id)
        for f in list(node.downs):
            self.flow_stop(f)
            if f.s is self.origin and self.seeder is not None:
                self.seeder.failed(f.pick.index, node.id)
        for f in list(node.ups):
            self.flow_stop(f)
            self.fail(f)
        node.downs.clear()
        node.ups.clear()
        for i in node.holds:  # remove from the view (swap-remove)
            pos, lst = self.holder_pos[i], self.holder_list[i]
            k = pos.pop(node.id)
            last = lst.pop()
            if last != node.id:
                lst[k] = last
                pos[last] = k
            self.holders[i] -= 1
        node.holds = []
        for sl in node.waiters:  # the slots it told "busy" look elsewhere
            self.unpark(sl)
        node.waiters = deque()
        self.push(self.now, JOIN)

    def fail(self, f: Flow) -> None:
        if f.r.active:
            self.push(self.now + 1.0, RETRY, f.r, f.pick)

    def all_initial_stayers_done(self) -> bool:
        return all(n.done_t is not None for n in self.nodes if n.initial and n.active)

    # ---- run ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.c
        wall0 = time.perf_counter()
        if c.mode == "relay":
            self.relay = Node(-2, "relay", c.loopback_rate if c.links == "loopback" else 10_000 * MBIT,
                              c.loopback_rate if c.links == "loopback" else 10_000 * MBIT,
                              self.rng.uniform(*c.rtt_range))
            self.relay.server = self.origin
            self.relay.id = 10**9
        for _ in range(c.nodes):
            self.new_node(initial=True)
        if self.relay is not None:
            for n in self.nodes:
                n.server = self.relay
            self.relay.planner = ShardPlanner(self.num_shards, range(self.num_shards), swarm=False,
                                              rng=random.Random(1))
            self.relay.idle = min(c.parallel, self.num_shards)
            self.wake(self.relay)
        else:
            for n in self.nodes:
                self.start_fetching(n)
        if self.churning:
            self.push(self.rng.expovariate(c.nodes / c.churn_mean_s), LEAVE)
        stayers_t = None
        q = self.q
        while q:
            t, _, kind, a, b = heapq.heappop(q)
            if t > c.max_sim_s:
                raise RuntimeError(f"simulation passed {c.max_sim_s} s: {self.summary_counts()}")
            self.now = t
            self.events += 1
            if c.budget_s and not self.events & 8191 and time.perf_counter() - wall0 > c.budget_s:
                raise OverBudget(f"not finished within {c.budget_s:.0f} s of wall clock ({self.summary_counts()})")
            if kind == FEND:
                if a.live and b == a.ver:
                    self.settle(a)
                    if a.rem > 1.0 and a.rem > a.rate * 1e-6:  # it got slower since: not done yet
                        self.schedule(a)
                    else:
                        self.flow_end(a)
            elif kind == FSTART:
                if a.live and a.r.active and a.s.active:
                    self.flow_begin(a)
                elif a.live:
                    a.live = False
                    self.release(a.s)
                    if a.s is self.origin and self.seeder is not None:
                        self.seeder.failed(a.pick.index, a.r.id)
                    if a.r.active:
                        self.fail(a)
            elif kind == WAKE:
                if t == a.wake_t:
                    a.wake_t = -1.0
                if a.active and a.planner is not None:
                    self.wake(a)
            elif kind == HAVE:
                self.have(a, b)
            elif kind == BUSY:
                if a.active:
                    self.busy(a, *b)
            elif kind == DEFER:
                if a.active:
                    a.planner.deferred(b, self.now)
                    a.idle += 1
                    self.wake(a)
            elif kind == RETRY:
                if a.active:
                    a.planner.failed(b)
                    a.idle += 1
                    self.wake(a)
            elif kind == LEAVE:
                if self.churning:
                    self.leave()
                    self.push(self.now + self.rng.expovariate(c.nodes / c.churn_mean_s), LEAVE)
            elif kind == JOIN:
                if self.churning:
                    self.joins += 1
                    self.start_fetching(self.new_node(initial=False))
            if kind in (FEND,) and stayers_t is None and self.all_done(initial_only=True):
                stayers_t = self.now
                self.churning = False
            if kind == FEND and self.all_done(initial_only=False):
                break
        if not self.all_done(initial_only=False):
            raise RuntimeError(f"simulation stalled: {self.summary_counts()}")
        return self.result(stayers_t, time.perf_counter() - wall0)

    def all_done(self, initial_only: bool) -> bool:
        return (self.waiting_initial if initial_only else self.waiting_all) == 0

    def summary_counts(self) -> str:
        live = [n for n in self.nodes if n.active]
        return (f"t={self.now:.1f} live={len(live)} done={sum(n.done_t is not None for n in live)} "
                f"events={self.events} takes={self.takes}")

    def lower_bound(self, nodes: list[Node]) -> dict:
        """Every schedule needs at least: one copy through the origin cap (every byte leaves the origin
        once), the slowest node's download of every byte at its full downlink, and all nodes' bytes
        (N copies, less nothing) through the total upload capacity (origin cap + every node's uplink);
        plus one RTT to the origin."""
        S = self.total
        one_copy = S / self.c.origin_cap
        slowest = max(S / n.down for n in nodes)
        supply = self.c.origin_cap + (sum(n.up for n in nodes) if self.swarm else 0.0)
        if self.relay is not None:  # the nodes' bytes come through the relay's uplink
            supply = self.relay.up
        aggregate = len(nodes) * S / supply
        bound = max(one_copy, slowest, aggregate) + min(n.rtt_o for n in nodes)
        which = max(("one copy at origin cap", one_copy), ("slowest downlink", slowest),
                    ("aggregate upload", aggregate), key=lambda kv: kv[1])[0]
        return {"lower_bound_seconds": bound, "bound_by": which, "one_copy_seconds": one_copy,
                "slowest_download_seconds": slowest, "aggregate_upload_seconds": aggregate}

    def result(self, stayers_t, wall) -> dict:
        c = self.c
        initial = [n for n in self.nodes if n.initial]
        stayed = [n for n in initial if n.active]
        joiners = [n for n in self.nodes if not n.initial]
        seconds = max(n.done_t for n in stayed)
        lb = self.lower_bound(stayed if stayed else initial)
        row = {
            "nodes": c.nodes, "checkpoint_bytes": c.checkpoint_bytes, "kind": c.kind, "mode": c.mode,
            "links": c.links, "churn": (f"mean session {c.churn_mean_s:.0f} s" if c.churn_mean_s else None),
            "wire_bytes": round(self.total), "shards": self.num_shards, "sim_shard_bytes": c.shard_bytes, "shard_wire_bytes": round(self.shard_size),
            "origin_cap_bytes_s": c.origin_cap,
            "seconds": round(seconds, 2), **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in lb.items()},
            "ratio": round(seconds / lb["lower_bound_seconds"], 3),
            "origin_bytes": round(self.origin_bytes), "origin_copies": round(self.origin_bytes / self.total, 3),
            "peer_bytes": round(self.peer_bytes), "natted_served_bytes": round(self.natted_bytes),
            "natted_nodes": sum(n.natted for n in initial),
            "relay": self.relaying, "relay_first_copies": self.relaying and c.relay_first_copies,
            "relayed_bytes": round(self.relayed_bytes),
            "relayed_transfers": self.relayed_transfers, "punched_pairs": sum(self.punched.values()),
            "relayed_pairs": len(self.punched),
            "origin_sends": self.origin_sends, "origin_sends_of_held_shards": self.origin_sends_held,
            "median_node_seconds": round(sorted(n.done_t - n.joined for n in stayed)[len(stayed) // 2], 2),
            "sim_events": self.events, "planner_takes": self.takes, "wall_seconds": round(wall, 1),
        }
        if c.churn_mean_s:
            done_j = [n.done_t - n.joined for n in joiners if n.done_t is not None]
            row.update({"left": self.leaves, "joined": self.joins, "stayers": len(stayed),
                        "joiners_done": len(done_j),
                        "joiner_median_seconds": round(sorted(done_j)[len(done_j) // 2], 2) if done_j else None,
                        "all_present_seconds": round(self.now, 2)})
        return row


def simulate(case: Case) -> dict:
    return Sim(case).run()


# ---- the benchmark ---------------------------------------------------------------------------------
GB = 10**9


def validation() -> list[dict]:
    """bench/broadcast.py's set-up: 3,700,211 B in 128 KiB shards, origin cap 0.5 MB/s, loopback
    (nodes uncapped: 100 MB/s, RTT 1 ms), HaveAnnouncer interval 0.05 s, 4 slots, 10 s super-seeding."""
    measured = json.loads((REPO / "bench/results/broadcast.json").read_text())
    rows = []
    for m in measured.get("rows", measured.get("results", [])):
        case = Case(nodes=m["nodes"], checkpoint_bytes=measured["compressed_bytes"], mode=m["mode"],
                    origin_cap=measured["origin_upload_limit"], shard_bytes=131072, links="loopback",
                    rtt_range=(0.001, 0.001), have_interval=0.05)
        r = simulate(case)
        err = r["seconds"] / m["seconds"] - 1
        rows.append({"mode": m["mode"], "nodes": m["nodes"], "sim_seconds": r["seconds"],
                     "measured_seconds": m["seconds"], "sim_vs_measured": round(err, 3),
                     "within_20pct": abs(err) <= 0.2, "sim_origin_bytes": r["origin_bytes"],
                     "measured_origin_bytes": m["bytes_from_origin"]})
    return rows


def lab_sites(n: int) -> tuple:
    """The WAN lab's N-node mix (bench/wan.py swarm_sites) as explicit sites: (up B/s, down B/s, one way s, NATed)."""
    sys.path.insert(0, str(REPO / "bench"))
    from wan import DOWNLINK_MBIT, UPLINK_MBIT, swarm_sites

    return tuple((UPLINK_MBIT[k] * MBIT, DOWNLINK_MBIT[k] * MBIT, p.one_way_ms / 1e3, k == "home")
                 for _, p, k in swarm_sites(n))


def lab_validation(notify_s: float = 0.0, relay: bool = False) -> list[dict]:
    """The simulator against the WAN lab (bench/results/wan.json "scale": the real CLI loop at N nodes of the
    issue's mix, 60 % home behind NAT): the median step's time until every node holds it, full and delta, with
    the lab's links, sizes (the median step's wire bytes), 256 KiB shards, origin cap and NATed homes. A node
    starts a step after `notify_s` (it learns of it from the announcement or its 1 s poll) and one round trip
    (the listing with the manifest, docs/BENCHMARKS.md "WAN lab: round trips per step"). Held out from the fit of
    `notify_s` (fitted on t_all_s): the median node's time (t_median_s) and the NATed homes' share of peer bytes."""
    doc = json.loads((REPO / "bench/results/wan.json").read_text())
    scale = doc.get("scale", {})
    rows = []
    for m in scale.get("rows", []):
        for kind in ("full", "delta"):
            sizes = sorted(x["bytes"] for x in m["per_step"] if (x["encoding"] == "full") == (kind == "full"))
            measured = m[kind]["t_all_s"]
            if not sizes or measured is None:
                continue
            size = sizes[len(sizes) // 2]
            case = Case(nodes=m["n"], checkpoint_bytes=size, shard_bytes=262144, delta_fraction=1.0,
                        origin_cap=m["origin_mbit"] * MBIT, sites=lab_sites(m["n"]), have_interval=0.3,
                        notify_s=notify_s, step_rtts=1.0, super_seed_s=10.0, relay=relay)
            r = simulate(case)
            err = r["seconds"] / measured - 1
            med = m[kind].get("t_median_s")
            rows.append({"nodes": m["n"], "kind": kind, "relay": relay, "wire_bytes": size, "sim_seconds": r["seconds"],
                         "sim_median_seconds": r["median_node_seconds"], "measured_median_seconds": med,
                         "median_sim_vs_measured": round(r["median_node_seconds"] / med - 1, 3) if med else None,
                         "measured_seconds": measured, "sim_vs_measured": round(err, 3),
                         "within_20pct": abs(err) <= 0.2, "sim_natted_share_of_peer_bytes":
                         round(r["natted_served_bytes"] / r["peer_bytes"], 3) if r["peer_bytes"] else None,
                         "measured_natted_served_bytes": m["natted_served_bytes"],
                         "measured_peer_bytes": (m["bytes_by_source"] or {}).get("peer")})
    return rows


def lab_roundtrip_validation() -> list[dict]:
    """A held-out check of the per-step round trips (no parameter fitted to it): wan.json "no_p2p" (run "after"),
    one home per one-way delay (20 Mbit/s up, 100 down: tests/wan/lab.py `home`), p2p off, deltas from the origin
    (1 Gbit/s datacenter, no upload limit) in 256 KiB shards (configs/local.toml). The lab's s/step runs from the
    listing request to the last byte (bench/wan.py), so the simulated node starts at once (notify_s = 0) and spends
    one round trip on the listing with the manifest, then the shards. The delta's size is not in that run's
    record: the scale run's median delta (same demo model) stands in for it."""
    doc = json.loads((REPO / "bench/results/wan.json").read_text())
    scale = doc.get("scale", {}).get("rows", [])
    sizes = sorted(x["bytes"] for m in scale for x in m["per_step"] if x["encoding"] != "full")
    run = doc.get("no_p2p", {}).get("runs", {}).get("after")
    if not sizes or run is None:
        return []
    size = sizes[len(sizes) // 2]
    rows = []
    for name, m in run["nodes"].items():
        measured = m.get("delta_s_per_step")
        if measured is None:
            continue
        site = (20 * MBIT, 100 * MBIT, m["one_way_ms"] / 1e3, False)
        r = simulate(Case(nodes=1, checkpoint_bytes=size, shard_bytes=262144, delta_fraction=1.0, mode="origin",
                          origin_cap=1000 * MBIT, sites=(site,), step_rtts=1.0))
        err = r["seconds"] / measured - 1
        rows.append({"run": "no_p2p/after", "rtt_ms": m["rtt_ms"], "wire_bytes": size, "sim_seconds": r["seconds"],
                     "measured_seconds": measured, "sim_vs_measured": round(err, 3), "within_20pct": abs(err) <= 0.2,
                     "measured_rtts": m.get("delta_rtts"), "sim_rtts": round(r["seconds"] / (m["rtt_ms"] / 1e3), 2)})
    return rows


def shard_for(n: int, ck: int) -> int:
    """The simulated shard: the real 32 MiB, except for 16 GB at N >= 1,000, where groups of 8 (N = 1,000)
    or 16 (N = 4,000) real shards move as one (aggregated events) so that a run fits in minutes."""
    if ck > 4 * GB and n >= 4000:
        return 16 * SHARD_BYTES
    if ck > 4 * GB and n >= 1000:
        return 8 * SHARD_BYTES
    return SHARD_BYTES


def cases(quick: bool) -> list[Case]:
    out = []
    sizes = [16, 100] if quick else [16, 100, 1000, 4000]
    for ck in (1 * GB, 16 * GB):
        for n in sizes:
            budget = 150.0 if n >= 4000 else 0.0
            for kind, churn in (("full", 0.0), ("delta", 0.0), ("full", 3600.0)):
                out.append(Case(nodes=n, checkpoint_bytes=ck, kind=kind, churn_mean_s=churn,
                                shard_bytes=shard_for(n, ck), budget_s=budget))
    return out


def fmt_table(rows: list[dict]) -> str:
    head = "| N | checkpoint | kind | churn | s | lower bound s (by) | ratio | origin copies | median node s |"
    lines = [head, "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {r['nodes']:,} | {r['checkpoint_bytes'] / GB:g} GB | {r['kind']} | "
                         f"{'yes' if r['churn'] else '-'} | not finished within the wall-clock budget | | | | |")
            continue
        churn = "-" if not r["churn"] else f"{r['left']} left / {r['joined']} joined"
        lines.append(f"| {r['nodes']:,} | {r['checkpoint_bytes'] / GB:g} GB | {r['kind']} | {churn} | "
                     f"{r['seconds']:,.1f} | {r['lower_bound_seconds']:,.1f} ({r['bound_by']}) | "
                     f"**{r['ratio']:.2f}** | {r['origin_copies']:.2f} | {r['median_node_seconds']:,.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ck, ax in zip((1 * GB, 16 * GB), axes):
        for kind, churn, nat, style in (("full", False, False, "o-"), ("delta", False, False, "s--"),
                                        ("full", True, False, "^:"), ("full", False, True, "o-."),
                                        ("delta", False, True, "s-.")):
            sel = [r for r in rows if r["checkpoint_bytes"] == ck and r["kind"] == kind and bool(r.get("churn")) == churn
                   and bool(r.get("nat_share")) == nat and r["seconds"] is not None]
            if not sel:
                continue
            share = sel[0].get("nat_share") or 0
            label = f"{kind}{' + churn' if churn else ''}{f' ({share:.0%} behind NAT)' if nat else ''}"
            ax.plot([r["nodes"] for r in sel], [r["ratio"] for r in sel], style, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("time to 100 % ÷ lower bound")
        ax.set_title(f"{ck / GB:g} GB checkpoint (simulated)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(rows: list[dict], val: list[dict]) -> None:
    d = Case(1, 1)
    out = {"benchmark": "swarm_sim", "model": {
        "links": [{"share": s, "class": c, "down_mbit": d_, "up_mbit": u or "symmetric"} for s, c, d_, u in MIX],
        "origin_cap_bytes_s": d.origin_cap, "shard_bytes": SHARD_BYTES, "delta_fraction": d.delta_fraction,
        "rtt_s": list(d.rtt_range),
        "churn": "each node leaves after Exp(mean 3600 s) and is replaced at once by an empty node",
        "busy_streak": BUSY_STREAK,
        "defaults": {k: v for k, v in asdict(d).items() if k not in ("nodes", "checkpoint_bytes")}},
        "rows": rows, "validation": val}
    (REPO / "bench/results/swarm_sim.json").write_text(json.dumps(out, indent=2) + "\n")


def relay_label(r: dict) -> str:
    return "relay      " if r["relay_first_copies"] else "relay, NFC " if r["relay"] else "no relay   "


def nat_line(r: dict) -> str:
    if r["seconds"] is None:
        return f"N={r['nodes']:5d} 1 GB {r['kind']:5s} NAT {r['nat_share']:.0%} {relay_label(r)} {r['note']}"
    return (f"N={r['nodes']:5d} 1 GB {r['kind']:5s} NAT {r['nat_share']:.0%} {relay_label(r)} {r['seconds']:9.1f} s  "
            f"bound {r['lower_bound_seconds']:9.1f} s  ratio {r['ratio']:.2f}  origin {r['origin_copies']:.2f} copies  "
            f"NATed served {r['natted_served_bytes'] / max(1, r['peer_bytes']):.1%} of peer bytes, relayed "
            f"{r['relayed_bytes'] / max(1, r['peer_bytes']):.1%} (wall {r['wall_seconds']} s, {r['sim_events']:,} events)")


def nat_main(share: float, notify_s: float, relay: bool, budget_s: float, sizes: tuple) -> None:
    """Without --relay: "lab_validation" and "nat_rows" (NATed nodes serve only their kept peers). With --relay:
    "relay_lab_validation" and "relay_rows", each case without and with relay circuits side by side (same seed)."""
    path = REPO / "bench/results/swarm_sim.json"
    doc = json.loads(path.read_text())
    variants = ((False, True), (True, True), (True, False)) if relay else ((False, True),)  # (relay, first copies)
    val = [v for rl, _ in variants[:2] for v in lab_validation(notify_s, relay=rl)]
    for v in val:
        print(v, flush=True)
    doc["relay_lab_validation" if relay else "lab_validation"] = {"notify_s": notify_s, "rows": val}
    rt = lab_roundtrip_validation()
    for v in rt:
        print(v, flush=True)
    doc["lab_roundtrip_validation"] = rt
    key = "relay_rows" if relay else "nat_rows"
    rows = []
    for n in sizes:
        for kind in ("full", "delta"):
            for rl, first in variants:
                case = Case(nodes=n, checkpoint_bytes=1 * GB, kind=kind, nat_share=share, notify_s=notify_s,
                            step_rtts=1.0, budget_s=budget_s if n >= 1000 else 0.0, relay=rl,
                            relay_first_copies=first)
                t0 = time.perf_counter()
                sim = Sim(case)
                try:
                    r = sim.run()
                except OverBudget as e:
                    r = {"nodes": n, "checkpoint_bytes": 1 * GB, "kind": kind, "relay": rl,
                         "relay_first_copies": rl and first, "seconds": None,
                         "note": str(e), "sim_events": sim.events, "sim_t": round(sim.now, 1),
                         "wall_seconds": round(time.perf_counter() - t0, 1)}
                r["nat_share"] = share
                print(nat_line(r), flush=True)
                rows.append(r)
                doc[key] = rows
                path.write_text(json.dumps(doc, indent=2) + "\n")
    if not relay:
        plot([*doc["rows"], *rows], REPO / "docs/swarm_sim.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="N = 16 and 100 only")
    ap.add_argument("--skip-validation", action="store_true")
    ap.add_argument("--nat", type=float, default=None, metavar="SHARE",
                    help="only: the simulator against the WAN lab (wan.json \"scale\"), then 1 GB full and delta at "
                         "N = 16 ... 4,000 with this share of all nodes behind NAT; kept in swarm_sim.json as "
                         "\"lab_validation\" and \"nat_rows\" beside the other rows")
    ap.add_argument("--notify-s", type=float, default=0.0, help="--nat: a node's delay in learning of a step")
    ap.add_argument("--relay", action="store_true",
                    help="--nat: each case without relay circuits, with them (NATed nodes hold a reservation on the "
                         "coordinator's hop and get first copies), and with them but first copies to reachable nodes "
                         "only (NFC), side by side, as \"relay_lab_validation\" and \"relay_rows\"")
    ap.add_argument("--budget-s", type=float, default=100.0, help="--nat: wall-clock limit of one N >= 1,000 run")
    ap.add_argument("--sizes", default="16,100,1000,4000", help="--nat: node counts, comma-separated")
    args = ap.parse_args()
    if args.nat is not None:
        nat_main(args.nat, args.notify_s, args.relay, args.budget_s, tuple(int(x) for x in args.sizes.split(",")))
        return
    val = [] if args.skip_validation else validation()
    for v in val:
        print(v, flush=True)
    rows = []
    for case in cases(args.quick):
        try:
            r = simulate(case)
        except OverBudget as e:
            print(f"N={case.nodes} {case.checkpoint_bytes / GB:g} GB {case.kind} churn={bool(case.churn_mean_s)}: {e}",
                  flush=True)
            rows.append({"nodes": case.nodes, "checkpoint_bytes": case.checkpoint_bytes, "kind": case.kind,
                         "churn": f"mean session {case.churn_mean_s:.0f} s" if case.churn_mean_s else None,
                         "sim_shard_bytes": case.shard_bytes, "seconds": None, "note": str(e)})
            write(rows, val)
            continue
        print(f"N={r['nodes']:5d} {r['checkpoint_bytes'] / GB:4g} GB {r['kind']:5s} churn={bool(r['churn'])!s:5s} "
              f"{r['seconds']:9.1f} s  bound {r['lower_bound_seconds']:9.1f} s  ratio {r['ratio']:.2f}  "
              f"origin {r['origin_copies']:.2f} copies  (wall {r['wall_seconds']} s)", flush=True)
        rows.append(r)
        write(rows, val)
        plot(rows, REPO / "docs/swarm_sim.png")
    print()
    print(fmt_table(rows))


if __name__ == "__main__":
    main()
