"""The libp2p swarm as one shard source of the fetcher, plus batched "I hold shards" announcements.

Peers are untrusted like every source: the fetcher verifies each shard against the signed manifest
and reports a bad one here, which drops that peer (not the whole swarm) for the run.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, defaultdict

from node.p2p.errors import ShardBusy, ShardNotFound
from node.p2p.host import HOLDER_TRIES
from node.worker.sources import ShardDeferred, SourceError
from protocol.errors import PrimeNodeError
from protocol.messages import CheckpointList

log = logging.getLogger("prime_node.peers")


def _try(peer: str, rank: int, outcome: str, t0: float) -> str:
    return f"{peer[-6:]}/{rank}={outcome}/{time.monotonic() - t0:.3f}"


class PeerSource:
    kind = "peer"
    name = "peer:swarm"

    def __init__(self, p2p):
        self.p2p = p2p
        self.banned: set[str] = set()
        self._last: dict[tuple[int, int], str] = {}
        # the holders the last request for a shard tried, for the fetcher's per-step log line (`tries`)
        self._tries: OrderedDict[tuple[int, int], list[str]] = OrderedDict()

    @property
    def session(self):
        """The p2p node's HTTP client (None without `p2p.http`): the fetcher counts its new connections."""
        return getattr(self.p2p, "http_session", None)

    def _holders(self, step: int, index: int, manifest_hash: str) -> list[str]:
        return [p for p in self.p2p.peers_with(step, index, manifest_hash)
                if p not in self.banned and p != self.p2p.peer_id]

    def holders(self, step: int, index: int, manifest_hash: str) -> int:
        return len(self._holders(step, index, manifest_hash))

    async def listing(self) -> CheckpointList:
        raise SourceError("peers do not list checkpoints")

    async def manifest(self, step: int) -> bytes:
        raise SourceError("manifests come from the coordinator or a relay")

    async def shard(self, step: int, index: int, max_bytes: int, offset: int = 0, *,
                    manifest_hash: str | None = None) -> bytes:
        """From a random holder among the freshest announcers; a busy or vanished peer costs a try
        of the next one, not a failure of the swarm."""
        holders = self._holders(step, index, manifest_hash) if manifest_hash else []
        if not holders:
            raise SourceError(f"no peer holds shard {index} of step {step}")
        random.shuffle(holders)
        # random within a rank, ranks in order: direct holders before relayed ones (a circuit costs the relay's
        # uplink and a second Noise layer) before those we cannot dial (node/p2p/host.py holder_rank)
        holders.sort(key=self.p2p.holder_rank)
        errors, busy = [], 0
        while len(self._tries) >= 256:  # a source nobody reads `tries` of keeps no more
            self._tries.popitem(last=False)
        tries = self._tries[(step, index)] = []
        for peer in holders[:HOLDER_TRIES]:
            self._last[(step, index)] = peer
            t0, rank = time.monotonic(), self.p2p.holder_rank(peer)
            try:
                data = await self.p2p.fetch_shard(peer, step, index, max_bytes, manifest_hash=manifest_hash)
                tries.append(_try(peer, rank, "ok", t0))
                return data
            except ShardBusy as e:
                busy += 1
                errors.append(f"{peer[:12]}: {e}")
                tries.append(_try(peer, rank, "busy", t0))
            except ShardNotFound as e:  # its claim (gossip, or its server's bitfield) was wrong or stale
                self.p2p.table.drop_shard(peer, step, index)
                errors.append(f"{peer[:12]}: {e}")
                tries.append(_try(peer, rank, "notheld", t0))
            except PrimeNodeError as e:
                errors.append(f"{peer[:12]}: {e}")
                tries.append(_try(peer, rank, type(e).__name__, t0))
        if busy == len(errors):  # every holder is saturated: try another shard, come back shortly
            raise ShardDeferred(f"every holder of shard {index} of step {step} is busy")
        raise SourceError("; ".join(errors))

    def tries(self, step: int, index: int) -> str:
        """The holders the last request for this shard tried, each as `<peer id's last 6>/<rank>=<outcome>/<s>`
        (rank: node/p2p/host.py holder_rank, 0 direct, 1 relayed, 2 no address, 3 failed lately); forgotten
        once read, and kept for at most 256 shards."""
        return ",".join(self._tries.pop((step, index), ()))

    def hint(self, step: int, manifest_hash: str, index: int, node_id: str, addr: str) -> None:
        """The origin says `node_id` got shard `index` from it and serves it at `addr`: its HTTP shard server
        (/ip4/<ip>/tcp/<port>/http: kept as is) or its libp2p address (/ip4/<ip>/tcp/<port>: the peer id, derived
        from the node id, is appended so that libp2p can dial it; before, a libp2p-only node dropped the hint and
        waited for gossip that reached few nodes in time). Untrusted like any announcement (the shard is verified
        whoever serves it); only a literal-IP address our address policy allows is kept."""
        from node.p2p.addrs import multiaddr_allowed, tcp_endpoint
        from node.p2p.http_shards import is_http_addr, url_of
        from node.p2p.keys import peer_id_for_node

        allow = self.p2p.cfg.allow_private_addrs
        try:
            peer = peer_id_for_node(node_id).to_base58()
        except ValueError:
            return
        if peer == self.p2p.peer_id:
            return
        if is_http_addr(addr):
            if url_of(addr, allow_private=allow) is None:
                return
        else:
            if tcp_endpoint(addr) is None:  # /ip4|ip6/<literal IP>/tcp/<port>, nothing after it
                return
            addr = f"{addr}/p2p/{peer}"
            if not multiaddr_allowed(addr, allow):
                return
        self.p2p.table.record_hint(peer, step, manifest_hash, (index,), addr)

    def first_holders(self, step: int) -> list[tuple[int, str, str]]:
        return []  # peers name no one: the origin does (HttpSource)

    def report_bad(self, step: int, index: int) -> bool:
        peer = self._last.get((step, index))
        if peer:
            self.banned.add(peer)
            log.warning("dropping peer %s for this run: it served a bad shard %d of step %d", peer, index, step)
        return True


class HaveAnnouncer:
    """Collects verified shard indices and announces them in batches (gossip has a rate limit).

    Every announcement is relayed to every node, so the swarm's gossip load grows with N² / interval.
    The batch interval therefore grows with the number of peers heard from (N / 8 seconds, at least
    `interval`): on a 2-core box, 8 nodes announcing every 50 ms spent more CPU on gossip than on
    shards (bench/broadcast.py: 3.3x one copy's time at 50 ms, 1.14x at 1 s). A NATed node waits twice as long
    (`batch_seconds`) and names only the shards a fetcher could ask it for (P2PNode.worth_naming)."""

    def __init__(self, p2p, interval: float = 0.3, peers_per_second: float = 8.0):
        self.p2p = p2p
        self.interval = interval
        self.peers_per_second = peers_per_second
        self._pending: dict[tuple[int, str], set[int]] = defaultdict(set)
        self._wake = asyncio.Event()

    def batch_seconds(self) -> float:
        """N / 8 seconds, within [interval, 5]; twice that for a node the coordinator could not dial back: its
        `have` names only shards with few direct holders known (P2PNode.worth_naming), and a fetcher asks
        direct holders first anyway, so it waits to hear of them before it announces."""
        base = max(self.interval, min(5.0, self.p2p.table.peer_count() / self.peers_per_second))
        return 2 * base if self.p2p.reachable is False else base

    def add(self, step: int, manifest_hash: str, indices) -> None:
        if not indices:
            return
        self._pending[(step, manifest_hash)].update(indices)
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                continue
            await asyncio.sleep(self.batch_seconds())  # let a few more shards join the batch
            self._wake.clear()
            batch, self._pending = self._pending, defaultdict(set)
            for (step, h), idx in batch.items():
                try:
                    await self.p2p.announce_have(step, sorted(idx), h)
                except Exception as e:  # announcing is best effort; downloads go on without it
                    log.debug("announce failed: %s", e)
