"""bench/swarm_sim.py on tiny cases: the simulated broadcast finishes, every node gets every shard, the
time respects the lower bound, the origin sends at least one copy, and churn completes for the nodes
that stay."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import swarm_sim  # noqa: E402
from swarm_sim import MIB, Case, Sim  # noqa: E402


def tiny(**kw):
    return Case(nodes=kw.pop("nodes", 12), checkpoint_bytes=kw.pop("checkpoint_bytes", 16 * MIB),
                shard_bytes=MIB, seed=kw.pop("seed", 1), **kw)


def test_a_tiny_swarm_broadcast_finishes_within_its_bounds():
    sim = Sim(tiny())
    r = sim.run()
    assert all(n.held == sim.num_shards and n.done_t is not None for n in sim.nodes)
    assert all(n.planner.finished for n in sim.nodes)
    assert r["seconds"] >= r["lower_bound_seconds"] > 0
    assert r["origin_bytes"] >= r["wire_bytes"]  # every byte leaves the origin at least once
    assert r["origin_bytes"] + r["peer_bytes"] == r["nodes"] * r["wire_bytes"]


def test_origin_only_sends_one_copy_per_node_and_a_delta_is_faster():
    full = Sim(tiny(mode="origin", nodes=4)).run()
    assert full["origin_copies"] == 4.0 and full["seconds"] >= full["lower_bound_seconds"]
    delta = Sim(tiny(kind="delta")).run()
    assert delta["wire_bytes"] < full["wire_bytes"] and delta["seconds"] >= delta["lower_bound_seconds"]


def test_churn_completes_for_the_nodes_that_stay():
    sim = Sim(tiny(nodes=16, churn_mean_s=30.0, seed=3))
    r = sim.run()
    assert r["left"] > 0 and r["joined"] == r["left"]
    stayers = [n for n in sim.nodes if n.initial and n.active]
    assert len(stayers) == r["stayers"] > 0
    assert all(n.held == sim.num_shards for n in stayers)
    assert all(n.held == sim.num_shards for n in sim.nodes if n.active)  # joiners present at the end too
    assert r["seconds"] >= r["lower_bound_seconds"]


def test_the_simulator_drives_the_real_planner_and_seeder():
    from node.coordinator.seeding import SuperSeeder
    from node.worker.planner import ShardPlanner

    assert swarm_sim.ShardPlanner is ShardPlanner and swarm_sim.SuperSeeder is SuperSeeder


def test_natted_nodes_serve_only_the_reachable_nodes_they_keep():
    sim = Sim(tiny(nodes=20, nat_share=0.6, seed=2))
    r = sim.run()
    natted = [n for n in sim.nodes if n.natted]
    assert natted and all(n.done_t is not None for n in sim.nodes)
    assert all(len(n.kept) <= 4 and not any(sim.nodes[k].natted for k in n.kept) for n in natted)
    assert r["natted_nodes"] == len(natted) and r["natted_served_bytes"] <= r["peer_bytes"]
    assert r["seconds"] >= r["lower_bound_seconds"]


def test_explicit_sites_and_step_overhead_delay_the_first_request():
    mbit = 125_000.0
    sites = ((20 * mbit, 100 * mbit, 0.05, True), (200 * mbit, 200 * mbit, 0.01, False))
    slow = Sim(tiny(nodes=2, sites=sites, step_rtts=2, notify_s=0.5)).run()
    fast = Sim(tiny(nodes=2, sites=sites)).run()
    assert slow["seconds"] >= fast["seconds"] + 0.5


def test_relay_circuits_let_natted_nodes_hold_first_copies_and_serve_everyone():
    """Without relay the seeder never gives a NATed node a first copy (the coordinator's dial-back) and no NATed
    node fetches from another; with relay (a reservation on the hop, the coordinator's `can_serve`) they get first
    copies, serve through the hop (capped by `relay_cap`) and punch holes for some pairs."""
    kw = {"nodes": 20, "nat_share": 0.6, "seed": 2}
    plain = Sim(tiny(**kw))
    plain.run()
    natted = [n for n in plain.nodes if n.natted]
    assert natted and all(plain.servable(n.id) is False for n in natted)
    assert plain.relayed_bytes == 0 and not plain.punched
    sim = Sim(tiny(relay=True, punch_fraction=0.5, **kw))
    r = sim.run()
    assert all(n.held == sim.num_shards for n in sim.nodes)
    assert all(sim.servable(n.id) is None for n in sim.nodes)
    assert r["relay"] and r["relayed_transfers"] > 0 and 0 < r["relayed_bytes"] <= r["natted_served_bytes"]
    assert r["relayed_pairs"] == len(sim.punched) and 0 <= r["punched_pairs"] <= r["relayed_pairs"]
    assert r["seconds"] >= r["lower_bound_seconds"]
    assert not sim.hop.ups  # every relayed flow left the hop
    # a thin hop makes relayed transfers, and so the broadcast, slower
    thin = Sim(tiny(relay=True, punch_fraction=0.0, relay_cap=0.1 * 125_000.0, **kw)).run()
    assert thin["seconds"] > r["seconds"]


# ---- the mechanisms calibrated against the WAN lab (issue #26; docs/BENCHMARKS.md, "The swarm simulation against
# the WAN lab") ------------------------------------------------------------------------------------------------
MBIT = 125_000.0
DELTA = 540_000  # the lab's delta: ~0.54 MB in 3 shards of 256 KiB raw


def loopback(**kw):
    base = dict(nodes=6, checkpoint_bytes=DELTA, shard_bytes=262144, delta_fraction=1.0, links="loopback",
                origin_cap=100e6, rtt_range=(0.0002, 0.0002), step_rtts=1.0, notify_s=0.2, seed=1)
    return Case(**{**base, **kw})


def origin_receivers(case):
    """The nodes the origin sent any shard to (first copies, or after the seeder's deferrals)."""
    sim = Sim(case)
    got = set()
    begin = sim.transfer

    def transfer(s, r, pick, delay, server, hop=None, **kw):
        if s is sim.origin:
            got.add(r.id)
        begin(s, r, pick, delay, server, hop, **kw)

    sim.transfer = transfer
    return sim.run(), got


def test_first_copies_are_spread_over_the_nodes_that_ask():
    """The seeder keys shards (step, index) as the coordinator does, so a step's first copies are spread over the
    nodes that asked lately (SuperSeeder.admit; `prior_askers`: they asked for the step before, as in a run of
    consecutive steps); with plain indices the first node to ask takes every first copy of a small step."""
    kw = dict(checkpoint_bytes=4 * 262144, delta_fraction=1.0, notify_s=0.0, prior_askers=True)
    _, spread = origin_receivers(loopback(**kw))
    _, lump = origin_receivers(loopback(spread_first_copies=False, **kw))
    _, lone = origin_receivers(loopback(**{**kw, "prior_askers": False}))
    assert len(lump) == 1 and len(lone) == 1 and len(spread) >= 2


def test_a_small_step_is_asked_of_the_origin_all_at_once():
    """fetcher.py: a step under `small_step_bytes` gets `parallel` origin slots; a larger one one slot, so its
    shards come one round trip after another from a lone node."""
    site = ((20 * MBIT, 100 * MBIT, 0.1, False),)
    kw = dict(nodes=1, sites=site, links="internet", rtt_range=(0.2, 0.2))
    small = Sim(loopback(**kw)).run()
    one_by_one = Sim(loopback(small_step_bytes=0, **kw)).run()
    assert one_by_one["seconds"] > small["seconds"] + 2 * 0.2 - 0.01


def test_request_costs_and_the_step_rebuild_add_their_seconds():
    lone = dict(nodes=1, notify_s=0.0)
    base = Sim(loopback(**lone)).run()["seconds"]
    # the listing round trip and the shards' wave each pay the origin's cost once
    assert Sim(loopback(origin_request_s=0.1, **lone)).run()["seconds"] >= base + 0.2 - 1e-6
    assert abs(Sim(loopback(step_cpu_s=0.3, **lone)).run()["seconds"] - (base + 0.3)) < 0.011
    # peers' transfers: py-libp2p's measured 0.64 s against the HTTP plane's 0.02 s (loopback N = 6)
    libp2p = Sim(loopback(peer_request_s=0.64)).run()
    http = Sim(loopback(peer_request_s=0.02)).run()
    assert libp2p["peer_bytes"] > 0 and libp2p["seconds"] > http["seconds"] + 0.5


def test_request_sigma_spreads_each_cost_around_its_median():
    sim = Sim(loopback(request_sigma=0.7))
    draws = sorted(sim.cost(0.64) for _ in range(2001))
    assert 0.55 < draws[1000] < 0.75 and draws[1800] > 1.2 * 0.64 and draws[200] < 0.8 * 0.64
    assert Sim(loopback()).cost(0.64) == 0.64  # sigma 0: the median itself


def test_have_announcements_go_out_when_the_announcers_batch_ends():
    """HaveAnnouncer: the first verified shard after a quiet spell opens a batch of `batch_seconds`; every shard
    verified meanwhile goes out with it, after the gossip's hops (mean RTT + gossip_hop_s each)."""
    sim = Sim(loopback(gossip_hop_s=0.25, nodes=16))
    haves = []
    push = sim.push

    def spy(t, kind, a=None, b=None):
        if kind == swarm_sim.HAVE:
            haves.append((a.id, sim.now, t))
        push(t, kind, a, b)

    sim.push = spy
    sim.run()
    hop = sim.gossip_hops * (sim.mean_rtt + 0.25)
    assert sim.gossip_batch == 2.0 and haves
    firsts = {}
    for nid, now, t in haves:
        firsts.setdefault(nid, (now, t))
        assert t - now <= sim.gossip_batch + hop + 1e-9
    assert all(abs(t - now - sim.gossip_batch - hop) < 1e-9 for now, t in firsts.values())
    assert any(t - now < sim.gossip_batch + hop - 1e-3 for _, now, t in haves)  # later shards join an open batch


def test_a_lost_push_waits_for_the_poll_and_nodes_learn_of_a_step_at_different_times():
    fixed = Sim(loopback(nodes=1)).run()["seconds"]
    polled = Sim(loopback(nodes=1, poll_miss_share=1.0, poll_s=5.0, seed=4)).run()["seconds"]
    assert polled > fixed
    sim = Sim(loopback(nodes=41, notify_s=0.5, notify_p90_s=2.0))
    starts = []
    push = sim.push
    sim.push = lambda t, kind, a=None, b=None: (starts.append(t) if kind == swarm_sim.WAKE and sim.now == 0
                                                 else None, push(t, kind, a, b))
    sim.run()
    starts.sort()
    assert len(set(starts)) == 41 and 0.35 < starts[20] - 0.0002 < 0.7 and starts[36] > 1.0


def test_holder_hints_let_a_deferred_node_ask_the_first_copys_holder_at_once():
    """The HTTP plane: the origin's 429 names the node whose first copy is complete; without the hint a deferred
    node waits for that node's batched `have` gossip."""
    kw = dict(peer_request_s=0.02, notify_s=0.3, notify_p90_s=0.6, gossip_hop_s=0.2)
    hinted = [Sim(loopback(holder_hints=True, seed=s, **kw)) for s in range(5)]
    plain = [Sim(loopback(seed=s, **kw)) for s in range(5)]
    t_hint = sorted(s.run()["median_node_seconds"] for s in hinted)[2]
    t_plain = sorted(s.run()["median_node_seconds"] for s in plain)[2]
    assert any(n.hints for s in hinted for n in s.nodes) and not any(n.hints for s in plain for n in s.nodes)
    assert t_hint < t_plain


def test_py_libp2p_cpu_caps_what_a_node_moves_to_and_from_peers():
    fast = ((1000 * MBIT, 1000 * MBIT, 0.005, False),) * 4
    kw = dict(nodes=4, checkpoint_bytes=64 * MIB, shard_bytes=4 * MIB, sites=fast, links="internet",
              origin_cap=20 * MBIT, notify_s=0.0)
    free = Sim(loopback(**kw)).run()
    capped = Sim(loopback(peer_cpu_rate=5e6, **kw)).run()
    assert free["peer_bytes"] > 0 and capped["seconds"] > free["seconds"]


def test_a_slot_told_busy_long_ago_does_not_sleep_on_a_holder_that_freed_its_slots_since():
    """A "busy" answer that arrives late (a slow request: request_sigma) finds the holder idle again: the slot
    looks again instead of sleeping on a release that already happened (the run stalled before)."""
    sites = ((20 * MBIT, 100 * MBIT, 0.02, True), (200 * MBIT, 200 * MBIT, 0.005, False),
             (20 * MBIT, 100 * MBIT, 0.047, True), (20 * MBIT, 100 * MBIT, 0.073, True),
             (200 * MBIT, 200 * MBIT, 0.02, False), (20 * MBIT, 100 * MBIT, 0.1, True))
    for seed in range(12):
        r = Sim(loopback(sites=sites, links="internet", origin_cap=20 * MBIT, peer_request_s=0.64,
                         origin_request_s=0.09, request_sigma=0.8, notify_s=0.59, notify_p90_s=1.53,
                         gossip_hop_s=0.59, seed=seed)).run()
        assert r["seconds"] >= r["lower_bound_seconds"]


LAB6 = ((20 * MBIT, 100 * MBIT, 0.02, True), (200 * MBIT, 200 * MBIT, 0.005, False),
        (20 * MBIT, 100 * MBIT, 0.047, True), (20 * MBIT, 100 * MBIT, 0.073, True),
        (200 * MBIT, 200 * MBIT, 0.02, False), (20 * MBIT, 100 * MBIT, 0.1, True))  # the lab's N = 6 (wan.py)


def test_the_origin_holds_relayed_homes_until_a_direct_first_copy_lands_and_names_its_holder():
    """The current seeder (SeedingGate's hold, SuperSeeder's `relayed` rule): beside two public nodes the NATed homes
    with a reservation get no first copy; each is held until a public node's copy lands and then told its holder, so
    the origin sends each shard once. The seeder before: homes take first copies and everyone waits on their
    uplinks and circuits."""
    kw = dict(sites=LAB6, links="internet", origin_cap=20 * MBIT, relay=True, holder_hints=True, prior_askers=True,
              checkpoint_bytes=5 * 110_000, shard_bytes=110_000, notify_s=0.15, notify_p90_s=0.5, gossip_hop_s=0.15)
    for seed in range(4):
        sim = Sim(loopback(hold_s=1.0, direct_first_copies=True, trace=True, seed=seed, **kw))
        r = sim.run()
        assert r["origin_sends"] == sim.num_shards  # one copy of each shard
        assert all(n.hints for n in sim.nodes if n.natted)  # each home was told a holder
        assert not any(k == "origin" and nat for k, nat, _ in sim.trace)  # no home got a shard from the origin
        assert any(k == "defer" and nat and x > 0.1 for k, nat, x in sim.trace)  # held, not answered in one RTT
    old = Sim(loopback(seed=0, trace=True, **kw))
    old.run()
    assert any(k == "origin" and nat for k, nat, _ in old.trace)  # homes held first copies


def test_a_natted_holder_serves_over_py_libp2p_and_a_public_one_over_http():
    """p2p.http = true (2176ab7): a request to a reachable holder costs `peer_request_s` (the HTTP plane) plus
    `peer_request_rtts` round trips; a NATed holder serves only over py-libp2p (`libp2p_request_s`); before 2176ab7
    a NATed fetcher used py-libp2p for every peer (`nat_fetch_libp2p`)."""
    sim = Sim(loopback(sites=LAB6, links="internet", peer_request_s=0.02, libp2p_request_s=0.64))
    home, public = sim.new_node(True), sim.new_node(True)
    assert home.natted and not public.natted
    assert sim.peer_cost(public, home) == (0.02, False) and sim.peer_cost(home, public) == (0.64, True)
    before = Sim(loopback(sites=LAB6, links="internet", peer_request_s=0.02, libp2p_request_s=0.64,
                          nat_fetch_libp2p=True))
    home, public = before.new_node(True), before.new_node(True)
    assert before.peer_cost(public, home) == (0.64, True) and before.peer_cost(home, public) == (0.64, True)
    assert Sim(loopback(peer_request_s=0.64)).peer_cost(home, public) == (0.64, True)  # one plane: as before
    kw = dict(sites=LAB6, links="internet", origin_cap=20 * MBIT, relay=True, holder_hints=True, prior_askers=True,
              hold_s=1.0, direct_first_copies=True, checkpoint_bytes=5 * 110_000, shard_bytes=110_000,
              peer_request_s=0.02, libp2p_request_s=0.64, peer_request_rtts=0.8)
    now = sorted(Sim(loopback(seed=s, **kw)).run()["seconds"] for s in range(5))[2]
    old = sorted(Sim(loopback(seed=s, nat_fetch_libp2p=True, **kw)).run()["seconds"] for s in range(5))[2]
    assert old > now + 0.3


def _refused(sim):
    """Run `sim`; the nodes the origin refused a shard (a 429 at once or a hold), one entry per refusal, and the
    nodes whose request a holder's shard server held for an arriving shard."""
    refused, waited = [], []
    push = sim.push

    def spy(t, kind, a=None, b=None):
        if kind in (swarm_sim.DEFER, swarm_sim.HOLD):
            refused.append((a if kind == swarm_sim.DEFER else a[0]).id)
        elif kind == swarm_sim.ARRIVE:
            waited.append(a[0].id)
        push(t, kind, a, b)

    sim.push = spy
    sim.run()
    return refused, waited


def test_holders_named_with_the_manifest_take_a_late_nodes_shards_off_the_origin():
    """293ce92 (`manifest_holders`): the origin's manifest answer names the live first copies' holders, so a node
    that asks after they started takes those shards from the holders (waiting at a holder whose copy is still
    arriving) and is never refused by the origin; before, it asked the origin for every shard and was held or
    deferred, shard by shard."""
    sites = ((200 * MBIT, 200 * MBIT, 0.005, False), (200 * MBIT, 200 * MBIT, 0.01, False),
             (200 * MBIT, 200 * MBIT, 0.06, False))  # the far node's manifest comes back after the first copies start
    kw = dict(nodes=3, sites=sites, links="internet", origin_cap=20 * MBIT, checkpoint_bytes=4 * 110_000,
              shard_bytes=110_000, notify_s=0.0, prior_askers=True, holder_hints=True, hold_s=1.0, spread_hold=True)
    on, off = Sim(loopback(manifest_holders=True, **kw)), Sim(loopback(**kw))
    (refused_on, waited_on), (refused_off, waited_off) = _refused(on), _refused(off)
    late = 2
    assert refused_off.count(late) >= on.num_shards and late not in refused_on
    assert late in waited_on and not waited_off  # a holder's shard server held its request until the shard landed
    assert len(on.nodes[late].hints) == on.num_shards  # every shard's holder was named
    assert on.nodes[late].done_t < off.nodes[late].done_t
    assert on.origin_sends == off.origin_sends == on.num_shards  # one copy of each shard either way


def test_the_manifest_names_an_in_flight_copy_only_at_a_public_holder():
    """SeedingGate.manifest_headers: a copy in flight is named at its holder's HTTP shard server only, a complete one
    at either address; a NATed holder never (the join's dial-back reached none of its addresses)."""
    sim = Sim(loopback(sites=LAB6, links="internet", relay=True, manifest_holders=True, prior_askers=True))
    home, public, asker = sim.new_node(True), sim.new_node(True), sim.new_node(True)
    assert home.natted and not public.natted
    sim.seeder.started((0, 0), home.id)
    sim.seeder.started((0, 1), public.id)
    sim.manifest_named(asker)
    assert asker.hints == {1: public.id}
    sim.seeder.finished((0, 0), home.id)
    sim.manifest_named(asker)
    assert asker.hints == {1: public.id}  # complete, but NATed: not named
    sim.manifest_named(public)  # a holder is not named to itself
    assert public.hints == {}
    public.arriving = sim.c.upload_slots  # its shard server holds as many requests for arriving shards as it may
    assert not sim.takes_request(public, 1)  # the next is answered "not here" at once
    public.got.add(1)
    assert sim.takes_request(public, 1)  # arrived: served while an upload slot is free
    plain = Sim(loopback(sites=LAB6, links="internet", relay=True, prior_askers=True))
    a, b = plain.new_node(True), plain.new_node(True)
    plain.seeder.started((0, 0), b.id)
    plain.manifest_named(a)
    assert not a.hints


def test_a_spreading_deferral_is_held_until_another_nodes_first_copy_lands_and_names_it():
    """293ce92 (`spread_hold`): the first node to ask is deferred on the shards the spreading rule leaves to a node
    holding fewer first copies; it is held until the other node's copy starts and lands and is told that holder.
    Before, the 429 came at once with no holder, and the node waited its 2 s deferral."""
    sites = ((200 * MBIT, 200 * MBIT, 0.005, False), (200 * MBIT, 200 * MBIT, 0.05, False))  # near asks first
    kw = dict(nodes=2, sites=sites, links="internet", origin_cap=20 * MBIT, checkpoint_bytes=4 * 110_000,
              shard_bytes=110_000, notify_s=0.0, prior_askers=True, holder_hints=True, hold_s=1.0, trace=True)
    on, off = Sim(loopback(spread_hold=True, **kw)), Sim(loopback(**kw))
    on.run()
    off.run()
    near, far = 0, 1
    assert set(on.nodes[near].hints.values()) == {far} and not off.nodes[near].hints  # told the holder
    held = [x for k, _, x in on.trace if k == "defer" and x > 2 * on.nodes[far].rtt_o]  # longer than any answer
    assert len(held) == len(on.nodes[near].hints)  # each of its deferrals waited for the far node's copy
    assert on.nodes[near].done_t < off.nodes[near].done_t - 0.2
    assert on.origin_sends == off.origin_sends == on.num_shards
