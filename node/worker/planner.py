"""Which shard to fetch next and from which source: pure decisions, no IO and no clock (the caller
passes `now`), so every rule is unit-tested without a network and a simulator can drive the same code
(bench/swarm_sim.py).

Shards. With peers in the swarm, each node first takes the rarest shard that some peer already holds
(random among equals); otherwise it takes a shard nobody holds yet from the origin, one at a time
(`origin_slots`), starting at a place of its own so that the swarm asks the origin for different
shards and trades the rest. A shard the origin deferred ("fetch it from a peer") is not asked of the
origin again for `origin_defer_s`, and it may still be fetched from peers; a shard whose every holder
was busy waits `peers_busy_s`.

Steps. A node that is behind fetches every step it needs in one go (`steps_to_fetch`): the newest listed
step and the xor-delta bases it needs, back to a step it holds or to a full checkpoint, whichever comes
first walking back (so a node far behind goes straight to the newest full checkpoint and its deltas,
skipping everything before it), plus, for a verifier's window, every listed step down to newest - window.

Sources. Peers first, then relays, then the coordinator (the origin's uplink is the scarce resource);
a source that served a bad shard is banned for the run, except the coordinator when it is the only
source left (a transient fault there would otherwise end the run).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol

SOURCE_RANK = {"peer": 0, "relay": 1, "coordinator": 2}


class Listed(Protocol):
    """What the step plan reads of a listing entry (protocol.messages.CheckpointInfo)."""

    @property
    def base_step(self) -> int | None: ...  # None: a full checkpoint; else strictly older (the wire model checks it)


class MissingBase(ValueError):
    """A step needed by the plan is not listed (pruned meanwhile, or a listing that lies)."""

    def __init__(self, step: int):
        super().__init__(f"step {step} is needed but no longer published")
        self.step = step


def steps_to_fetch(held: Iterable[int], listed: Mapping[int, Listed], *, window: int = 0) -> list[int]:
    """The steps to download, oldest first, so that the newest listed step is held (and, with `window` > 0,
    every listed step in [newest - window, newest]): each target with the bases it needs, back to a step
    held or a full one. Nothing held is fetched again; every step comes after its base. Pure: `held` and
`listed` in, the plan out."""
    held = set(held)
    if not listed:
        return []
    newest = max(listed)
    if window > 0:
        targets = {s for s in listed if s >= newest - window}
    else:  # a listing older than what we hold (a lagging relay) asks for nothing
        targets = {newest} if newest > max(held, default=-1) else set()
    plan: set[int] = set()
    for step in targets - held:
        while step not in plan:
            entry = listed.get(step)
            if entry is None:
                raise MissingBase(step)
            plan.add(step)
            if entry.base_step is None or entry.base_step in held:
                break
            step = entry.base_step
    return sorted(plan)


@dataclass(frozen=True)
class Pick:
    index: int
    from_origin: bool  # no peer held it when it was picked


@dataclass(frozen=True)
class Wait:
    until: float | None  # a deferral runs out then; None: only news from peers can unblock


class ShardPlanner:
    def __init__(self, num_shards: int, todo: Iterable[int], *, swarm: bool, start: int | None = None,
                 origin_slots: int = 1, origin_defer_s: float = 2.0, peers_busy_s: float = 0.2,
                 rng: random.Random | None = None):
        self.rng = rng or random.Random()
        self.remaining = set(todo)
        self.swarm = swarm
        start = self.rng.randrange(num_shards) if start is None else start
        self.order = sorted(range(num_shards), key=lambda i: (i - start) % num_shards)
        self.origin_slots = origin_slots
        self.origin_defer_s, self.peers_busy_s = origin_defer_s, peers_busy_s
        self.origin_busy = 0
        self.origin_wait: dict[int, float] = {}
        self.peers_wait: dict[int, float] = {}

    @property
    def finished(self) -> bool:
        return not self.remaining

    def take(self, now: float, holders: Mapping[int, int]) -> Pick | Wait:
        """The next shard for a free download slot. `holders`: shard -> how many peers hold it."""
        with_peers = [i for i in self.remaining if holders.get(i, 0) > 0 and self.peers_wait.get(i, 0) <= now]
        if with_peers:
            rarest = min(holders[i] for i in with_peers)
            i = self.rng.choice(sorted(i for i in with_peers if holders[i] == rarest))
            self.remaining.discard(i)
            return Pick(i, from_origin=False)
        first = next((x for x in self.order if x in self.remaining and self.origin_wait.get(x, 0) <= now), None)
        if first is None or (self.swarm and self.origin_busy >= self.origin_slots):
            waits = [t for t in (*self.origin_wait.values(), *self.peers_wait.values()) if t > now]
            return Wait(min(waits, default=None))
        self.remaining.discard(first)
        self.origin_busy += 1
        return Pick(first, from_origin=True)

    def done(self, pick: Pick) -> None:
        self._release(pick)

    def failed(self, pick: Pick) -> None:
        """The fetch failed for good this round: the shard goes back to be picked again."""
        self._release(pick)
        self.remaining.add(pick.index)

    def deferred(self, pick: Pick, now: float) -> None:
        """The origin (or every holding peer) said "not now"."""
        self.failed(pick)
        if pick.from_origin:
            self.origin_wait[pick.index] = now + self.origin_defer_s
        else:
            self.peers_wait[pick.index] = now + self.peers_busy_s

    def _release(self, pick: Pick) -> None:
        if pick.from_origin:
            self.origin_busy -= 1


@dataclass
class SourceScore:
    """Measured throughput and failures of one source; a source that served a bad shard is banned."""

    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    banned: bool = False

    def rate(self) -> float:
        return (self.bytes + 1e6) / (self.seconds + 0.1) / (1 + self.failures)


@dataclass
class SourceBook:
    """Scores and bans of the sources of one fetcher, across steps. Sources are named (`name`, `kind`)."""

    scores: dict[str, SourceScore] = field(default_factory=dict)

    def score(self, name: str) -> SourceScore:
        return self.scores.setdefault(name, SourceScore())

    def usable(self, sources: Iterable) -> list:
        """Not banned, fastest first (for listings and manifests)."""
        return sorted((s for s in sources if not self.score(s.name).banned), key=lambda s: -self.score(s.name).rate())

    def for_shard(self, sources: Iterable) -> list:
        """The order to try sources for a shard: peers, relays, then the coordinator."""
        return sorted(self.usable(sources), key=lambda s: SOURCE_RANK.get(s.kind, 1))

    def served(self, name: str, n_bytes: int, seconds: float) -> None:
        sc = self.score(name)
        sc.bytes += n_bytes
        sc.seconds += seconds

    def failed(self, name: str) -> None:
        self.score(name).failures += 1

    def ban(self, source, sources: Iterable) -> bool:
        """Ban `source` for the run; refused (False) for the coordinator when it is the last one left."""
        usable = [s for s in sources if not self.score(s.name).banned]
        if source.kind == "coordinator" and len(usable) == 1:
            return False
        self.score(source.name).banned = True
        return True
