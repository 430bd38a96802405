"""The worker's fetch loop (a relay runs the same one): learn the newest step, download its shards in
parallel from every source, verify each against the signed manifest, rebuild the payload (applying
xor-deltas to the base it holds, merging a LoRA adapter into the full step it pins unless the store keeps adapters
unmerged), keep the last k + 1 versions, and hand new weights on.

Three parts, each with one job: `TrustedManifests` decides which manifests to believe (no IO),
`ShardPlanner` / `SourceBook` decide which shard to fetch next and from where (no IO), and `Fetcher`
does the IO: its download slots live in one TaskGroup per step, so when one fails the others stop
before the step is retried. The on-disk layout is `CheckpointDir`'s.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

from node.aio import client_counts, sleep_or_stop, wait_any
from node.backoff import Backoff
from node.checkpoint_dir import CheckpointDir
from node.worker.planner import MissingBase, Pick, ShardPlanner, SourceBook, SourceScore, Wait, steps_to_fetch
from node.worker.sources import BadAnswer, ShardDeferred, ShardSource, SourceError
from node.worker.trusted import TrustedManifests
from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, check_parent, merge_adapter_payload,
                                 reconstruct_payload, verify_shard)
from protocol.messages import CheckpointList

log = logging.getLogger("prime_node.fetcher")

MANIFESTS_IN_FLIGHT = 16  # manifests are small (a few KB): a node 16 steps behind asks for all in one round trip


class FetchError(Exception):
    pass


class NoManifest(FetchError):
    """No source had a valid manifest for a step a listing named."""


class Fetcher:
    def __init__(self, store: CheckpointDir, sources: Sequence[ShardSource], trusted_key: str, *, keep: int,
                 on_new_step: Callable[[int, Path], None],
                 on_shards: Callable[[int, str, list[int]], None] | None = None,
                 in_use: Callable[[], Iterable[int]] = tuple, parallel: int = 8, progress: bool = False,
                 window: int = 0, small_step_bytes: int = 4 << 20):
        self.store = store
        self.sources = list(sources)
        self.trusted = TrustedManifests(trusted_key)
        self.keep = keep  # k + 1 versions
        # > 0 (a verifier: the async window k): also hold every listed step down to newest - window, not only
        # the newest and its delta chain (a jump to a newest full checkpoint would skip the steps before it)
        self.window = window
        self.on_new_step = on_new_step
        self.on_shards = on_shards or (lambda step, manifest_hash, indices: None)  # verified: we can serve them
        self.in_use = in_use  # steps whose payload an engine holds or is loading: never pruned under it
        self.parallel = parallel
        # Shard requests in flight, across every step being fetched: each costs a round trip before its first
        # byte, so a step of many small shards (a delta keeps the full checkpoint's shard count) is fetched
        # in shards / parallel round trips; each also holds one kept-alive connection to its source.
        self._slots = asyncio.Semaphore(parallel)
        self.small_step_bytes = small_step_bytes  # a step this small is asked of the origin all at once
        self.requests = 0  # listings, manifests and shards asked for (the log line of each sync says per step)
        self.steps_fetched = 0
        self.progress = progress
        self.book = SourceBook()
        self.bytes_by_kind: Counter[str] = Counter()
        self.wake = asyncio.Event()  # a new step was announced: look now
        self._news = asyncio.Event()  # a peer announced shards: waiting slots look again

    def score(self, src: ShardSource) -> SourceScore:
        return self.book.score(src.name)

    def announce_change(self) -> None:
        """Wake every download slot waiting for a shard to become available (a peer announced one)."""
        self._news.set()
        self._news.clear()

    @property
    def newest_held(self) -> int:
        held = self.store.held_steps()
        return held[-1] if held else -1

    async def run(self, stop: asyncio.Event, poll_seconds: float = 1.0) -> None:
        """Fetch loop: poll for new steps until `stop` is set; errors are logged and retried."""
        backoff = Backoff(1.0, 30.0)
        while not stop.is_set():
            # Cleared before the sync, not after: an announcement that arrives while a sync is under way (after
            # its listing) must start another sync at once, not wait for the next poll (at N = 6 on loopback
            # half the syncs waited the full 1 s; docs/BENCHMARKS.md, "Where a delta's seconds go").
            self.wake.clear()
            try:
                await self.sync_once()
                backoff.reset()
            except (FetchError, SourceError, CheckpointError) as e:
                delay = backoff.next()
                log.warning("fetch failed (%s); retrying in %.1f s", e, delay)
                await sleep_or_stop(stop, delay)
                continue
            await wait_any(stop, self.wake, timeout=poll_seconds)

    async def listing(self) -> tuple[ShardSource, CheckpointList]:
        """The listing of the fastest source that gives one, and that source. A source whose answer is not a
        listing (BadAnswer: garbage, wrong types, over the size cap) is banned for the run, and the next
        is asked: a hostile relay costs one request, never the loop."""
        errors = []
        for src in self.book.usable(self.sources):
            try:
                return src, await src.listing()
            except BadAnswer as e:
                self._ban(src, f"bad listing: {e}")
                errors.append(str(e))
            except SourceError as e:
                errors.append(str(e))
        raise FetchError("no source could list checkpoints: " + "; ".join(errors or ["no sources"]))

    async def sync_once(self) -> int | None:
        """Bring the store up to the newest published step (and, for a verifier, fill its window) in one go:
        the listing, then every needed manifest at once, then the shards of every needed step in flight
        together, each step rebuilt in order. Returns the newest step fetched, or None."""
        t0, sent0, conns0, peer0 = time.monotonic(), self.requests, self._connects(), self._peer_counts()
        early = None
        # The next step's manifest is asked for together with the listing, so a node one step behind spends
        # one round trip less (a guess that misses costs one small request, a 404, never a wait).
        if (guess := self.newest_held + 1) > 0 and (usable := self.book.usable(self.sources)):
            early_task = asyncio.create_task(self._ask_manifest(usable[0], guess))
            try:
                lister, listing = await self.listing()
            except BaseException:
                early_task.cancel()
                raise
            raw = await early_task
            early = (usable[0], guess, raw) if raw is not None else None
        else:
            lister, listing = await self.listing()
        self.requests += 1
        try:
            steps = steps_to_fetch(self.store.held_steps(), listing.by_step(), window=self.window)
        except MissingBase as e:
            raise FetchError(f"{e}; retrying from the newest full") from None
        if not steps:
            return None
        try:
            await self.fetch_steps(steps, early)
        except NoManifest:
            # The listing named a step no source could back with a signed manifest (a lying lister, or one
            # that pruned it meanwhile): count it against the lister, so the next listing comes from another.
            self.book.failed(lister.name)
            raise
        self.prune()
        self.steps_fetched += len(steps)
        peer1 = self._peer_counts()
        log.info("fetched steps %s in %.3f s: %d requests, %d new connections; peers over HTTP %d requests, "
                 "%d new connections", _span(steps), time.monotonic() - t0, self.requests - sent0,
                 self._connects() - conns0, peer1["requests"] - peer0["requests"], peer1["connects"] - peer0["connects"])
        return steps[-1]

    def _connects(self) -> int:
        """TCP connections opened so far by the HTTP sources' sessions (the origin's, relays')."""
        sessions = {id(x): x for x in (getattr(s, "session", None) for s in self.sources if s.kind != "peer")
                    if x is not None}
        return sum(client_counts(x)["connects"] for x in sessions.values())

    def _peer_counts(self) -> Counter[str]:
        """Requests sent and connections opened so far by the peers' HTTP client (a round trip each: a peer's
        shard on a kept-alive connection costs one, on a new one at least one more and TCP's slow start)."""
        peer = next((s for s in self.sources if s.kind == "peer"), None)
        session = getattr(peer, "session", None)
        return Counter(client_counts(session)) if session is not None else Counter()

    async def fetch_steps(self, steps: list[int], early: tuple[ShardSource, int, bytes] | None = None) -> None:
        """Fetch `steps` (oldest first, each after its base) together: their manifests asked for at once, their
        shards downloaded at once (at most `parallel` requests in flight across all of them), each step
        rebuilt, committed and handed on in order as soon as it and the step before it are complete (a delta
        needs its base). A failure stops the rest; whatever was committed stays, partial shards are kept."""
        manifests = await self._manifests(steps, early)
        done = {s: asyncio.Event() for s in steps}

        async def one(i: int, step: int) -> None:
            await self._download(manifests[step])
            if i:
                await done[steps[i - 1]].wait()
            await self._commit(manifests[step])
            self.on_new_step(step, self.store.weights_path(step))
            done[step].set()

        try:
            async with asyncio.TaskGroup() as tg:  # one step failing stops the others before a retry
                for i, step in enumerate(steps):
                    tg.create_task(one(i, step))
        except ExceptionGroup as eg:
            errors = _leaves(eg)
            known = [e for e in errors if isinstance(e, (FetchError, SourceError, CheckpointError))]
            if len(known) == len(errors):
                raise known[0] from None
            raise

    def prune(self) -> None:
        """Keep the newest `keep` steps plus the delta chain back to a full checkpoint (so peers and relays can
        serve a node that holds nothing), but reconstructed payloads (a full model each, 269 MB for SmolLM2) only
        of the newest `keep` steps and of the steps in use: the next delta applies to the newest, and the chain
        is served from its shard files. (Every payload of the chain was kept before: with `full_every = 1000` a
        home node's disk grew by a full model a step.) The chain is followed through complete steps, not held
        payloads, or the second prune would drop the chain the first one kept."""
        held, complete = self.store.held_steps(), set(self.store.steps())
        recent = held[-self.keep:] if self.keep > 0 else []
        in_use = set(self.in_use()) & complete
        kept: set[int] = set(in_use)
        for s in recent:
            kept.update(self.store.chain_to_full(s, complete))
        # a LoRA adapter's base (the full step 0) stays whole, payload too: the next adapter merges into it
        self.store.prune(kept, keep_payloads=set(recent) | in_use | self.store.adapter_bases(recent))

    async def _manifests(self, steps: list[int], early: tuple[ShardSource, int, bytes] | None = None
                         ) -> dict[int, Manifest]:
        """The verified manifests of `steps` (oldest first). All are asked of the fastest source at once (one
        round trip; `early`: one asked already, alongside the listing), then accepted in order, each against
        the one before it (no rollback, parent chain); a step whose manifest that source cannot give, or gives
        bad, is asked of the others one by one."""
        got: dict[int, tuple[ShardSource, bytes]] = {}
        if early is not None and early[1] in steps:
            got[early[1]] = (early[0], early[2])
        usable = self.book.usable(self.sources)
        if usable and (ask := [s for s in steps if s not in got]):
            gate = asyncio.Semaphore(MANIFESTS_IN_FLIGHT)

            async def one(step: int) -> None:
                async with gate:
                    if (r := await self._ask_manifest(usable[0], step)) is not None:
                        got[step] = (usable[0], r)

            await asyncio.gather(*(one(s) for s in ask))
        accepted: dict[int, Manifest] = {}
        for step in steps:
            if step in got and not self.score(got[step][0]).banned:
                src, raw = got[step]
                try:
                    accepted[step] = self._accept(raw, step, accepted)
                    continue
                except CheckpointError as e:
                    self._ban(src, f"bad manifest for step {step}: {e}")
            accepted[step] = await self._manifest(step, accepted)
        return accepted

    async def _ask_manifest(self, src: ShardSource, step: int) -> bytes | None:
        """The untrusted bytes `src` gives as the manifest of `step`, or None if it gives none."""
        self.requests += 1
        try:
            return await src.manifest(step)
        except SourceError:
            return None

    def _accept(self, raw: bytes, step: int, pending: dict[int, Manifest]) -> Manifest:
        """`raw` as the manifest of `step`, moving forward from the newest step held or accepted below it; when
        the window is filled in below a step already held, the held child must also name it as its parent."""
        def known(s: int) -> Manifest | None:
            return pending.get(s) or self.store.manifest(s)

        below = [s for s in (*self.store.held_steps(), *pending) if s < step]
        m = self.trusted.accept(raw, step, newest_held=known(max(below)) if below else None, parent=known(step - 1))
        if (child := known(step + 1)) is not None:
            check_parent(child, m)  # a CheckpointError: a bad manifest
        return m

    async def _manifest(self, step: int, pending: dict[int, Manifest]) -> Manifest:
        """The manifest of `step`, asked of each usable source in turn."""
        errors = []
        for src in self.book.usable(self.sources):
            try:
                self.requests += 1
                return self._accept(await src.manifest(step), step, pending)
            except SourceError as e:
                errors.append(str(e))
            except CheckpointError as e:
                self._ban(src, f"bad manifest for step {step}: {e}")
                errors.append(str(e))
        raise NoManifest(f"no valid manifest for step {step}: " + "; ".join(errors or ["no sources"]))

    def _ban(self, src: ShardSource, why: str) -> None:
        if self.book.ban(src, self.sources):
            log.warning("dropping source %s for this run: %s", src.name, why)
        else:
            log.warning("%s: %s (it is the only source; not banned)", src.name, why)

    async def _download(self, m: Manifest) -> None:
        """Every shard of `m` into its partial directory, verified; download slots share the fetcher's
        `parallel` request slots with the other steps in flight."""
        step, h = m.step, m.canonical_hash()
        self.store.begin(step, m)
        have = [i for i in range(m.num_shards) if await asyncio.to_thread(self._have_shard, m, i)]
        self.on_shards(step, h, have)
        # the first copies' holders the origin named with its manifest: those shards go to them at once, not to
        # the origin first (which would answer 429 naming the same holder, a round trip later)
        for index, node_id, addr in [x for src in self.sources for x in src.first_holders(step)]:
            if index < m.num_shards and index not in have:
                self._hint(step, h, index, [(node_id, addr)])
        swarm = any(s.kind == "peer" for s in self.sources)
        # In a swarm a node asks the origin for one shard at a time and trades for the rest; a step of a few
        # shards (a delta) costs more in round trips than in origin bytes, so it is asked for all at once
        # (the origin still defers what is already spreading).
        small = m.compressed_size <= self.small_step_bytes
        planner = ShardPlanner(m.num_shards, (i for i in range(m.num_shards) if i not in have), swarm=swarm,
                               origin_slots=self.parallel if small else 1)
        bar = _bar(self.progress, m.compressed_size, f"step {step}")
        bar.update(sum(m.shards[i].zsize for i in have))
        t0 = time.monotonic()
        traces = {i: _ShardTrace(t0) for i in planner.remaining}

        async def slot() -> None:
            while not planner.finished:
                async with self._slots:
                    holders = {i: self._holders(step, i, h) for i in planner.remaining}
                    pick = planner.take(time.monotonic(), holders)
                    if not isinstance(pick, Wait):
                        trace = traces[pick.index]
                        trace.picked(time.monotonic())
                        try:
                            self.requests += 1
                            await self._fetch_shard(m, pick, trace)
                        except ShardDeferred as e:  # the origin or every holding peer said "not now"
                            trace.ready = time.monotonic()
                            planner.deferred(pick, time.monotonic())
                            if e.holders:  # the origin named who got the first copy: ask it now
                                self._hint(step, h, pick.index, e.holders)
                                self.announce_change()
                            continue
                        except BaseException:
                            planner.failed(pick)
                            raise
                        planner.done(pick)
                        bar.update(m.shards[pick.index].zsize)
                        self.on_shards(step, h, [pick.index])
                        self.announce_change()
                        continue
                # wait (not holding a slot) for a peer's news, or for a deferral to run out
                timeout = 0.25 if pick.until is None else max(0.01, pick.until - time.monotonic())
                await wait_any(self._news, timeout=min(timeout, 0.25))

        try:
            async with asyncio.TaskGroup() as tg:  # one slot failing stops the others before a retry
                for _ in range(min(self.parallel, len(planner.remaining))):
                    tg.create_task(slot())
        finally:
            bar.close()
        if traces:  # one line a step: where its shards' seconds went (bench/wan.py --scale reads it)
            log.info("shards of step %d in %.3f s: %s", step, time.monotonic() - t0,
                     " | ".join(f"{i} {traces[i]}" for i in sorted(traces)))

    async def _commit(self, m: Manifest) -> None:
        """Rebuild the payload of a downloaded step (on its base, for a delta) and make it visible."""
        step, base = m.step, None
        if m.encoding == "xor-delta":
            assert m.base_step is not None  # the manifest requires it of a delta
            base = self.store.payload_path(m.base_step)
            if not base.is_file():
                raise FetchError(f"step {step} is a delta against step {m.base_step}, which is not held")
        partial = self.store.partial_dir(step)
        tmp = partial / "payload.tmp"
        # an engine serving adapters unmerged takes the adapter itself: rebuilt, never merged (its base held all the
        # same: the engine loads that first)
        unmerged = m.is_adapter and self.store.unmerged_adapters
        if m.is_adapter:
            base_manifest, base_payload = self._adapter_base(m)
        if m.is_adapter and not unmerged:  # the adapter rebuilt alone, then merged into its pinned base
            adapter = partial / "adapter.tmp"
            await asyncio.to_thread(reconstruct_payload, m, DirShardReader(partial, m), adapter)
            await asyncio.to_thread(merge_adapter_payload, m, adapter, base_manifest, base_payload, tmp)
            adapter.unlink(missing_ok=True)
        else:
            await asyncio.to_thread(reconstruct_payload, m, DirShardReader(partial, m), tmp, base_payload=base)
        self.store.commit(step, m, tmp, unmerged_adapter=unmerged)
        log.info("holding step %d (%s%s, %d shards, %.2f MB)", step, m.encoding, ", unmerged" if unmerged else "",
                 m.num_shards, m.compressed_size / 1e6)

    def _adapter_base(self, m: Manifest) -> tuple[Manifest, Path]:
        """The held full step a LoRA adapter applies to: its manifest (checked against the pinned hash by
        merge_adapter_payload) and its payload."""
        assert m.base_step is not None  # the manifest requires it of an adapter
        base_manifest, base = self.store.manifest(m.base_step), self.store.payload_path(m.base_step)
        if base_manifest is None or not base.is_file():
            raise FetchError(f"step {m.step} is a LoRA adapter on step {m.base_step}, which is not held")
        return base_manifest, base

    def _hint(self, step: int, manifest_hash: str, index: int, holders: list[tuple[str, str]]) -> None:
        """Holders the origin named for a shard ((node id, address), with its manifest or its 429): every source
        records them (the swarm's peer table; a server ignores them)."""
        for src in self.sources:
            for node_id, addr in holders:
                src.hint(step, manifest_hash, index, node_id, addr)

    def _holders(self, step: int, index: int, manifest_hash: str) -> int:
        return sum(s.holders(step, index, manifest_hash) for s in self.sources if not self.score(s).banned)

    def _have_shard(self, m: Manifest, i: int) -> bool:
        p = self.store.partial_shard_path(m.step, i)
        if not p.is_file() or p.stat().st_size != m.shards[i].zsize:
            return False
        try:
            verify_shard(m, i, p.read_bytes())
            return True
        except CheckpointError:
            p.unlink(missing_ok=True)
            return False

    async def _fetch_shard(self, m: Manifest, pick: Pick, trace: _ShardTrace | None = None) -> None:
        i, entry, h = pick.index, m.shards[pick.index], m.canonical_hash()
        trace = trace or _ShardTrace(time.monotonic())
        final = self.store.partial_shard_path(m.step, i)
        part = final.with_name(final.name + ".part")
        attempts = 0
        while True:
            candidates = [s for s in self.book.for_shard(self.sources)
                          if s.kind != "peer" or s.holders(m.step, i, h) > 0]
            if not candidates:
                raise FetchError(f"no source can serve shard {i} of step {m.step}")
            src = candidates[attempts % len(candidates)]
            attempts += 1
            offset = part.stat().st_size if part.exists() and src.kind != "peer" else 0
            if offset >= entry.zsize:
                part.unlink(missing_ok=True)
                offset = 0
            t0 = time.monotonic()
            try:
                data = await src.shard(m.step, i, entry.zsize, offset, manifest_hash=h)
            except ShardDeferred:
                trace.tried(src, m.step, i, "defer", t0)
                raise
            except BadAnswer as e:  # e.g. more bytes than signed: as bad as a shard that fails its hash
                trace.tried(src, m.step, i, "bad", t0)
                part.unlink(missing_ok=True)
                if not src.report_bad(m.step, i):
                    self._ban(src, f"shard {i} of step {m.step}: {e}")
                if attempts >= 3 * max(1, len(candidates)) + 3:  # the ban was refused: the last source left
                    raise FetchError(f"shard {i} of step {m.step}: {e}") from None
                continue
            except SourceError as e:
                trace.tried(src, m.step, i, "err", t0)
                self.book.failed(src.name)
                if e.data and src.kind != "peer":  # keep what arrived; the next try asks for the rest
                    with open(part, "ab") as f:
                        f.write(e.data)
                if attempts >= 3 * max(1, len(candidates)) + 3:
                    raise FetchError(f"shard {i} of step {m.step}: {e}") from None
                await asyncio.sleep(min(0.2 * attempts, 2.0))
                continue
            trace.tried(src, m.step, i, "ok", t0, len(data))
            self.book.served(src.name, len(data), time.monotonic() - t0)
            self.bytes_by_kind[src.kind] += len(data)
            whole = (part.read_bytes() + data) if offset else data
            try:  # a shard's sha256 is up to 64 MiB of hashing: not on the event loop
                await asyncio.to_thread(verify_shard, m, i, whole)
            except CheckpointError as e:
                part.unlink(missing_ok=True)
                if not src.report_bad(m.step, i):  # a swarm source drops the one peer, not every peer
                    self._ban(src, f"shard {i} of step {m.step} failed verification: {e}")
                continue
            tmp = final.with_suffix(".tmp")
            await asyncio.to_thread(tmp.write_bytes, whole)
            os.replace(tmp, final)
            part.unlink(missing_ok=True)
            return


class _ShardTrace:
    """Where one shard's seconds went, for the per-step log line: each request (source kind, outcome, seconds,
    bytes) and the time it waited unpicked (for a free slot at first, then for a deferral to run out or a peer
    to announce it). Printed as e.g. `wait 0.00 coordinator defer 0.081 wait 1.92 peer ok 0.153 118KB [pYq3Xa/0=ok/0.150]`
    (a swarm request's holders in brackets: peers.py PeerSource.tries)."""

    __slots__ = ("ready", "parts")

    def __init__(self, ready: float):
        self.ready = ready  # since when it could have been picked
        self.parts: list[str] = []

    def picked(self, now: float) -> None:
        self.parts.append(f"wait {now - self.ready:.2f}")

    def tried(self, src, step: int, index: int, outcome: str, t0: float, n_bytes: int = 0) -> None:
        """A request to `src` that began at `t0` ended with `outcome`."""
        tries = getattr(src, "tries", None)  # a swarm source says which holders it tried
        via = tries(step, index) if tries else ""
        self.parts.append(f"{src.kind} {outcome} {time.monotonic() - t0:.3f}"
                          + (f" {n_bytes // 1000}KB" if n_bytes else "") + (f" [{via}]" if via else ""))

    def __str__(self) -> str:
        return " ".join(self.parts)


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions in a (nested) exception group."""
    out: list[BaseException] = []
    for e in eg.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


class _NoBar:
    def update(self, n): ...
    def close(self): ...


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)
