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
