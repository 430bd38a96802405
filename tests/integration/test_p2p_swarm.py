"""Checkpoint distribution through the libp2p swarm, with real workers and a capped coordinator."""
import asyncio

import pytest

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.p2p]

BIGGER = ["model.tiny_hidden_size=128", "model.tiny_layers=4", "distribution.shard_size=65536"]


@pytest.mark.parametrize("plane", ["libp2p", "http"])
async def test_four_nodes_capped_origin_most_bytes_from_peers(tmp_path, plane):
    """`http`: the workers run `p2p.http = true` (shard bytes between nodes over HTTP, the origin naming
    first holders)."""
    async with running_coordinator(tmp_path, *BIGGER, "distribution.origin_upload_limit=400000",
                                   "run.max_steps=2") as (coord, url):
        extra = [f"p2p.http={'true' if plane == 'http' else 'false'}"]  # `libp2p`: that plane alone
        nodes = [start_worker(tmp_path, f"w{i}", coord, url, *extra) for i in range(4)]
        await wait_for(lambda: coord.published_step >= 2 and all(
            n.backend is not None and n.backend.policy_step >= 2 for n, _ in nodes), 240,
            "every node to hold step 2", coord)
        await stop_workers(*nodes)
        for step in (0, 1, 2):  # every node got every checkpoint, byte-exact with what was published
            published = coord.checkpoints.payload_path(step).read_bytes() if coord.checkpoints.payload_path(step).exists() else None
            for n, _ in nodes:
                assert step in n.fetcher.store.held_steps() or step < n.fetcher.store.held_steps()[0]
                if published is not None and step in n.fetcher.store.held_steps():
                    assert n.fetcher.store.payload_path(step).read_bytes() == published
        peer = sum(n.fetcher.bytes_by_kind["peer"] for n, _ in nodes)
        origin = sum(n.fetcher.bytes_by_kind["coordinator"] for n, _ in nodes)
        assert peer > origin, (peer, origin)
        await asyncio.sleep(1.5)
        assert coord.status()["checkpoint_bytes_by_source"]["peer"] > 0
        served_over_http = sum(v for n, _ in nodes for k, v in n.p2p.stats.bytes_served_by_peer().items()
                               if k.startswith("http:"))
        assert (served_over_http > 0) == (plane == "http"), served_over_http


@pytest.mark.parametrize("plane", ["libp2p", "http"])
async def test_malicious_peer_is_detected_avoided_and_download_completes(tmp_path, plane):
    """A peer announces every shard of step 0 and serves them corrupted (`http`: over its HTTP shard
    server, to a worker that fetches over HTTP)."""
    from node.p2p import P2PNode
    from protocol.identity import Identity
    from tests.p2p_helpers import p2p_config

    async with running_coordinator(tmp_path, *BIGGER, "distribution.origin_upload_limit=300000",
                                   "run.max_steps=0") as (coord, url):
        m = coord.checkpoints.manifest(0)
        good = {i: (coord.checkpoints.ckpt_dir / "0" / "shards" / f"{i:05d}.zst").read_bytes() for i in range(m.num_shards)}
        served = {"n": 0}

        def corrupt(step, index):
            data = good.get(index) if step == 0 else None
            if data is None:
                return None
            served["n"] += 1
            return bytes([data[0] ^ 0x55]) + data[1:]

        evil = P2PNode(Identity.generate(), p2p_config(bootstrap=coord.p2p_bootstrap(), http=plane == "http"),
                       run_id=coord.cfg.run.run_id, coordinator_key=coord.identity.public_hex, shard_source=corrupt)
        await evil.start()
        try:
            node, task = start_worker(tmp_path, "honest", coord, url, f"p2p.http={'true' if plane == 'http' else 'false'}")
            await wait_for(lambda: hasattr(node, "p2p") and node.p2p is not None and node.p2p.running, 60, "p2p up")

            async def announce_forever():
                while True:
                    await evil.announce_have(0, list(range(m.num_shards)), m.canonical_hash())
                    await asyncio.sleep(0.5)

            spam = asyncio.create_task(announce_forever())
            await wait_for(lambda: node.backend is not None and node.backend.policy_step >= 0, 180,
                           "the honest node to hold step 0", coord)
            spam.cancel()
            await stop_workers((node, task))
            peer_src = next(s for s in node.fetcher.sources if s.kind == "peer")
            assert served["n"] >= 1, "the malicious peer was never asked (test did not exercise it)"
            assert evil.peer_id in peer_src.banned
            if plane == "http":  # the corrupted bytes came over HTTP, not libp2p
                assert evil.stats.bytes_served_by_peer().keys() == {"http:127.0.0.1"}
            assert node.fetcher.store.payload_path(0).read_bytes() == coord.checkpoints.payload_path(0).read_bytes()
        finally:
            await evil.stop()
