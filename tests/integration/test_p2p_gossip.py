"""Signed announcements over real gossipsub between real libp2p hosts on 127.0.0.1."""
import asyncio
import contextlib

import pytest

from node.p2p.announce import (
    MAX_ANNOUNCEMENT_BYTES,
    HaveAnnouncement,
    ManifestAnnouncement,
    encode_have_announcement,
    encode_manifest_announcement,
)
from node.p2p.host import P2PNode
from protocol.identity import Identity
from protocol.signing import canonical_json
from tests.p2p_helpers import p2p_config

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]

RUN = "run-gossip"
H = "ab" * 32


@contextlib.asynccontextmanager
async def swarm(coord: Identity, n_workers: int, **settings):
    """A coordinator host and `n_workers` worker hosts, each worker dialling the coordinator only."""
    cfg = p2p_config(allow_private_addrs=True, **settings)  # every host is on 127.0.0.1
    nodes = [P2PNode(coord, cfg, run_id=RUN, coordinator_key=coord.public_hex, name="coord")]
    nodes += [P2PNode(Identity.generate(), cfg, run_id=RUN, coordinator_key=coord.public_hex, name=f"w{i}")
              for i in range(n_workers)]
    try:
        for node in nodes:
            await node.start()
        hub = nodes[0]
        for w in nodes[1:]:
            assert await w.connect(hub.listen_addrs) == [hub.peer_id]
        for w in nodes[1:]:  # both directions in the mesh: publishes reach everyone from here on
            assert await w.wait_for_mesh(hub.peer_id, 5) and await hub.wait_for_mesh(w.peer_id, 5)
        yield nodes
    finally:
        await asyncio.gather(*(node.stop() for node in nodes))


async def publish_unvalidated(node: P2PNode, data: bytes) -> None:
    """Act as a malicious peer: publish raw bytes, skipping this host's own validator."""

    async def on_trio(service):
        service.pubsub.remove_topic_validator(service.topic)
        try:
            await service.pubsub.publish(service.topic, data)
        finally:
            service.pubsub.set_topic_validator(service.topic, service._validate, False)

    await node._bridge.call(on_trio, node._service)


async def test_signed_announcements_reach_every_peer_and_forgeries_are_dropped():
    coord = Identity.generate()
    async with swarm(coord, 2) as (hub, w1, w2):
        sub1, sub2 = w1.subscribe(), w2.subscribe()

        # The coordinator's manifest announcement reaches both workers.
        await hub.announce_manifest(5, H)
        for sub in (sub1, sub2):
            ev = await sub.get(timeout=10)
            assert isinstance(ev.announcement, ManifestAnnouncement)
            assert (ev.announcement.step, ev.peer_id) == (5, hub.peer_id)
        assert w1.latest_manifest() == (5, H) == w2.latest_manifest()

        # w1's "have" reaches w2 through the hub (w1 and w2 are not connected to each other).
        await w1.announce_have(5, [0, 2], H)
        ev = await sub2.get(timeout=10)
        assert isinstance(ev.announcement, HaveAnnouncement) and ev.peer_id == w1.peer_id
        assert ev.announcement.addrs == w1.listen_addrs
        assert w2.peers_with(5, 2, manifest_hash=H) == [w1.peer_id] and w2.peers_with(5, 1) == []

        # Forgeries published by w1, a malicious worker, with its host's own checks bypassed.
        other = Identity.generate()
        forged = {
            "unsigned": canonical_json({"kind": "have", "run_id": RUN, "step": 5, "manifest_hash": H,
                                        "indices": [1], "ts_ms": 1}),
            # A manifest signed by a worker key, not the coordinator's.
            "manifest_by_worker": encode_manifest_announcement(Identity.generate(), run_id=RUN, step=6,
                                                               manifest_hash="66" * 32),
            # A "have" for another node's key, sent from w1's peer id.
            "have_for_other_key": encode_have_announcement(other, run_id=RUN, step=5, manifest_hash=H, indices=[1]),
            "malformed": b'{"kind": "have", "oops"',
            "too_large": b" " * (MAX_ANNOUNCEMENT_BYTES + 1),
        }
        for data in forged.values():
            await publish_unvalidated(w1, data)
        # A valid marker published after them: once it arrives, the forgeries had their chance.
        await w1.announce_have(5, [3], H)
        ev = await sub2.get(timeout=10)
        assert ev.announcement.indices == [3]
        await asyncio.sleep(0.2)
        assert sub2._queue.empty(), "a forged announcement was delivered"
        assert w2.latest_manifest() == (5, H)  # the fake step-6 manifest did not land
        assert w2.peers_with(5, 1) == []
        # The hub dropped (and counted) each one; being invalid, none was relayed to w2.
        dropped = hub.stats.snapshot()["announcements_dropped"]
        assert dropped == {"unsigned": 1, "wrong_key": 2, "malformed": 1, "too_large": 1}
        assert w2.stats.snapshot()["announcements_dropped"] == {}
        assert hub.stats.snapshot()["announcements_received"] == {"have": 2}

        sub1.close()
        with pytest.raises(StopAsyncIteration):
            await sub1.get(timeout=1)


async def test_announcements_of_another_run_are_dropped():
    coord = Identity.generate()
    async with swarm(coord, 1) as (hub, w1):
        sub = hub.subscribe()
        await publish_unvalidated(w1, encode_have_announcement(w1.identity, run_id="other-run", step=1,
                                                               manifest_hash=H, indices=[0]))
        await w1.announce_have(1, [0], H)
        ev = await sub.get(timeout=10)
        assert ev.announcement.run_id == RUN
        assert hub.stats.snapshot()["announcements_dropped"] == {"wrong_run": 1}


async def test_a_burst_of_announcements_is_paced_not_silently_dropped():
    """py-libp2p's gossipsub drops (silently) what one peer sends beyond its per-second limit,
    even our own publishes; P2PNode paces its announcements so a burst all arrives, also at
    peers that keep the stock limit of 10 messages/s."""
    coord = Identity.generate()
    async with swarm(coord, 1, gossip_rate_limit=10) as (hub, w1):
        sub = w1.subscribe()
        burst = 20
        for step in range(burst):
            await hub.announce_manifest(step, H)
        steps = [(await sub.get(timeout=10)).announcement.step for _ in range(burst)]
        assert sorted(steps) == list(range(burst))
        assert w1.latest_manifest() == (burst - 1, H)


async def test_idontwant_only_for_large_messages():
    """gossipsub v1.2's IDONTWANT saves resending a large message; py-libp2p 0.8.1 sent one to every mesh peer
    for every message received, a whole RPC per peer per `have` (~0.5 KB). Now, as go-libp2p, only from 1 KiB
    on (node/p2p/service.py, RunGossipSub): w1's small `have`, relayed by the hub to w2, costs no IDONTWANT;
    a `have` of 600 shards (~2.6 KB) still gets them."""
    coord = Identity.generate()
    async with swarm(coord, 2) as nodes:
        hub, w1, w2 = nodes
        received: list[str] = []
        for name, node in zip(("hub", "w1", "w2"), nodes):
            gossipsub = node._service.gossipsub
            upstream = gossipsub.handle_idontwant

            async def counted(msg, sender, _upstream=upstream, _name=name):
                received.append(_name)
                await _upstream(msg, sender)

            gossipsub.handle_idontwant = counted  # called as self.handle_idontwant by GossipSub.handle_rpc
        sub = w2.subscribe()
        small = encode_have_announcement(w1.identity, run_id=RUN, step=3, manifest_hash=H, indices=[0, 1])
        large = encode_have_announcement(w1.identity, run_id=RUN, step=4, manifest_hash=H, indices=list(range(600)))
        assert len(small) < 1024 < len(large)
        await w1.announce_have(3, [0, 1], H)
        assert (await sub.get(timeout=10)).announcement.step == 3
        await asyncio.sleep(1.5)  # an IDONTWANT is sent at once, before the relay; leave time for it to land
        assert received == []
        await w1.announce_have(4, list(range(600)), H)
        assert (await sub.get(timeout=10)).announcement.step == 4
        await asyncio.sleep(1.5)
        assert set(received) >= {"hub", "w1"}  # the hub tells both its mesh peers; w2 tells the hub


async def test_a_natted_node_names_only_the_shards_it_could_be_asked_for():
    """A fetcher asks at most HOLDER_TRIES holders of a shard, direct ones first (node/worker/peers.py): a NATed
    node's `have` for a shard with that many direct holders known would reach every node and never be used. w1, found
    unreachable by the dial-back, knows 4 direct holders of shard 0 and 3 direct and 1 relayed of shard 1: its `have`
    of shards 0-2 names 1 and 2 (before: all three, at every node's cost); reachable, it names all three; with
    nothing worth naming it publishes nothing."""
    from node.p2p.host import HOLDER_TRIES

    def have(indices, addr):
        return HaveAnnouncement.model_construct(kind="have", run_id=RUN, step=3, manifest_hash=H, indices=indices,
                                                addrs=[addr], ts_ms=1, signer="0" * 64, signature="0" * 128)

    coord = Identity.generate()
    async with swarm(coord, 2) as nodes:
        hub, w1, w2 = nodes
        w1.note_manifest(3, H)
        for i in range(HOLDER_TRIES):
            shards = [0] if i == HOLDER_TRIES - 1 else [0, 1]
            w1.table.record_have(f"direct{i}", have(shards, f"/ip4/10.0.0.{i + 1}/tcp/4001"))
        w1.table.record_have("relayed", have([1], f"{hub.listen_addrs[0]}/p2p-circuit/p2p/{w2.peer_id}"))
        assert [w1.holder_rank(p) for p in w1.peers_with(3, 1, H)] == [0, 0, 0, 1]
        sub = w2.subscribe()

        w1.reachable = False
        await w1.announce_have(3, [0, 1, 2], H)
        assert (await sub.get(timeout=10)).announcement.indices == [1, 2]
        w1.reachable = True
        await w1.announce_have(3, [2, 0, 1], H)
        assert (await sub.get(timeout=10)).announcement.indices == [0, 1, 2]
        w1.reachable = False
        await w1.announce_have(3, [0], H)
        with pytest.raises(asyncio.TimeoutError):
            await sub.get(timeout=2)
        t = w1.stats.totals()
        assert (t["have_shards_named"], t["have_shards_quiet"]) == (5, 2)
