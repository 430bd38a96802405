"""Swarm simulation: a discrete-event, flow-level network model driving the REAL shard planner
(node.worker.planner.ShardPlanner) and the REAL super-seeder (node.coordinator.seeding.SuperSeeder,
with the simulated clock injected), to see how a checkpoint broadcast behaves at N = 16 ... 4,000
nodes on internet links, which the real benchmark (bench/broadcast.py, 16 processes on 2 cores)
cannot reach.

    python bench/swarm_sim.py [--quick]
    python bench/swarm_sim.py --nat 0.6 [--relay] [--budget-s S] [--sizes 16,100,1000,4000]
Writes bench/results/swarm_sim.json and docs/swarm_sim.png (--nat: swarm_sim.json "calibration" and "nat_rows").

The node as calibrated against the WAN lab (`calibration()`, issue #26): per-request costs (the origin's, a peer's
over py-libp2p or the HTTP plane, each a median times a lognormal factor), the step's rebuild, the gossip's
per-hop delay, py-libp2p's CPU per byte, super-seeding that spreads first copies, the fetcher's small-step origin
slots and the HTTP plane's holder hints: each a `Case` parameter whose comment says what measured it.

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

* The current code (2026-11-27; `hold_s`, `direct_first_copies`, `libp2p_request_s`): the origin holds a request
  it defers while a first copy is in flight (at most 1 s) and answers 429 naming the holder; a relayed node holds
  no first copy beside 2 direct askers and is held until a direct node's copy lands; a node fetches over HTTP from
  a reachable holder and over py-libp2p from a NATed one (its kept connections or a circuit). Since 293ce92
  (`manifest_holders`, `spread_hold`): the manifest's answer names the holders of the step's live first copies and
  the node asks them first (a holder whose copy is still arriving holds the request up to 1 s); a node deferred for
  a shard nobody holds is held (at most 2 s) until another node's first copy lands and is told its holder.

Not modelled: TCP dynamics (slow start, loss, RTT-limited windows), CPU contention as such (the costs are
the medians measured on the loaded 2-core box, not derived from a load), libp2p streams that time out (the lab's
scale_rewake run), new connections (~6 round trips in the lab against 2 kept alive) and the lab's warm-up over a run's
first steps, the hop's limits other than bandwidth
(relay_max_reservations = 128 per hop, circuits per peer, a circuit's byte and time caps: every NATed node
is taken to hold a reservation, as with enough `p2p.relay_addrs` hops), the network core (only
the edges are bottlenecks), gossip loss, stale "have" views after a peer leaves, the X-Prime-Have bitfields
of the HTTP plane, nodes that lie, the fetcher's 0.25 s polling (slots wake on news or deadlines,
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
import itertools
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
    parallel: int = 8  # the fetcher's request slots (node/worker/fetcher.py Fetcher(parallel=8); 4 before this model)
    # A step this small (wire bytes) is asked of the origin all at once (the fetcher's `small_step_bytes`,
    # origin_slots = parallel): a delta's few shards cost more in round trips than in origin bytes.
    small_step_bytes: int = 4 << 20
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
    # Before its first shard request a node learns of the step `notify_s` after publication (None: the
    # announcement's gossip hops, each the mean RTT plus `gossip_hop_s`, in a swarm; a number: that delay, e.g.
    # the lab's measured "announced" phase) and spends `step_rtts` round trips to the origin (the listing and
    # manifest in one round trip since the fetcher's pipelining).
    notify_s: float | None = 0.0
    # With a number above: nodes learn of the step at different times, lognormal with median `notify_s` and this
    # 90th percentile (the lab's "announced" phase: median 0.21 s, p90 0.53 s at loopback N = 6 on the HTTP
    # plane). Who asks first decides who gets the first copies and who is deferred. 0: every node at notify_s.
    notify_p90_s: float = 0.0
    # True: each node learns of the step its own one-way delay from the origin plus `notify_s` after publication
    # (the lab's steady state at N = 6, 2026-11-28: the coordinator's announcement took one way + 15-20 ms at every
    # node, 22 ms at a public node 5 ms away, 118 ms at a home 100 ms away; the pooled "announced" phase's long
    # tail came from the steps published while the nodes were still starting).
    notify_one_way: bool = False
    step_rtts: float = 0.0
    # Explicit links instead of the mix (the WAN lab's sites, bench/wan.py): (up B/s, down B/s, one-way s,
    # NATed) per node; the RTT between two nodes is 2 * (one-way a + one-way b), to the origin 2 * one-way.
    sites: tuple = ()
    # ---- the real node's costs beyond the links (calibrated against the WAN lab: `calibration()`) ----
    # Super-seeding spreads a step's first copies over the servable nodes that ask (SuperSeeder.admit, since
    # 9155561): the simulator keys shards (step, index) as the coordinator does. False: plain indices, the
    # seeder before that change (the first node to ask takes every first copy).
    spread_first_copies: bool = True
    # Every node asked the origin for the previous step within the seeder's window, as in a run of consecutive
    # steps (the lab's deltas: a step every few seconds): the seeder spreads this step's first copies over them
    # from the first request on. False: a lone step (the first asker takes every first copy it asks for at once).
    prior_askers: bool = False
    # Fixed seconds per request beyond its round trip (CPU in the serving and the receiving process: request
    # signing and checks, hashing, the transport). Measured per request in the loopback N = 6 run
    # (docs/BENCHMARKS.md "Where a delta's seconds go"): a shard from the origin 0.03 s; from a peer over py-libp2p
    # (Noise and yamux in Python, competing for the GIL and 2 cores) 0.64 s, over the HTTP data plane 0.02 s. In
    # the WAN lab (namespaces, a user-space delay line, a loaded box) the origin's is fitted (`calibration()`).
    # The origin's applies to the listing-and-manifest round trips (`step_rtts`) too.
    origin_request_s: float = 0.0
    peer_request_s: float = 0.0
    # Those costs vary request to request (a process waiting for a core, the GIL): each is the median times a
    # lognormal factor of this sigma (0: fixed). Only the medians were measured ("busy" answers took 1.6 s and 3
    # streams were lost after 3 s against a 0.64 s median), so sigma is fitted (`calibration()`).
    request_sigma: float = 0.0
    # Seconds a node spends on a step after its last shard arrives (rebuild the payload on its base:
    # decompress, xor, write, commit) before it holds it. Fitted (`calibration()`: loopback, one node).
    step_cpu_s: float = 0.0
    # Seconds per gossip hop beyond the link's round trip (py-libp2p pubsub on the node's CPU): the `have`
    # announcements and the step's announcement travel the same gossip. Measured as the "announced" phase
    # (publication to the step's gossip reaching a node, median): 0.03-0.08 s at N = 1 and at N = 6 before
    # the re-wake, 0.2-0.47 s at N = 6 on the shared box after it, 0.59 s in the N = 6 lab.
    gossip_hop_s: float = 0.0
    # The fetcher before 49ae757 lost a step's push when it arrived during the previous sync and waited for the
    # 1 s poll: 24 of 48 syncs at loopback N = 6 (docs/BENCHMARKS.md "Where a delta's seconds go"). That share of
    # nodes starts a step up to `poll_s` later (uniform); 0 for the current fetcher.
    poll_miss_share: float = 0.0
    poll_s: float = 1.0
    # The HTTP data plane (p2p.http = true): the origin's "429 seeded" names the node whose first copy is complete
    # (X-Prime-Holder, node/coordinator/seeding.py) and the deferred node asks it at once, without waiting for its
    # `have` gossip. Off on the libp2p plane (the hint carries only an /http address).
    holder_hints: bool = False
    # py-libp2p's CPU per byte caps what one node moves to and from peers (Noise and yamux in Python): about
    # 20 CPU-s per GB per side for 1-8 MiB shards, i.e. ~50 MB/s on one core (bench/results/transport_cost.json:
    # 39-57 CPU-s per GB, client and server together). 0: no cap (the HTTP plane: 2-5 CPU-s per GB).
    peer_cpu_rate: float = 0.0
    # ---- the HTTP data plane beside py-libp2p (2176ab7: every node fetches over HTTP from a holder with an HTTP
    # address; a NATed holder serves none, only py-libp2p over its kept connections or a circuit) ----
    # A request to a NATed holder costs this (py-libp2p); None: `peer_request_s` for every holder (one plane).
    libp2p_request_s: float | None = None
    libp2p_sigma: float | None = None  # its lognormal spread (None: request_sigma)
    # The code before 2176ab7: a NATed node, named only the holder's libp2p address, fetched every peer shard over
    # py-libp2p (`libp2p_request_s`); reachable nodes fetched over HTTP (`peer_request_s`).
    nat_fetch_libp2p: bool = False
    # Round trips a peer request costs beyond the one every transfer starts after: a bare aiohttp GET of 140 KB in
    # the lab took 2.0 round trips on a kept-alive connection, ~6 on a new one (bench/results/wan_floor.json).
    peer_request_rtts: float = 0.0
    # The origin's hold (SeedingGate, a625229): a node deferred while the shard's first copy is in flight is held
    # (at most `hold_s`) until that copy lands, then told its holder; 0: answered at once (the code before).
    hold_s: float = 0.0
    # SuperSeeder's `relayed` rule (1b6a688): a NATed node with a reservation holds no first copy while
    # MIN_DIRECT_ASKERS directly dialable nodes ask, and is held (hold_s) until a direct node's copy lands.
    direct_first_copies: bool = False
    # Holders named with the manifest (293ce92, SeedingGate.manifest_headers, node/worker/fetcher.py _download): the
    # origin's answer to a node's signed manifest request names the holders of the step's live first copies, and the
    # node asks those holders first, never the origin, for those shards. Named: a copy in flight only at its holder's
    # HTTP address (not NATed: its shard server waits up to ARRIVAL_WAIT_S for a shard that is arriving), a complete
    # one at any address the origin has; never a NATed holder (the dial-back reached none of its addresses). False: the
    # code before (the node asked the origin for every shard and learnt a holder from a 429 a round trip later).
    manifest_holders: bool = False
    # Spreading deferral held (293ce92, SeedingGate.before): a node deferred for a shard nobody holds a claim on (the
    # spreading rule leaving it to a node holding fewer first copies, or the relayed rule) is held at most
    # `start_hold_s` until another node's first copy starts and lands, then told that holder; served if none started.
    # False: the code before (spreading deferrals answered 429 at once with no holder; relayed ones held `hold_s`).
    spread_hold: bool = False
    start_hold_s: float = 2.0  # node/coordinator/seeding.py START_HOLD_S (the planner's own 2 s origin deferral)
    # Record each shard's request times (Sim.trace): the lab's per-shard breakdown to compare with.
    trace: bool = False


class OverBudget(RuntimeError):
    pass


class Flow:
    __slots__ = ("s", "r", "pick", "rem", "rate", "last", "ver", "server", "live", "started", "ev_rate", "hop",
                 "libp2p", "t_req")

    def __init__(self, s, r, pick, size, server, hop=None, libp2p=True, t_req=0.0):
        self.s, self.r, self.pick, self.rem, self.server = s, r, pick, float(size), server
        self.rate, self.last, self.ver, self.live, self.started, self.ev_rate = 0.0, 0.0, 0, True, False, 0.0
        self.hop = hop  # the relay hop this flow goes through (its uplink is shared by every relayed flow)
        self.libp2p = libp2p  # a peer flow over py-libp2p (its CPU cap applies), not the HTTP plane
        self.t_req = t_req  # when the request that brought it was sent


class Node:
    __slots__ = ("id", "cls", "up", "down", "rtt_o", "planner", "held", "idle", "ups", "downs", "reserved",
                 "active", "joined", "done_t", "initial", "holds", "server", "sent", "parked", "waiters", "wake_t",
                 "ow", "natted", "kept", "batch_t", "hints", "got", "arriving")

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
        self.batch_t = -1.0  # when its HaveAnnouncer's open batch goes out
        self.hints: dict = {}  # shard -> the holder the origin named when it deferred this node (holder_hints)
        self.got: set = set()  # shards whose bytes arrived here (before its `have` gossip goes out)
        self.arriving = 0  # requests its shard server holds for a shard still arriving here (Sim.await_arrival)


# event kinds
WAKE, FSTART, FEND, DEFER, HAVE, LEAVE, JOIN, RETRY, BUSY, HOLD, ARRIVE = range(11)
MANIFEST = "manifest"  # a WAKE's mark: the node's listing-and-manifest round trip is done (manifest_holders)
ARRIVAL_WAIT_S = 1.0  # node/p2p/http_shards.py: a holder's shard server waits this long for a shard arriving there
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
        self.seeder = (SuperSeeder(case.super_seed_s, clock=lambda: self.now, reachable=self.servable,
                                   relayed=self.relayed) if self.swarm else None)
        self.held: dict[int, list] = {}  # shard -> requests the origin holds (hold_s): [node, pick, sent, alive]
        self.arrivals: dict[tuple[int, int], list] = {}  # (holder, shard) -> requests waiting for it to land there
        self.trace: list[tuple] = []  # (kind, fetcher NATed, seconds): "origin"/"peer" ok, "defer" (case.trace)
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

    def cost(self, median: float, sigma: float | None = None) -> float:
        """One request's own cost: `median`, times a lognormal factor when `request_sigma` (or `sigma`) is set."""
        sigma = self.c.request_sigma if sigma is None else sigma
        if median <= 0 or not sigma:
            return median
        return median * self.rng.lognormvariate(0.0, sigma)

    def key(self, i: int):
        """The seeder's key of shard i: (step, index) as the coordinator's, so that first copies are spread over the
        nodes that ask (SuperSeeder.admit groups keys by step); a plain index is its own group (no spreading)."""
        return (0, i) if self.c.spread_first_copies else i

    def servable(self, node_id) -> bool | None:
        """The super-seeder's `reachable` callback, as the coordinator's `can_serve`: False for a NATed node
        without a relay reservation (here: without `relay`), None (unknown: servable) otherwise."""
        if isinstance(node_id, int) and 0 <= node_id < len(self.nodes) and self.nodes[node_id].natted:
            return None if self.relaying and self.c.relay_first_copies else False
        return None

    def relayed(self, node_id) -> bool:
        """The super-seeder's `relayed` callback (direct_first_copies): a NATed node with a reservation on the hop."""
        return (self.c.direct_first_copies and self.relaying and isinstance(node_id, int)
                and 0 <= node_id < len(self.nodes) and self.nodes[node_id].natted)

    def peer_cost(self, holder: Node, node: Node) -> tuple[float, bool]:
        """A peer request's own cost (median) and whether it goes over py-libp2p: a NATed holder serves only over
        py-libp2p; before 2176ab7 a NATed fetcher used it for every peer; else the HTTP plane (`peer_request_s`)."""
        c = self.c
        if c.libp2p_request_s is None:
            return c.peer_request_s, True
        if holder.natted or (c.nat_fetch_libp2p and node.natted):
            return c.libp2p_request_s, True
        return c.peer_request_s, False

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
        small = self.total <= self.c.small_step_bytes  # a small step: every shard asked of the origin at once
        node.planner = ShardPlanner(self.num_shards, range(self.num_shards), swarm=self.swarm,
                                    origin_slots=self.c.parallel if small else 1, rng=random.Random(self.rng.random()))
        node.idle = min(self.c.parallel, self.num_shards)
        c = self.c
        notify = c.notify_s
        if notify is None:  # the step's announcement reaches it after the gossip's hops
            notify = self.gossip_hops * (self.mean_rtt + c.gossip_hop_s) if self.swarm else 0.0
        elif c.notify_one_way:
            notify += node.rtt_o / 2
        elif c.notify_p90_s > notify > 0:  # lognormal through the measured median and 90th percentile
            notify = self.rng.lognormvariate(math.log(notify), math.log(c.notify_p90_s / notify) / 1.2816)
        start = notify + c.step_rtts * (node.rtt_o + self.cost(c.origin_request_s))  # the listing, the manifest
        if c.poll_miss_share and self.rng.random() < c.poll_miss_share:  # the push lost: the next poll tick
            start += self.rng.uniform(0, c.poll_s)
        if start > 0 and node.initial:
            node.wake_t = self.now + start
            self.push(node.wake_t, WAKE, node, MANIFEST)
            return
        self.manifest_named(node)
        self.wake(node)

    def manifest_named(self, node: Node) -> None:
        """The manifest's answer names the step's live first copies' holders (SeedingGate.manifest_headers, with
        `manifest_holders`): the node records each as its hint for that shard (the fetcher's `src.hint`)."""
        if not self.c.manifest_holders or self.seeder is None or not self.c.spread_first_copies:
            return  # (plain index keys: the real gate names only (step, index) keys)
        for key, hid, complete in self.seeder.claims(0):
            h = self.nodes[int(hid)]  # (the seeder's node ids are this simulator's node indices)
            if h is node or not h.active or not isinstance(key, tuple):
                continue
            # the gate names only addresses the join's dial-back reached: never a NATed holder (it is learnt from
            # its gossip), a public one in flight at its HTTP shard server, complete at either address
            if h.natted:
                continue
            node.hints[key[1]] = hid

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
        pcpu = self.c.peer_cpu_rate
        for f in (node.ups if up else node.downs):
            rate = min(f.s.up / len(f.s.ups), f.r.down / len(f.r.downs))
            if pcpu and not f.server and f.libp2p:  # py-libp2p's CPU at both ends (shared by all of a node's flows: approximate)
                rate = min(rate, pcpu / len(f.s.ups), pcpu / len(f.r.downs))
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
            view = self.holders
            if node.hints:  # a named holder counts for this node alone
                view = {**self.holders, **{i: 1 for i in node.hints if not self.holders.get(i)}}
            pick = p.take(self.now, view)
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
        hint = node.hints.get(i)
        if hint is not None and not self.nodes[hint].active:
            hint = None
        if self.swarm and (self.holders.get(i, 0) > 0 or hint is not None):  # PeerSource: up to 4 random holders,
            lst = self.holder_list[i]  # busy ones cost an RTT
            if self.relaying:  # every holder: those reachable directly first, then relayed (P2PNode.peers_with)
                cand = self.rng.sample(lst, min(16, len(lst)))
                direct = [h for h in cand if self.usable(self.nodes[h], node)]
                tries = (direct + [h for h in cand if h not in direct])[:4] if len(direct) < 4 else direct[:4]
            elif self.nat:  # NATed holders only for those they keep connections to (PeerSource ranks reachable first)
                cand = self.rng.sample(lst, min(16, len(lst)))
                tries = [h for h in cand if self.usable(self.nodes[h], node)][:4]
            else:
                tries = self.rng.sample(lst, min(4, len(lst)))
            if hint is not None and hint not in tries:  # the holder the origin named is asked first
                tries = [hint, *tries[:3]]
            if tries:  # (none usable: the origin, as when nobody holds it)
                delay = 0.0
                for hid in tries:
                    h = self.nodes[hid]
                    rtt = self.rtt(node, h)
                    relayed = self.relaying and h.natted and not self.usable(h, node)
                    if relayed:  # a circuit through the hop: CONNECT first (one more round trip)
                        rtt *= 2
                    median, libp2p = self.peer_cost(h, node)
                    sigma = self.c.libp2p_sigma if libp2p and self.c.libp2p_request_s is not None else None
                    rtt += self.cost(median, sigma) + self.c.peer_request_rtts * self.rtt(node, h)  # its own cost
                    # A holder named with the manifest whose copy is still arriving: its shard server holds the
                    # request until the shard lands, at most max_concurrent (upload_slots) such requests at once;
                    # beyond, "not here" at once (404), and the fetcher tries the next holder, as after a "busy".
                    if self.takes_request(h, i):
                        if i not in h.got:
                            self.await_arrival(h, node, pick, self.now + delay, rtt, libp2p)
                        else:
                            self.transfer(h, node, pick, delay + rtt, server=False, hop=self.hop if relayed else None,
                                          libp2p=libp2p, t_req=self.now + delay)
                        return
                    delay += rtt
                self.push(self.now + delay, BUSY, node, (pick, streak + 1, tries))  # every holder tried was busy
                return
        server = node.server
        if server is self.relay and self.relay is not None:
            self.transfer(server, node, pick, node.rtt_o, server=True)
            return
        if self.seeder is not None and not self.seeder.admit(self.key(i), node.id):  # 429 seeded
            key = self.key(i)
            if self.c.hold_s > 0 or self.c.spread_hold:  # SeedingGate.before: held while a first copy is in flight
                if self.c.spread_hold:  # (293ce92) or nobody holds a claim on it (spreading or relayed rule)
                    for_start = self.seeder.in_flight(key) is None and self.seeder.holder(key) is None
                else:  # (the code before) or, relayed, until a direct node's copy starts and lands
                    for_start = self.seeder.leaves_to_direct(node.id)
                limit = self.c.start_hold_s if for_start and self.c.spread_hold else self.c.hold_s
                if limit > 0 and self.held_waits(key, for_start):
                    held: list = [node, pick, self.now, True, for_start]
                    self.held.setdefault(i, []).append(held)
                    self.push(self.now + limit, HOLD, held)
                    return
            self.push(self.now + node.rtt_o + self.cost(self.c.origin_request_s), DEFER, node, (pick, self.now))
            return
        self.serve_origin(node, pick, node.rtt_o + self.cost(self.c.origin_request_s))

    def serve_origin(self, node: Node, pick: Pick, delay: float) -> None:
        i = pick.index
        if self.seeder is not None:
            self.seeder.started(self.key(i), node.id)
        self.origin_sends += 1
        self.origin_sends_held += self.holders.get(i, 0) > 0
        self.transfer(self.origin, node, pick, delay, server=True, t_req=self.now)

    def takes_request(self, h: Node, i: int) -> bool:
        """Whether holder `h` would take a request for shard i now: a free upload slot and the shard there, or (named
        with the manifest, still arriving) room among the requests waiting for it."""
        slots = self.c.upload_slots
        return h.reserved < slots and (i in h.got or h.arriving < slots)

    def await_arrival(self, h: Node, node: Node, pick: Pick, t_ask: float, rtt: float, libp2p: bool) -> None:
        """`node` asks `h`, named with the manifest while the origin's first copy to it is in flight, for a shard that
        has not arrived there: h's shard server holds the request (at most ARRIVAL_WAIT_S, node/p2p/http_shards.py)
        and sends the shard once it lands (`flow_end`); else "not here" (404) and the node defers the shard."""
        w: list = [node, pick, t_ask, t_ask + rtt, libp2p, True, h.id]
        self.arrivals.setdefault((h.id, pick.index), []).append(w)
        h.arriving += 1
        self.push(t_ask + rtt / 2 + ARRIVAL_WAIT_S, ARRIVE, w)

    def arrived(self, h: Node, i: int) -> None:
        """Shard i landed at `h`: the requests its shard server held for it get it."""
        for w in self.arrivals.pop((h.id, i), ()):
            node, pick, t_ask, t_ready, libp2p, alive, _ = w
            if not alive:
                continue
            w[5] = False
            h.arriving -= 1
            start = max(t_ready, self.now + self.rtt(node, h) / 2)  # the body follows the request, or its arrival
            self.transfer(h, node, pick, start - self.now, server=False, libp2p=libp2p, t_req=t_ask)

    def arrival_timeout(self, w: list) -> None:
        node, pick, t_ask, _, _, alive, hid = w
        if not alive:
            return
        w[5] = False
        self.arrivals[(hid, pick.index)].remove(w)
        self.nodes[hid].arriving -= 1
        node.hints.pop(pick.index, None)
        if node.active:
            self.push(self.now + self.rtt(node, self.nodes[hid]) / 2, DEFER, node, (pick, t_ask))

    def held_waits(self, key, for_start: bool) -> bool:
        """SeedingGate._waiting: a held request waits while a first copy is in flight, or, `for_start` (a relayed
        node left to a direct one), while nobody holds one."""
        assert self.seeder is not None
        return self.seeder.in_flight(key) is not None or (for_start and self.seeder.holder(key) is None)

    def unhold(self, i: int, timeout=None) -> None:
        """The origin looks again at the requests it holds for shard i (a copy of it ended, or `timeout`'s hold
        ran out): those no longer waiting (SeedingGate._waiting) are answered: 429 naming the holder, or, with no
        first copy out meanwhile, the shard (SeedingGate.before)."""
        key, seeder = self.key(i), self.seeder
        assert seeder is not None  # holds happen only in a swarm
        for h in ([timeout] if timeout is not None else list(self.held.get(i, ()))):
            node, pick, sent, alive, for_start = h
            if not alive:
                continue
            if timeout is None and self.held_waits(key, for_start):
                continue
            h[3] = False
            lst = self.held.get(i)
            if lst is not None:
                lst.remove(h)
                if not lst:
                    del self.held[i]
            if not node.active:
                continue
            back = node.rtt_o / 2 + self.cost(self.c.origin_request_s)  # the answer goes back
            if seeder.holder(key) is None and seeder.in_flight(key) is None:
                self.serve_origin(node, pick, back)
                continue
            self.push(self.now + back, DEFER, node, (pick, sent))

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
        if any(self.takes_request(self.nodes[hid], pick.index) for hid in tries):  # one freed a slot meanwhile
            node.idle += 1  # (the answer came a while ago: a sleeper would wait for a release already past)
            self.wake(node)
            return
        if node.idle:  # the shard is back among the remaining ones: the node's idle slots may take it
            self.wake(node)
        sl = Sleeper(node, pick.index)
        node.parked += 1
        for hid in tries:
            self.nodes[hid].waiters.append(sl)
        self.shard_waiters.setdefault(pick.index, deque()).append(sl)

    def transfer(self, s: Node, r: Node, pick: Pick, delay: float, server: bool, hop: Node | None = None,
                 libp2p: bool = True, t_req: float = 0.0) -> None:
        f = Flow(s, r, pick, self.shard_size, server, hop, libp2p, t_req)
        s.reserved += 1
        self.push(self.now + delay, FSTART, f)

    def flow_end(self, f: Flow) -> None:
        self.flow_stop(f)
        node, pick = f.r, f.pick
        if self.c.trace:
            self.trace.append(("origin" if f.s is self.origin else "peer", node.natted, self.now - f.t_req))
        if f.s is self.origin:
            self.origin_bytes += self.shard_size
            if self.seeder is not None:
                self.seeder.finished(self.key(pick.index), node.id)
                if pick.index in self.held:
                    self.unhold(pick.index)
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
        node.got.add(pick.index)
        if self.arrivals:
            self.arrived(node, pick.index)
        node.planner.done(pick)
        node.held += 1
        if self.swarm:  # HaveAnnouncer: the first shard after a quiet spell opens a batch, announced when it ends
            if node.batch_t < self.now:
                node.batch_t = self.now + self.gossip_batch
            delay = node.batch_t - self.now + self.gossip_hops * (self.mean_rtt + self.c.gossip_hop_s)
            self.push(self.now + delay, HAVE, node, pick.index)
        if node.held == self.num_shards:
            node.done_t = self.now + self.c.step_cpu_s  # the payload rebuilt and committed
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
        self.seeder.announced(node.id, [self.key(i)])
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
                self.seeder.failed(self.key(f.pick.index), node.id)
                if f.pick.index in self.held:
                    self.unhold(f.pick.index)
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
            if self.seeder is not None and c.prior_askers and c.spread_first_copies:
                for n in self.nodes:  # each asked for a shard of the step before (served: nobody claims it now)
                    self.seeder.admit((-1, 0), n.id)
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
                        self.seeder.failed(self.key(a.pick.index), a.r.id)
                        if a.pick.index in self.held:
                            self.unhold(a.pick.index)
                    if a.r.active:
                        self.fail(a)
            elif kind == WAKE:
                if t == a.wake_t:
                    a.wake_t = -1.0
                if a.active and a.planner is not None:
                    if b == MANIFEST:
                        self.manifest_named(a)
                    self.wake(a)
            elif kind == ARRIVE:
                self.arrival_timeout(a)
            elif kind == HAVE:
                self.have(a, b)
            elif kind == BUSY:
                if a.active:
                    self.busy(a, *b)
            elif kind == HOLD:
                self.unhold(a[1].index, timeout=a)
            elif kind == DEFER:
                if a.active:
                    b, sent = b
                    if c.trace:
                        self.trace.append(("defer", a.natted, self.now - sent))
                    if c.holder_hints:  # the 429 names the node whose first copy is complete
                        hid = self.seeder.holder(self.key(b.index))
                        if hid is not None and hid != a.id and self.usable(self.nodes[hid], a):
                            a.hints[b.index] = hid
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
    (nodes uncapped: 100 MB/s, RTT 1 ms), HaveAnnouncer interval 0.05 s, 10 s super-seeding. That run (2026-11-25,
    before 3082c95 and 9155561) had the fetcher of then: 4 slots, one origin slot whatever the step's size, and the
    seeder before it spread first copies; "swarm-http" (p2p.http) is simulated as "swarm" with the HTTP plane's
    holder hints; "shardcast" is not modelled."""
    measured = json.loads((REPO / "bench/results/broadcast.json").read_text())
    rows = []
    for m in measured.get("rows", measured.get("results", [])):
        if m["mode"] not in ("origin", "relay", "swarm", "swarm-http"):
            continue
        case = Case(nodes=m["nodes"], checkpoint_bytes=measured["compressed_bytes"],
                    mode="swarm" if m["mode"] == "swarm-http" else m["mode"], holder_hints=m["mode"] == "swarm-http",
                    origin_cap=measured["origin_upload_limit"], shard_bytes=131072, links="loopback",
                    rtt_range=(0.001, 0.001), have_interval=0.05, parallel=4, small_step_bytes=0,
                    spread_first_copies=False)
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


# ---- calibration against the WAN lab (issue #26) -------------------------------------------------------
# The real node's costs as measured (docs/BENCHMARKS.md "Where a delta's seconds go"): per shard request from the
# origin, from a peer over py-libp2p, from a peer over the HTTP data plane.
ORIGIN_REQUEST_S = 0.03
LIBP2P_REQUEST_S = 0.64
HTTP_REQUEST_S = 0.02
GRID = [round(0.0025 * k, 4) for k in range(0, 81)]  # candidates of a fitted cost, 0 ... 0.2 s
LAB = "lab"  # a point's origin_request_s: the value fitted on the lab's single-home runs


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _delta_size(per_step) -> int:
    return _median([x["bytes"] for x in per_step if x["encoding"] != "full"])


def calibration_points() -> list[dict]:
    """Every lab measurement the simulator can be held to: a time from publication (or from the listing
    request) until one node or all nodes hold a delta step, with the configuration it was measured in.
    "fit": the points a cost is fitted on (`fits`: which); "held-out": nothing is fitted to them. Each point's
    other inputs are measured, in that run where it recorded them (the "announced" phase: notify_s, gossip_hop_s),
    and the per-request costs as measured (ORIGIN_REQUEST_S, LIBP2P_REQUEST_S, HTTP_REQUEST_S)."""
    doc = json.loads((REPO / "bench/results/wan.json").read_text())
    loop = json.loads((REPO / "bench/results/wan_loopback.json").read_text())
    scale = doc["scale"]["rows"][0]
    lab_delta = _delta_size(scale["per_step"])  # the demo model's delta: 0.54 MB in 3 shards of 256 KiB raw
    pts = []
    # 1. The lab: one home per round trip, everything from the origin (datacenter, no upload limit), the time of
    #    a one-delta fetch from the listing request to the last shard byte (bench/wan.py: no rebuild, so
    #    step_cpu_s = 0): notify 0, one round trip for the listing with the manifest, then the shards. Runs after
    #    the fetcher's pipelining (2 request waves per delta). The lab's per-request cost is fitted on "no_p2p".
    for key, run, role, note in (("no_p2p", "after", "fit", "p2p off, quiet box"),
                                 ("p2p_with_dialback", "after", "held-out", "p2p on, homes NATed: all from the origin"),
                                 ("fair_share", "after", "held-out", "p2p off, box at load 14-24")):
        for name, m in doc[key]["runs"][run]["nodes"].items():
            if m.get("delta_s_per_step") is None:
                continue
            site = (20 * MBIT, 100 * MBIT, m["one_way_ms"] / 1e3, False)
            pts.append({"name": f"wan.json {key}/{run}, one home at {m['rtt_ms']} ms RTT", "role": role,
                        "fits": "origin_request_s" if role == "fit" else None, "note": note,
                        "metric": "s per delta step, listing to last byte (one node)",
                        "measured": m["delta_s_per_step"],
                        "case": dict(nodes=1, checkpoint_bytes=lab_delta, shard_bytes=262144, delta_fraction=1.0,
                                     mode="origin", origin_cap=1000 * MBIT, sites=(site,), step_rtts=1.0,
                                     notify_s=0.0, origin_request_s=LAB, step_cpu_s=0.0)})
    # 2. Loopback (bench/wan.py --loopback): the real CLI on 127.0.0.1, no origin limit; publication to held.
    #    step_cpu_s is fitted on the two N = 1 runs of the code before the re-wake (same sitting).
    for key, plane, note in (("libp2p_plane", LIBP2P_REQUEST_S, "libp2p data plane, fetcher before the re-wake"),
                             ("http_plane", HTTP_REQUEST_S, "p2p.http = true (N = 1 before the re-wake, N = 6 with it)"),
                             ("libp2p_plane_rewake", LIBP2P_REQUEST_S, "libp2p data plane, with the re-wake"),
                             ("http_plane_rewake", HTTP_REQUEST_S, "p2p.http = true, with the re-wake")):
        for row in loop[key]["rows"]:
            n = row["n"]
            announced = row["phases_s"]["announced"]["median"]
            announced_p90 = row["phases_s"]["announced"]["p90"]
            before = "before" in row["code"]
            case = dict(nodes=n, checkpoint_bytes=_delta_size(row["per_step"]), shard_bytes=262144,
                        delta_fraction=1.0, links="loopback", loopback_rate=100e6, origin_cap=100e6,
                        rtt_range=(0.0002, 0.0002), step_rtts=1.0, notify_s=announced, notify_p90_s=announced_p90,
                        gossip_hop_s=announced, origin_request_s=ORIGIN_REQUEST_S, peer_request_s=plane,
                        holder_hints=plane == HTTP_REQUEST_S, poll_miss_share=0.5 if before and n > 1 else 0.0,
                        prior_askers=True)
            tag = f"wan_loopback.json {key}, N = {n}"
            if n == 1:
                fit = before
                pts.append({"name": tag, "role": "fit" if fit else "held-out", "fits": "step_cpu_s" if fit else None,
                            "note": note, "metric": "s publication to held (median step)",
                            "measured": row["phases_s"]["held"]["median"], "case": case})
                continue
            fit = "rewake" in key  # the current fetcher on both planes: request_sigma is fitted on their t_all
            pts.append({"name": tag, "role": "fit" if fit else "held-out", "fits": "request_sigma" if fit else None,
                        "note": note, "metric": "s to all nodes (median step)",
                        "measured": row["delta_t_all_s"]["median"],
                        "measured_median_node": row["phases_s"]["held"]["median"], "case": case})
    # 3. The lab at N = 6 (bench/wan.py --scale): the mix, homes NATed, origin capped at 20 Mbit/s,
    #    libp2p plane. "scale": before the re-wake (load up to 36, "announced" not recorded: the loopback run of
    #    the same code's 0.076 / 0.13 s stands in); "scale_rewake": after it (load 9-11, announced measured).
    for key, note in (("scale", "fetcher before the re-wake, load up to 36"),
                      ("scale_rewake", "with the re-wake, load 9-11; steps 5-8 never reached 2-5 nodes")):
        row = doc[key]["rows"][0]
        done = [x for x in row["per_step"] if x["encoding"] != "full" and x["t_all_s"] is not None]
        announced = row.get("phases_s", {}).get("announced", {}).get("median", 0.076)
        announced_p90 = row.get("phases_s", {}).get("announced", {}).get("p90", 0.13)
        pts.append({"name": f"wan.json {key}, N = {row['n']} lab", "role": "held-out", "fits": None, "note": note,
                    "metric": "s to all nodes (median step)", "measured": _median([x["t_all_s"] for x in done]),
                    "measured_median_node": _median([x["t_median_s"] for x in done]),
                    "case": dict(nodes=row["n"], checkpoint_bytes=_delta_size(row["per_step"]),
                                 shard_bytes=262144, delta_fraction=1.0, origin_cap=row["origin_mbit"] * MBIT,
                                 sites=lab_sites(row["n"]), step_rtts=1.0, notify_s=announced,
                                 notify_p90_s=announced_p90, gossip_hop_s=announced, origin_request_s=LAB,
                                 peer_request_s=LIBP2P_REQUEST_S, poll_miss_share=0.0 if "rewake" in key else 0.5,
                                 prior_askers=True)})
    pts += holder_points(doc)
    return pts


# The lab's HTTP data plane, current code (2176ab7; wan.json holder_both_a/b/c, N = 6, load 7-10). Set from the runs'
# per-shard breakdown, not from any run's time to all nodes (those stay held out): `lab_http_costs()` simulates the
# three runs (9 seeds each) over a grid and keeps the values whose per-shard figures, pooled, come closest to the
# measured ones, averaged over the runs (least squares of the log ratio of 4 figures; 2026-11-27, 27 combinations at peer_request_rtts 0.8):
#   a shard from the origin ("coordinator": every first copy, to the two public nodes; the origin's 20 Mbit/s is
#   shared by a step's five first copies): measured median 0.164 s, mean 0.192 s; simulated 0.167 / 0.189 s
#   a peer shard fetched by a NATed home ("to home", 97 % from a public node over HTTP): measured median 0.268 s,
#   mean 0.358 s (2.3-2.5 of the home's round trips); simulated 0.295 / 0.326 s
LAB_HTTP = {
    "origin_request_s": 0.05,  # fitted (grid 0.03-0.05); the single-home fit of the quiet box was 0.0725
    "peer_request_s": 0.02,  # fitted (grid 0-0.04), the same as measured per request on loopback (HTTP_REQUEST_S)
    "request_sigma": 1.2,  # fitted (grid 1.0-1.4): the origin shards' mean over median
}
# Round trips an HTTP peer request costs beyond the one the simulator charges every transfer: a bare aiohttp GET of
# 140 KB on a kept-alive connection in the lab took 2.0 round trips at 50 ms and 1.57 at 210 ms
# (bench/results/wan_floor.json): measured, ~0.8 more. ~6 on a new connection (not modelled: connections are kept).
LAB_HTTP_RTTS = 0.8
# The spread of a py-libp2p request in the same sitting (the code before 2176ab7, wan.json holder_one_a/b/c: NATed
# homes fetched every peer shard over py-libp2p): "to home" ok, measured median 0.78-1.03 s, mean 0.89-1.15 s;
# with the loopback's 0.64 s median (LIBP2P_REQUEST_S) σ 0.6 comes closest of 0.3 / 0.45 / 0.6 / 0.8 (simulated
# 0.95 / 1.04 s against the runs' average 0.89 / 1.03 s). Fitted on those per-shard figures only.
LAB_LIBP2P_SIGMA = 0.6
# The step's announcement per gossip hop in the lab, current code: the "announced" phase's median, 0.148-0.155 s in
# holder_both_a/b/c (one hop at N = 6, its round trip included; taken as the hop's own cost, a slight overestimate)
LAB_GOSSIP_HOP_S = 0.15
HOLD_S = 1.0  # node/coordinator/seeding.py HOLD_S
START_HOLD_S = 2.0  # node/coordinator/seeding.py START_HOLD_S (293ce92)
LAB_SHARDS = 5  # a lab step's shards (270 shards in 54 node-steps: the demo model's 1.25 MiB raw in 256 KiB shards)


def holder_points(doc: dict) -> list[dict]:
    """The N = 6 lab runs of 2026-11-27 (the current code, HTTP for every peer fetch a node can make; and the code
    before 2176ab7, where NATed homes fetched over py-libp2p), and the N = 12 run of the current code if present."""
    pts = []
    # (key, note, the code before 2176ab7, 293ce92's manifest_holders and spread_hold on)
    runs = [(k, "current code (HTTP plane for NATed fetchers too)", False, False) for k in
            ("holder_both_a", "holder_both_b", "holder_both_c", "scale_holder_both") if k in doc]
    runs += [(k, "code before 2176ab7 (NATed homes fetch over py-libp2p)", True, False) for k in
             ("holder_one_a", "holder_one_b", "holder_one_c") if k in doc]
    # 293ce92's lab A/B (same sitting): the code before it, and with it (holders named with the manifest, spreading
    # deferrals held): held out, nothing refitted to them
    runs += [(k, "code before 293ce92 (A/B sitting)", False, False) for k in
             ("mh_before_a", "mh_before_b", "mh_before_c") if k in doc]
    runs += [(k, "293ce92: holders named with the manifest, spreading deferral held", False, True) for k in
             ("mh_after_a", "mh_after_b", "mh_after_c") if k in doc]
    # The quiet box of 2026-11-28 (`bench/wan.py --scale`, 30 steps, the lab's start-up left out of the medians),
    # N = 6 / 12 / 24, and the IDONTWANT A/B at N = 24: the current code, held out, nothing refitted to them
    runs += [(k, "current code, quiet box 2026-11-28, 30 steps", False, True) for k in QUIET_1128 if k in doc]

    def pooled(keys):  # the "announced" phase's median and p90, the median over runs of one configuration
        phs = [doc[k]["rows"][0]["phases_s"]["announced"] for k in keys]
        return {q: _median([x[q] for x in phs]) for q in ("median", "p90")}

    for key, note, before, mh in runs:
        row = doc[key]["rows"][0]
        # Who learns of a step when: pooled over the three runs of the same configuration at N = 6 (each run's p90
        # is the 5th-6th latest of its 54 announcements, and the warm-up steps 1-3, not the median step, hold most
        # of them: holder_both_b's 1.03 s against 0.53 and 0.59); the N = 12 run's own
        triple = key[-2:] in ("_a", "_b", "_c")
        same = [k for k, _, _, _ in runs if triple and k[:-2] == key[:-2]] or [key]
        ph = {"announced": pooled(same)}
        quiet = key in QUIET_1128
        if quiet:
            # These runs' "announced" phase pools every step, the ones published while nodes were still starting
            # too (p90 0.28 / 1.6 / 3.4 s at N = 6 / 12 / 24). In steady state a node heard of a step one way plus
            # 15-20 ms after its publication (NOTIFY_EXCESS_S, measured at N = 6; assumed at N = 12 and 24).
            ph = {"announced": {"median": NOTIFY_EXCESS_S, "p90": 0.0}}
        commit = row.get("shard_breakdown", {}).get("step_parts", {}).get("commit", {}).get("median", 0.0)
        load = row.get("load_avg_max")
        for kind in ("delta", "full"):
            steps = [x for x in row["per_step"] if (x["encoding"] == "full") == (kind == "full")]
            done = [x for x in steps if x["t_all_s"] is not None]
            if not done or row.get(kind, {}).get("t_all_s") is None:
                continue
            size = _median([x["bytes"] for x in steps])
            pts.append({
                "name": f"wan.json {key}, N = {row['n']} lab, {kind}", "role": "held-out", "fits": None,
                "note": f"{note}; load {load}",
                # "http": the runs LAB_HTTP was set from (lab_http_costs); the A/B sitting's runs are held out of it
                "plane": "libp2p_homes" if before else "http" if key.startswith(("holder_", "scale_holder"))
                else "http_mh" if mh else "http_ab",
                "metric": "s to all nodes (median step)" if kind == "delta" else "s to all nodes (the full step)",
                # the run's own figures (bench/wan.py: the median over its delta steps, its full step)
                "measured": row[kind]["t_all_s"],
                "measured_median_node": row[kind].get("t_median_s") or _median([x["t_median_s"] for x in done]),
                "breakdown": row.get("shard_breakdown", {}).get("by_source") if kind == "delta" else None,
                "case": dict(nodes=row["n"], checkpoint_bytes=size, shard_bytes=math.ceil(size / LAB_SHARDS),
                             delta_fraction=1.0, origin_cap=row["origin_mbit"] * MBIT, sites=lab_sites(row["n"]),
                             step_rtts=1.0, notify_s=ph["announced"]["median"], notify_p90_s=ph["announced"]["p90"],
                             gossip_hop_s=ph["announced"]["median"], step_cpu_s=commit, prior_askers=True,
                             holder_hints=True, hold_s=HOLD_S, direct_first_copies=True, relay=True,
                             peer_request_rtts=LAB_HTTP_RTTS, libp2p_request_s=LIBP2P_REQUEST_S,
                             libp2p_sigma=LAB_LIBP2P_SIGMA, nat_fetch_libp2p=before, trace=True,
                             manifest_holders=mh, spread_hold=mh, notify_one_way=quiet, **LAB_HTTP)})
    return pts


# A node's notification beyond its one-way delay from the origin, in steady state: the median over the 6 nodes of
# (step announced - published - one way) over the counted delta steps of a quiet-box N = 6 run (wan.json q6_1128)
NOTIFY_EXCESS_S = 0.018
QUIET_1128 = ("scale_quiet_1128_n6c", "q6_1128", "scale_quiet_1128_n12", "scale_quiet_1128_n24", "idw_base_n24",
              "idw_new_n24",
              # later that day, NATed nodes keeping quiet where their `have` could not be used (cba1b23)
              "quiet2_n6", "quiet2_n12", "quiet2_n24", "ab_new_n24")


def quiet_check() -> None:
    """The quiet-box lab runs of 2026-11-28 (QUIET_1128) against the model, two ways: with the costs as last
    calibrated (swarm_sim.json's "fitted" and LAB_HTTP, set on 2026-11-27's runs), and with each run's own
    per-request costs (`own_costs`: fitted on that run's per-shard figures, never on a time to all nodes).
    swarm_sim.json "quiet_check_1128"."""
    path = REPO / "bench/results/swarm_sim.json"
    doc = json.loads(path.read_text())
    fitted = doc["calibration"]["fitted"]
    keys = [f"wan.json {k}," for k in QUIET_1128]
    pts = [p for p in calibration_points() if p["name"].startswith(tuple(keys))]
    out: dict = {"fitted": fitted, "notify_excess_s": NOTIFY_EXCESS_S}
    deltas = {p["name"].rsplit(",", 1)[0]: p for p in pts if p["name"].endswith(", delta")}  # per-shard figures
    own = {run: own_costs(p) for run, p in deltas.items()}
    for label, costs in (("as_calibrated", {run: {} for run in deltas}), ("own_costs", own)):
        rows = []
        for p in pts:
            kw = costs[p["name"].rsplit(",", 1)[0]]
            rows.append({**run_point({**p, "case": {**p["case"], **kw}}, fitted), "costs": kw})
            print(f"{label:13s}", calibration_line(rows[-1]), kw, flush=True)
        out[label] = {"rows": rows, "within_20pct": f"{sum(r['within_20pct'] for r in rows)} of {len(rows)}"}
    doc["quiet_check_1128"] = out
    path.write_text(json.dumps(doc, indent=2) + "\n")


def own_costs(pt: dict) -> dict:
    """A run's own per-request costs: the origin's and an HTTP peer's (`origin_request_s`, `peer_request_s`) and their
    spread (`request_sigma`) over a grid, the ones whose simulated per-shard figures (the origin's shards and the
    homes' peer shards, median and mean, 9 seeds) come closest to the run's measured ones (least squares of the log
    ratios); the rest as calibrated. Costs grow with the box's load (the lab's N = 24 runs at load 35: an origin shard 0.26-0.29 s at
    the median against 0.09 s at N = 6), which the model does not otherwise know."""
    meas = shard_compare([], pt["breakdown"])["measured"]
    best, best_loss = {}, math.inf
    grid = itertools.product([round(0.02 * k, 2) for k in range(16)], [round(0.04 * k, 2) for k in range(11)],
                             (0.4, 0.6, 0.8, 1.0, 1.2))
    for o, q, sigma in grid:
        kw = {"origin_request_s": o, "peer_request_s": q, "request_sigma": sigma}
        trace: list = []
        for seed in range(9):
            sm = Sim(point_case({**pt, "case": {**pt["case"], **kw}}, {"step_cpu_s": 0.0, "request_sigma": 0.0,
                                                                        "origin_request_s": 0.0}, seed))
            sm.run()
            trace += sm.trace
        sim = shard_compare(trace, None)["sim"]
        loss = sum(math.log(sim[k][m] / meas[k][m]) ** 2 for k in ("origin_ok", "home_peer_ok")
                   for m in ("median", "mean"))
        if loss < best_loss:
            best, best_loss = kw, loss
    return best


def point_case(pt: dict, fitted: dict, seed: int) -> Case:
    kw = {"step_cpu_s": fitted["step_cpu_s"], "request_sigma": fitted["request_sigma"], **pt["case"], "seed": seed}
    if kw["origin_request_s"] == LAB:
        kw["origin_request_s"] = fitted["origin_request_s"]
    return Case(**kw)


def run_point(pt: dict, fitted: dict, seeds=tuple(range(9))) -> dict:
    """The simulated figure of a calibration point (the median over `seeds`: who learns of a step first is drawn)."""
    sims, meds, trace = [], [], []
    for seed in seeds:
        sm = Sim(point_case(pt, fitted, seed))
        r = sm.run()
        trace += sm.trace
        sims.append(r["seconds"] if pt["case"]["nodes"] > 1 else r["median_node_seconds"])
        meds.append(r["median_node_seconds"])
    sim, med = _median(sims), _median(meds)
    row = {k: v for k, v in pt.items() if k not in ("case", "breakdown")}
    if trace:
        row["shards"] = shard_compare(trace, pt.get("breakdown"))
    row.update({"sim": round(sim, 3), "sim_vs_measured": round(sim / pt["measured"] - 1, 3),
                "within_20pct": abs(sim / pt["measured"] - 1) <= 0.2,
                "inputs": {k: v for k, v in asdict(point_case(pt, fitted, 0)).items()
                           if k not in ("sites", "seed") and v != getattr(Case, k, None)}})
    if pt.get("measured_median_node"):
        row.update({"sim_median_node": round(med, 3),
                    "median_node_sim_vs_measured": round(med / pt["measured_median_node"] - 1, 3),
                    "median_node_within_20pct": abs(med / pt["measured_median_node"] - 1) <= 0.2})
    return row


def shard_compare(trace: list, breakdown: dict | None) -> dict:
    """The simulated per-shard figures next to the lab's breakdown (bench/wan.py shard_breakdown): a shard from the
    origin (the lab's "coordinator": first copies, to public nodes), a peer shard fetched by a NATed home ("to home"),
    and the seconds a home's shard spent deferred (the origin's 429s, held), per shard."""
    def stats(xs):
        return {"median": round(_median(xs), 3), "mean": round(sum(xs) / len(xs), 3)} if xs else None

    home_shards = sum(1 for k, nat, _ in trace if nat and k != "defer")
    sim = {"origin_ok": stats([x for k, _, x in trace if k == "origin"]),
           "home_peer_ok": stats([x for k, nat, x in trace if k == "peer" and nat]),
           "home_deferred_per_shard": round(sum(x for k, nat, x in trace if k == "defer" and nat)
                                            / max(1, home_shards), 3)}
    out = {"sim": sim}
    if breakdown:
        home = breakdown.get("to home", {})
        out["measured"] = {"origin_ok": {k: breakdown["coordinator"]["ok"][k] for k in ("median", "mean")},
                           "home_peer_ok": {k: home["ok"][k] for k in ("median", "mean")},
                           "home_deferred_per_shard": home["deferred"]["mean"]}
    return out


def lab_http_costs(grid: dict | None = None) -> list[dict]:
    """How LAB_HTTP was set: the simulated per-shard figures of the three current-code N = 6 runs, pooled, for each
    combination in `grid`, against the measured ones (their means over the runs). Prints a line per combination."""
    pts = [p for p in calibration_points() if p.get("plane") == "http" and p.get("breakdown")
           and p["case"]["nodes"] == 6]
    grid = grid or {"origin_request_s": [0.04, 0.06, 0.08], "peer_request_s": [0.0, 0.02, 0.05],
                    "request_sigma": [0.5, 0.8, 1.1]}
    keys = list(grid)
    out = []
    for vals in itertools.product(*(grid[k] for k in keys)):
        kw = dict(zip(keys, vals))
        trace, meas = [], []
        for p in pts:
            q = {**p, "case": {**p["case"], **kw}}
            for seed in range(9):
                sm = Sim(point_case(q, {"step_cpu_s": 0.0, "request_sigma": 0.0, "origin_request_s": 0.0}, seed))
                sm.run()
                trace += sm.trace
            meas.append(shard_compare([], p["breakdown"])["measured"])
        sim = shard_compare(trace, None)["sim"]
        m = {k: (round(sum(x[k]["median"] for x in meas) / len(meas), 3), round(sum(x[k]["mean"] for x in meas) / len(meas), 3))
             for k in ("origin_ok", "home_peer_ok")}
        d = round(sum(x["home_deferred_per_shard"] for x in meas) / len(meas), 3)
        print(kw, "sim", sim, "measured", m, d, flush=True)
        out.append({"params": kw, "sim": sim, "measured": m, "measured_home_deferred": d})
    return out


def calibration() -> dict:
    """Fit each free parameter on its own "fit" points (least squares of the log ratio over a grid, one parameter
    at a time, twice round: each barely moves the others' points), then run every point."""
    pts = calibration_points()
    fitted = {"step_cpu_s": 0.0, "request_sigma": 0.0, "origin_request_s": 0.0}
    grids = {"step_cpu_s": GRID, "origin_request_s": GRID, "request_sigma": [0.1 * k for k in range(16)]}
    for _ in range(2):
        for name in fitted:
            fit = [p for p in pts if p["fits"] == name]

            def loss(x, fit=fit, name=name):
                f = {**fitted, name: x}
                return sum(math.log(run_point(p, f)["sim"] / p["measured"]) ** 2 for p in fit)

            fitted[name] = round(min(grids[name], key=loss), 4)
    rows = [run_point(p, fitted) for p in pts]
    held = [r for r in rows if r["role"] == "held-out"]
    meds = [r for r in rows if "median_node_within_20pct" in r]  # no fit uses a median node: all held out
    return {"fitted": fitted, "fit_on": {k: [p["name"] for p in pts if p["fits"] == k] for k in fitted},
            "measured_inputs": {"origin_request_s (loopback)": ORIGIN_REQUEST_S,
                                "libp2p_peer_request_s": LIBP2P_REQUEST_S, "http_peer_request_s": HTTP_REQUEST_S},
            "lab_http_plane": {**LAB_HTTP, "peer_request_rtts": LAB_HTTP_RTTS, "libp2p_sigma": LAB_LIBP2P_SIGMA,
                               "gossip_hop_s": LAB_GOSSIP_HOP_S, "hold_s": HOLD_S,
                               "start_hold_s (mh_after_*, --nat rows)": START_HOLD_S,
                               "set_from": "per-shard breakdown of wan.json holder_both_a/b/c (origin, to-home peer "
                                           "ok: median and mean) and holder_one_a/b/c (libp2p sigma); "
                                           "wan_floor.json (round trips); no time to all nodes"},
            "held_out_within_20pct": f"{sum(r['within_20pct'] for r in held)} of {len(held)}",
            "held_out_median_node_within_20pct": f"{sum(r['median_node_within_20pct'] for r in meds)} of {len(meds)}",
            "rows": rows}


def calibration_line(r: dict) -> str:
    extra = (f"; median node {r['sim_median_node']:.2f} vs {r['measured_median_node']:.2f} "
             f"({r['median_node_sim_vs_measured']:+.0%})" if "sim_median_node" in r else "")
    return (f"{r['role']:8s} {r['name']:55s} {r['sim']:7.3f} vs {r['measured']:7.3f} s "
            f"{r['sim_vs_measured']:+6.0%} {'ok' if r['within_20pct'] else 'MISS'}{extra}")


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
        for kind, churn, nat, relay, style in (("full", False, False, False, "o-"), ("delta", False, False, False, "s--"),
                                               ("full", True, False, False, "^:"), ("full", False, True, False, "o-."),
                                               ("delta", False, True, False, "s-."), ("full", False, True, True, "D-"),
                                               ("delta", False, True, True, "v-")):
            sel = [r for r in rows if r["checkpoint_bytes"] == ck and r["kind"] == kind and bool(r.get("churn")) == churn
                   and bool(r.get("nat_share")) == nat and bool(r.get("relay_first_copies")) == relay
                   and r["seconds"] is not None]
            if not sel:
                continue
            share = sel[0].get("nat_share") or 0
            how = f" ({share:.0%} NAT, {'relay' if relay else 'no relay'}; calibrated)" if nat else " (no NAT; earlier model)"
            label = f"{kind}{' + churn' if churn else ''}{how}"
            ax.plot([r["nodes"] for r in sel], [r["ratio"] for r in sel], style, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("time to 100 % ÷ lower bound")
        ax.set_title(f"{ck / GB:g} GB checkpoint (simulated)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
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


GOSSIP_HOP_S = 0.47  # the "announced" phase at loopback N = 6, libp2p plane, current fetcher (wan_loopback.json)
PEER_CPU_RATE = 50e6  # py-libp2p, ~20 CPU-s per GB per side (bench/results/transport_cost.json, 1-8 MiB shards)


def internet_case(n: int, kind: str, share: float, relay: bool, fitted: dict, budget_s: float = 0.0,
                  first: bool = True) -> Case:
    """A 1 GB broadcast on the internet mix with the node as calibrated against the lab's HTTP plane (LAB_HTTP: the
    current code, 2026-11-27), the default since p2p.http = true: every node fetches over HTTP from a reachable holder
    (0.02 s median, sigma 1.2, 0.8 round trip more than the transfer's own); a NATed holder serves only over py-libp2p
    (its kept connections or a circuit: 0.64 s median, sigma 0.6, ~50 MB/s of CPU per side); the origin's request
    0.05 s; the origin holds a deferred request until the first copy lands and names its holder (hold_s = 1); relayed
    nodes hold first copies only beside fewer than 2 direct askers; the manifest names the live first copies'
    holders and a deferral for a shard nobody holds is held until a first copy lands (293ce92, START_HOLD_S = 2);
    the step's announcement takes the gossip's hops
    of (mean RTT + 0.15 s); the step's rebuild as fitted (`calibration()`)."""
    return Case(nodes=n, checkpoint_bytes=1 * GB, kind=kind, nat_share=share, relay=relay, relay_first_copies=first,
                notify_s=None, gossip_hop_s=LAB_GOSSIP_HOP_S, step_rtts=1.0, step_cpu_s=fitted["step_cpu_s"],
                peer_cpu_rate=PEER_CPU_RATE, budget_s=budget_s, holder_hints=True, hold_s=HOLD_S,
                manifest_holders=True, spread_hold=True, start_hold_s=START_HOLD_S,
                direct_first_copies=True, peer_request_rtts=LAB_HTTP_RTTS, libp2p_request_s=LIBP2P_REQUEST_S,
                libp2p_sigma=LAB_LIBP2P_SIGMA, origin_request_s=LAB_HTTP["origin_request_s"],
                peer_request_s=LAB_HTTP["peer_request_s"], request_sigma=LAB_HTTP["request_sigma"])


def nat_main(share: float, relay: bool, budget_s: float, sizes: tuple, nfc: bool) -> None:
    """The calibration against the lab ("calibration"), then 1 GB full and delta at each size with `share` of all
    nodes behind NAT, without relay circuits and (--relay) with them, side by side (same seed): "nat_rows"."""
    path = REPO / "bench/results/swarm_sim.json"
    doc = json.loads(path.read_text())
    for stale in ("lab_validation", "relay_lab_validation", "lab_roundtrip_validation", "relay_rows"):
        doc.pop(stale, None)  # the previous model's (git history keeps them)
    cal = calibration()
    for r in cal["rows"]:
        print(calibration_line(r), flush=True)
    print("fitted:", cal["fitted"], "held out within 20 %:", cal["held_out_within_20pct"], flush=True)
    doc["calibration"] = cal
    path.write_text(json.dumps(doc, indent=2) + "\n")
    variants = [(False, True)] + ([(True, True)] if relay else []) + ([(True, False)] if nfc else [])
    rows = []
    for n in sizes:
        for kind in ("full", "delta"):
            for rl, first in variants:
                case = internet_case(n, kind, share, rl, cal["fitted"], budget_s if n >= 1000 else 0.0, first)
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
                r["case"] = {k: v for k, v in asdict(case).items() if v != getattr(Case, k, None)}
                print(nat_line(r), flush=True)
                rows.append(r)
                doc["nat_rows"] = rows
                path.write_text(json.dumps(doc, indent=2) + "\n")
    plot([*doc["rows"], *rows], REPO / "docs/swarm_sim.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="N = 16 and 100 only")
    ap.add_argument("--skip-validation", action="store_true")
    ap.add_argument("--nat", type=float, default=None, metavar="SHARE",
                    help="only: the simulator calibrated against the WAN lab, then 1 GB full and delta at --sizes with "
                         "this share of all nodes behind NAT; swarm_sim.json \"calibration\" and \"nat_rows\"")
    ap.add_argument("--relay", action="store_true", help="--nat: each case without and with relay circuits")
    ap.add_argument("--nfc", action="store_true",
                    help="--nat: also with circuits but first copies to reachable nodes only (a what-if)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="--nat: wall-clock limit of one N >= 1,000 run")
    ap.add_argument("--sizes", default="16,100,1000,4000", help="--nat: node counts, comma-separated")
    ap.add_argument("--lab-http-grid", action="store_true",
                    help="only: how LAB_HTTP was set (the lab's per-shard figures over a grid, `lab_http_costs()`)")
    ap.add_argument("--quiet-check", action="store_true",
                    help="only: the quiet-box lab runs of 2026-11-28 against the model, as calibrated and with "
                         "each run's own per-request costs (~2 min)")
    args = ap.parse_args()
    if args.quiet_check:
        quiet_check()
        return
    if args.lab_http_grid:
        lab_http_costs({"origin_request_s": [0.03, 0.04, 0.05], "peer_request_s": [0.0, 0.02, 0.04],
                        "request_sigma": [1.0, 1.2, 1.4], "peer_request_rtts": [LAB_HTTP_RTTS]})
        return
    if args.nat is not None:
        nat_main(args.nat, args.relay, args.budget_s, tuple(int(x) for x in args.sizes.split(",")), args.nfc)
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
