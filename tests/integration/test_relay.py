"""A relay mirrors only verified checkpoints (signed by the pinned key) and serves them to a node."""
import asyncio

import pytest

from node.relay import Relay
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = pytest.mark.timeout(240)


async def test_relay_serves_a_node(tmp_path):
    async with running_coordinator(tmp_path, "run.max_steps=3", "distribution.shard_size=16384") as (coord, url):
        relay = Relay(url, tmp_path / "relay", upstream_key=coord.identity.public_hex)
        ready = asyncio.get_running_loop().create_future()
        relay_task = asyncio.create_task(relay.run("127.0.0.1", 0, on_ready=ready.set_result))
        relay_url = await asyncio.wait_for(ready, 30)
        await wait_for(lambda: 0 in relay.store.held_steps(), 60, "the relay to mirror step 0")
        coord.cfg.distribution.relays.append(relay_url)
        node, task = start_worker(tmp_path, "w", coord, url)
        await wait_for(lambda: coord.published_step >= 3 and node.backend is not None
                       and node.backend.policy_step >= 3, 120, "the node to hold step 3", coord)
        await stop_workers((node, task))
        relay.stop_event.set()
        await relay_task
        assert relay.bytes_served > 0 and node.fetcher.bytes_by_kind["relay"] > 0
        assert node.stats.rejected == 0
        # everything the relay holds is byte-identical to what the coordinator published
        for s in relay.store.steps():
            ours = (relay.store.ckpt_dir / str(s) / "shards")
            theirs = coord.checkpoints.ckpt_dir / str(s) / "shards"
            if theirs.exists():
                for f in ours.iterdir():
                    assert f.read_bytes() == (theirs / f.name).read_bytes()


async def test_relay_refuses_checkpoints_from_another_key(tmp_path):
    from protocol.identity import Identity

    async with running_coordinator(tmp_path, "run.max_steps=1") as (coord, url):
        relay = Relay(url, tmp_path / "relay", upstream_key=Identity.generate().public_hex)
        task = asyncio.create_task(relay.run("127.0.0.1", 0))
        await asyncio.sleep(3)
        relay.stop_event.set()
        await task
        assert relay.store.held_steps() == []  # nothing signed by the wrong key was mirrored
