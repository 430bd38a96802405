"""The worker's fetch loop: learn the newest step, download its shards in parallel from every known
source, verify each against the signed manifest, rebuild the payload (applying xor-deltas to the
base it holds), keep the last k + 1 versions, and hand new weights to the work loop.

On disk (worker.storage_dir):
    checkpoints/{step}/              complete, verified checkpoints (served to peers as they are)
    checkpoints/.partial-{step}/     shards verified so far (a restart resumes from here) + *.part
    payloads/{step}.safetensors      reconstructed weights (the next delta's base)
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from node.aio import sleep_or_stop, wait_any
from node.worker.sources import ShardDeferred, ShardSource, SourceError
from protocol.checkpoint import (CheckpointError, DirShardReader, Manifest, check_parent, reconstruct_payload,
                                 shard_file_name, verify_manifest, verify_shard)

log = logging.getLogger("prime_node.fetcher")


SOURCE_RANK = {"peer": 0, "relay": 1, "coordinator": 2}


class FetchError(Exception):
    pass


@dataclass
class SourceScore:
    """Measured throughput and failures of one source; a source that served a bad shard is banned."""

    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    banned: bool = False

    def rate(self) -> float:
        return (self.bytes + 1e6) / (self.seconds + 0.1) / (1 + self.failures)


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.ckpt_dir = self.root / "checkpoints"
        self.payload_dir = self.root / "payloads"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.payload_dir.mkdir(parents=True, exist_ok=True)
        self._manifests: dict[int, Manifest] = {}

    def held_steps(self) -> list[int]:
        return sorted(int(p.name) for p in self.ckpt_dir.iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file() and self.payload_path(int(p.name)).is_file())

    def manifest(self, step: int) -> Manifest | None:
        if step not in self._manifests:
            p = self.ckpt_dir / str(step) / "manifest.json"
            if not p.is_file():
                return None
            self._manifests[step] = Manifest.from_json_bytes(p.read_bytes())
        return self._manifests[step]

    def payload_path(self, step: int) -> Path:
        return self.payload_dir / f"{int(step)}.safetensors"

    def partial_dir(self, step: int) -> Path:
        return self.ckpt_dir / f".partial-{int(step)}"

    def commit(self, step: int, manifest: Manifest, payload_tmp: Path) -> None:
        final = self.ckpt_dir / str(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(payload_tmp, self.payload_path(step))
        os.replace(self.partial_dir(step), final)
        self._manifests[step] = manifest

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` steps plus the delta chain back to a full checkpoint (so peers and
        relays can serve a node that holds nothing); drop partial downloads that are superseded."""
        held = self.held_steps()
        kept = set(held[-keep:]) if keep > 0 else set()
        oldest = min(kept, default=None)
        while oldest is not None and (m := self.manifest(oldest)) is not None and m.encoding == "xor-delta" \
                and m.base_step in held:
            oldest = m.base_step
            kept.add(oldest)
        for s in held:
            if s not in kept:
                shutil.rmtree(self.ckpt_dir / str(s), ignore_errors=True)
                self.payload_path(s).unlink(missing_ok=True)
                self._manifests.pop(s, None)
        newest = held[-1] if held else -1
        for p in self.ckpt_dir.glob(".partial-*"):
            if int(p.name.split("-")[1]) <= newest:
                shutil.rmtree(p, ignore_errors=True)


@dataclass
class Fetcher:
    store: CheckpointStore
    sources: list[ShardSource]
    trusted_key: str
    keep: int  # k + 1 versions
    on_new_step: Callable[[int, Path], None]
    parallel: int = 4
    progress: bool = False
    scores: dict[str, SourceScore] = field(default_factory=dict)
    bytes_by_kind: Counter = field(default_factory=Counter)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    on_shards: Callable[[int, str, list[int]], None] = lambda step, manifest_hash, indices: None
    manifest_hashes: dict[int, str] = field(default_factory=dict)  # shared with a PeerSource
    holders_changed: asyncio.Event = field(default_factory=asyncio.Event)

    def announce_change(self) -> None:
        """Wake every download slot waiting for a shard to become available (a peer announced one)."""
        self.holders_changed.set()
        self.holders_changed.clear()

    def score(self, src: ShardSource) -> SourceScore:
        return self.scores.setdefault(src.name, SourceScore())

    def usable(self) -> list[ShardSource]:
        return sorted((s for s in self.sources if not self.score(s).banned), key=lambda s: -self.score(s).rate())

    @property
    def newest_held(self) -> int:
        held = self.store.held_steps()
        return held[-1] if held else -1

    async def run(self, stop: asyncio.Event, poll_seconds: float = 1.0) -> None:
        """Fetch loop: poll for new steps until `stop` is set; errors are logged and retried."""
        backoff = 1.0
        while not stop.is_set():
            try:
                await self.sync_once()
                backoff = 1.0
            except (FetchError, SourceError, CheckpointError) as e:
                log.warning("fetch failed (%s); retrying in %.0f s", e, backoff)
                await sleep_or_stop(stop, backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self.wake.clear()
            await wait_any(stop, self.wake, timeout=poll_seconds)

    async def listing(self) -> dict:
        errors = []
        for src in self.usable():
            if src.kind == "peer":
                continue
            try:
                return await src.listing()
            except SourceError as e:
                errors.append(str(e))
        raise FetchError("no source could list checkpoints: " + "; ".join(errors or ["no sources"]))

    async def sync_once(self) -> int | None:
        """Bring the store up to the newest published step. Returns the new step, or None."""
        listing = await self.listing()
        entries = {int(c["step"]): c for c in listing.get("checkpoints", [])}
        if not entries:
            return None
        target = max(entries)
        if target <= self.newest_held:
            return None
        for step in self.plan(target, entries):
            await self.fetch_step(step)
            self.on_new_step(step, self.store.payload_path(step))
        self.store.prune(self.keep)
        return target

    def plan(self, target: int, entries: dict[int, dict]) -> list[int]:
        """Steps to fetch, oldest first: follow xor-delta bases back to one we hold or a full one."""
        held = set(self.store.held_steps())
        chain: list[int] = []
        step = target
        while True:
            chain.append(step)
            e = entries.get(step)
            if e is None:
                raise FetchError(f"step {step} is needed but no longer published; retrying from the newest full")
            if e["encoding"] == "full":
                break
            base = int(e["base_step"])
            if base in held:
                break
            step = base
        return list(reversed(chain))

    async def _manifest(self, step: int) -> Manifest:
        previous = self.store.manifest(self.newest_held) if self.newest_held >= 0 else None
        errors = []
        for src in self.usable():
            try:
                m = Manifest.from_json_bytes(await src.manifest(step))
                verify_manifest(m, {self.trusted_key}, previous=previous)
                if m.step != step:
                    raise CheckpointError("manifest_schema", f"asked for step {step}, got {m.step}")
                parent = self.store.manifest(step - 1)
                if parent is not None:
                    check_parent(m, parent)
                return m
            except SourceError as e:
                errors.append(str(e))
            except CheckpointError as e:
                self._ban(src, f"bad manifest for step {step}: {e}")
                errors.append(str(e))
        raise FetchError(f"no valid manifest for step {step}: " + "; ".join(errors or ["no sources"]))

    def _ban(self, src: ShardSource, why: str) -> None:
        if src.kind == "coordinator" and len([s for s in self.sources if not self.score(s).banned]) == 1:
            log.warning("%s: %s (it is the only source; not banned)", src.name, why)
            return
        self.score(src).banned = True
        log.warning("dropping source %s for this run: %s", src.name, why)

    async def fetch_step(self, step: int) -> None:
        m = await self._manifest(step)
        partial = self.store.partial_dir(step)
        shards_dir = partial / "shards"
        shards_dir.mkdir(parents=True, exist_ok=True)
        (partial / "manifest.json").write_bytes(m.to_json_bytes())
        todo = [i for i in range(m.num_shards) if not self._have_shard(m, shards_dir, i)]
        self.manifest_hashes[step] = m.canonical_hash()
        self.on_shards(step, m.canonical_hash(), [i for i in range(m.num_shards) if i not in todo])
        bar = _bar(self.progress, m.compressed_size, f"step {step}")
        bar.update(m.compressed_size - sum(m.shards[i].zsize for i in todo))
        remaining = set(todo)
        origin_busy = [0]  # slots fetching a shard that no peer holds yet
        swarm = bool(self._holder_fns())
        # With peers, each node pulls one shard at a time that nobody holds yet, starting at a place of
        # its own, so the swarm asks the origin for different shards and trades the rest.
        start = random.randrange(m.num_shards)
        order = sorted(range(m.num_shards), key=lambda i: (i - start) % m.num_shards)

        # shard -> until when to leave it alone: the origin said "ask peers" (that must not stop us from
        # asking them), or every peer holding it was busy
        origin_wait: dict[int, float] = {}
        peers_wait: dict[int, float] = {}

        async def slot() -> None:
            while remaining:
                now = time.monotonic()
                i = self._pick_from_peers(step, {x for x in remaining if peers_wait.get(x, 0) <= now})
                from_origin = i is None
                if from_origin:
                    i = next((x for x in order if x in remaining and origin_wait.get(x, 0) <= now), None)
                    if i is None or (swarm and origin_busy[0] >= 1):
                        # wait for a peer's announcement rather than load the origin; the timeout
                        # only notices deferrals running out
                        await wait_any(self.holders_changed, timeout=0.25)
                        continue
                    origin_busy[0] += 1
                remaining.discard(i)
                try:
                    await self._fetch_shard(m, shards_dir, i)
                except ShardDeferred:  # the origin or every holding peer said "not now"
                    remaining.add(i)
                    if from_origin:
                        origin_wait[i] = time.monotonic() + 2.0
                    else:
                        peers_wait[i] = time.monotonic() + 0.2
                    continue
                except BaseException:
                    remaining.add(i)
                    raise
                finally:
                    origin_busy[0] -= from_origin
                bar.update(m.shards[i].zsize)
                self.on_shards(step, m.canonical_hash(), [i])
                self.announce_change()

        try:
            await asyncio.gather(*(slot() for _ in range(min(self.parallel, len(todo)))))
        finally:
            bar.close()
        base = None
        if m.encoding == "xor-delta":
            base = self.store.payload_path(m.base_step)
            if not base.is_file():
                raise FetchError(f"step {step} is a delta against step {m.base_step}, which is not held")
        tmp = partial / "payload.tmp"
        reader = DirShardReader(partial, m)
        await asyncio.to_thread(reconstruct_payload, m, reader, tmp, base_payload=base)
        self.store.commit(step, m, tmp)
        log.info("holding step %d (%s, %d shards, %.2f MB)", step, m.encoding, m.num_shards, m.compressed_size / 1e6)

    def _pick_from_peers(self, step: int, remaining: set[int]) -> int | None:
        """The rarest shard that some peer already holds (random among equals), or None."""
        counts = {i: sum(len(h(step, i)) for h in self._holder_fns()) for i in remaining}
        with_peers = [i for i in remaining if counts[i] > 0]
        if not with_peers:
            return None
        rarest = min(counts[i] for i in with_peers)
        return random.choice([i for i in with_peers if counts[i] == rarest])

    def _holder_fns(self):
        return [s.holders for s in self.sources if hasattr(s, "holders") and not self.score(s).banned]

    @staticmethod
    def _have_shard(m: Manifest, shards_dir: Path, i: int) -> bool:
        p = shards_dir / shard_file_name(i)
        if not p.is_file() or p.stat().st_size != m.shards[i].zsize:
            return False
        try:
            verify_shard(m, i, p.read_bytes())
            return True
        except CheckpointError:
            p.unlink(missing_ok=True)
            return False

    async def _fetch_shard(self, m: Manifest, shards_dir: Path, i: int) -> None:
        entry = m.shards[i]
        part = shards_dir / (shard_file_name(i) + ".part")
        attempts = 0
        while True:
            candidates = [s for s in self.usable() if not hasattr(s, "has") or s.has(m.step, i)]
            if not candidates:
                raise FetchError(f"no source can serve shard {i} of step {m.step}")
            # The origin's uplink is the scarce resource: peers first, then relays, then the coordinator.
            candidates.sort(key=lambda s: SOURCE_RANK.get(s.kind, 1))
            src = candidates[attempts % len(candidates)]
            attempts += 1
            offset = part.stat().st_size if part.exists() and src.kind != "peer" else 0
            if offset >= entry.zsize:
                part.unlink(missing_ok=True)
                offset = 0
            t0 = time.monotonic()
            try:
                data = await src.shard(m.step, i, entry.zsize, offset)
            except ShardDeferred:
                raise
            except SourceError as e:
                self.score(src).failures += 1
                if e.data and src.kind != "peer":  # keep what arrived; the next try asks for the rest
                    with open(part, "ab") as f:
                        f.write(e.data)
                if attempts >= 3 * max(1, len(candidates)) + 3:
                    raise FetchError(f"shard {i} of step {m.step}: {e}") from None
                await asyncio.sleep(min(0.2 * attempts, 2.0))
                continue
            sc = self.score(src)
            sc.bytes += len(data)
            sc.seconds += time.monotonic() - t0
            self.bytes_by_kind[src.kind] += len(data)
            whole = (part.read_bytes() + data) if offset else data
            try:
                verify_shard(m, i, whole)
            except CheckpointError as e:
                part.unlink(missing_ok=True)
                if hasattr(src, "report_bad"):  # a swarm source drops the one peer, not every peer
                    src.report_bad(m.step, i)
                else:
                    self._ban(src, f"shard {i} of step {m.step} failed verification: {e}")
                continue
            final = shards_dir / shard_file_name(i)
            tmp = final.with_suffix(".tmp")
            tmp.write_bytes(whole)
            os.replace(tmp, final)
            part.unlink(missing_ok=True)
            return


class _NoBar:
    def update(self, n): ...
    def close(self): ...


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)
