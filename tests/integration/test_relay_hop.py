"""`prime-node relay` is a circuit relay v2 hop too (node/relay.py, docs/P2P.md "Relaying and hole punching"): the
real relay CLI, mirroring a real coordinator (whose own hop is off, so every circuit goes through the relay's), on
127.0.0.1; the coordinator lists the hop in the join response's p2p_bootstrap (p2p.relay_addrs); a NATed libp2p
node bootstraps from that list, reserves a slot on the relay and announces a circuit through it; another node with
no route to it fetches its shards over that circuit. The hop's limits hold: with one slot, a second NATed node is
refused and announces no circuit."""
import asyncio
import collections
import contextlib
import json
import os
import signal
import sys

import aiohttp
import pytest

from node.config import ConfigError, load_config
from node.p2p.config import P2PConfig
from node.p2p.errors import P2PError, PeerUnavailable, ShardPeerGone
from node.p2p.host import P2PNode
from node.p2p.nat import is_circuit
from protocol.identity import Identity
from tests import p2p_helpers
from tests.integration.coordinator_harness import REPO, RawNode, running_coordinator
from tests.p2p_helpers import p2p_config, running, until

pytestmark = [pytest.mark.p2p, pytest.mark.timeout(90)]

RUN = "local-demo"  # configs/local.toml's run: the relay's hop joins its gossip topic
H = "cd" * 32
SHARDS = {i: bytes([i]) * (64 * 1024 + i) for i in range(6)}
PEER = "12D3KooWGzkxCDzV3nR2tuxGHG3UJiHXszTNZhvDzzSxvdCtY8dZ"


def node(shard_source=None) -> P2PNode:
    """A NATed node: outbound-only (listens on nothing), checking its NAT connections every 0.2 s."""
    return P2PNode(Identity.generate(), p2p_config(listen=False, allow_private_addrs=True), run_id=RUN,
                   shard_source=shard_source, nat_interval_s=0.2)




@contextlib.asynccontextmanager
async def relay_with_hop(tmp_path, *overrides: str):
    """The hop of a real `prime-node relay` process, listed in a real coordinator's p2p.relay_addrs. Yields
    (relay URL, hop address, the join response's p2p_bootstrap)."""
    async with running_coordinator(tmp_path, "p2p.relay_hop=false") as (coord, url):
        sets = [a for o in ("p2p.listen_host=127.0.0.1", "p2p.allow_private_addrs=true", *overrides)
                for a in ("--set", o)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "node.cli", "relay", "--upstream", url, "--upstream-key", coord.identity.public_hex,
            "--dir", str(tmp_path / "relay"), *sets, cwd=REPO, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log_tail: collections.deque[str] = collections.deque(maxlen=100)  # its log, drained so it never blocks

        async def drain():
            async for raw in proc.stderr:
                log_tail.append(raw.decode(errors="replace"))

        drainer = asyncio.create_task(drain())
        try:
            lines = {}
            while "relay hop" not in lines:
                try:
                    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
                except TimeoutError:
                    line = ""
                if not line:
                    raise AssertionError("the relay printed no hop address; its log:\n" + "".join(log_tail)[-3000:])
                what, _, value = line.strip().rpartition(" ")
                lines[what] = value
            relay_url, hop = lines["relay serving"], lines["relay hop"]
            # what an operator writes in the coordinator's config, checked as the config loader checks it
            coord.cfg.p2p.relay_addrs = P2PConfig(relay_addrs=[hop], allow_private_addrs=True).relay_addrs
            async with aiohttp.ClientSession() as s:
                status, spec = await RawNode(url, s).post("/v1/join", {})
            assert status == 200, spec
            yield relay_url, hop, spec["p2p_bootstrap"]
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            await drainer
        assert proc.returncode == 0, f"the relay exited with {proc.returncode}"  # a clean stop


async def hop_stats(relay_url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(relay_url + "/v1/status") as r:
        return json.loads(await r.read())["relay_hop_stats"]


def learn_have(of: P2PNode, at: P2PNode, addrs) -> None:
    """`at` records the signed `have` that `of` would gossip for step 1's SHARDS."""
    p2p_helpers.learn_have(of, at, addrs, run_id=RUN, manifest_hash=H, indices=SHARDS)


async def test_a_nated_node_serves_another_through_the_hop_of_prime_node_relay_within_its_limits(tmp_path):
    """One relay (one coordinator start, ~8 s here, is most of this test's time) for both: the hop carries a circuit,
    then with its one reservation slot taken, refuses a second NATed node."""
    async with relay_with_hop(tmp_path, "p2p.relay_max_reservations=1") as (relay_url, hop, bootstrap):
        assert len(bootstrap) == 2 and bootstrap[1] == hop, bootstrap  # the coordinator's own address, then the hop
        relay_peer = hop.rsplit("/", 1)[1]
        home = node(shard_source=lambda step, index: SHARDS.get(index) if step == 1 else None)
        async with running(home, node(), node()) as (home, other, second):
            await home.connect(bootstrap)
            home.apply_reachability("127.0.0.1", False, None)  # the join's dial-back found it unreachable
            circuits = await until("a circuit in the NATed node's announcement",
                                   lambda: [a for a in home.announce_addrs if is_circuit(a)])
            assert circuits == [f"{hop}/p2p-circuit/p2p/{home.peer_id}"]  # through the relay: the coordinator has no hop
            await other.connect(bootstrap)  # no route to `home` but the circuit: neither listens
            learn_have(home, other, home.announce_addrs)
            slots = asyncio.Semaphore(4)  # the fetcher's parallel downloads

            async def get(i):
                async with slots:
                    for attempt in range(4):  # what the fetcher does when a relayed transfer is cut: ask again
                        try:
                            return await other.fetch_shard(home.peer_id, 1, i, 1 << 20, manifest_hash=H)
                        except (ShardPeerGone, PeerUnavailable):
                            if attempt == 3:
                                raise

            assert await asyncio.gather(*map(get, SHARDS)) == list(SHARDS.values())
            out, served = await other.relay_stats(), await home.relay_stats()
            assert out["circuits_out"] >= 1 and served["circuits_in"] == out["circuits_out"], (out, served)
            assert home.stats.snapshot()["bytes_served"] == sum(map(len, SHARDS.values()))
            assert (await hop_stats(relay_url))["hop_reservations"] == 1  # the NATed node's, on the relay's hop

            # Hostile: a second NATed node wants the one slot. It is refused and announces no circuit through the
            # relay; the first keeps its own.
            await second.connect(bootstrap)
            second.apply_reachability("127.0.0.1", False, None)
            await until("the second node's refusal", lambda: relay_peer in second.nat_keeper.not_relays)
            assert not any(map(is_circuit, second.announce_addrs)), second.announce_addrs
            with pytest.raises(P2PError, match="RESOURCE_LIMIT_EXCEEDED"):
                await second.reserve_on(relay_peer)  # asked again: still refused
            stats = await hop_stats(relay_url)
            assert stats["hop_reservations"] == 1, stats
            assert home.announce_addrs == circuits


def test_relay_addrs_are_checked_like_every_peer_address(tmp_path):
    """Every node dials what p2p.relay_addrs lists: a loopback, private or malformed address is a config error
    (before this key, there was no way to list a relay's hop at all)."""
    good = f"/ip4/8.8.8.8/tcp/4001/p2p/{PEER}"
    assert load_config(None, [f'p2p.relay_addrs=["{good}"]']).p2p.relay_addrs == [good]
    for bad in (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}", f"/ip4/10.0.0.1/tcp/4001/p2p/{PEER}",
                "/ip4/8.8.8.8/tcp/4001", f"/dns4/relay.example/tcp/4001/p2p/{PEER}",
                f"/ip4/8.8.8.8/tcp/4001/p2p/{PEER}/p2p-circuit", f"/ip4/8.8.8.8/tcp/0/p2p/{PEER}"):
        with pytest.raises(ConfigError, match="relay_addrs"):
            load_config(None, [f'p2p.relay_addrs=["{bad}"]'])
    loopback = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"  # a swarm on one machine says so
    assert load_config(None, ["p2p.allow_private_addrs=true", f'p2p.relay_addrs=["{loopback}"]']).p2p.relay_addrs
    with pytest.raises(ConfigError, match="relay_addrs"):
        load_config(None, [f'p2p.relay_addrs={json.dumps([good] * 9)}'])
