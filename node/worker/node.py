"""A worker node: join, then heartbeat, fetch and work loops under one owner until stopped.

Structured concurrency: `WorkerNode.run()` owns every task in one TaskGroup; `stop()` sets an event
that every loop watches, so SIGINT/SIGTERM end the node cleanly (the current assignment is finished
or abandoned, and the checkpoint store is only ever changed by atomic renames).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.aio import client_session, sleep_or_stop, wait_any
from node.backoff import Backoff
from node.checkpoint_dir import CheckpointDir
from node.config import Config
from node.worker.backends import GenRequest, InferenceBackend, LoraAdapter, start_backend
from node.worker.episodes import Episode, EpisodePlayer
from node.worker.client import CoordinatorClient, CoordinatorError, Unreachable
from node.worker.fetcher import Fetcher
from node.worker.peers import HaveAnnouncer, PeerSource
from node.worker.sources import HttpSource, ShardSource
from protocol import messages as M
from protocol.errors import PrimeNodeError
from protocol.identity import Identity
from protocol.signing import sign_request

if TYPE_CHECKING:
    from node.p2p import P2PNode
    from protocol.checkpoint import Manifest
    from node.p2p.shard_store import CheckpointShards

log = logging.getLogger("prime_node.worker")

ALLOWED_MODEL_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "chat_template.jinja", "generation_config.json"}


PROBE_SEED, PROBE_PROMPT_TOKENS, PROBE_MAX_TOKENS, PROBES_KEPT = 0x5EED, 8, 16, 64


# How long a stopping work loop waits for a submission still in flight before it counts it lost (its prompts are
# re-issued to other nodes after their deadline).
DELIVERY_GRACE_S = 20.0


class KeyPinError(PrimeNodeError):
    pass


class WeightSwapError(PrimeNodeError):
    """The engine did not take the new weights: generating on would only produce rejected work."""


@dataclass
class Stats:
    tokens: int = 0
    gen_seconds: float = 0.0
    accepted: int = 0
    rejected: int = 0
    lost: int = 0  # rollouts never delivered (the coordinator unreachable until the deadline)
    assignments: int = 0
    rejected_reasons: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.gen_seconds if self.gen_seconds > 0 else 0.0


class WorkerNode:
    def __init__(self, cfg: Config, coordinator_url: str, identity: Identity, *,
                 coordinator_key: str | None = None, status_line: bool = False):
        self.cfg = cfg
        self.url = coordinator_url.rstrip("/")
        self.identity = identity
        self.root = Path(cfg.worker.storage_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pinned_key = coordinator_key.lower() if coordinator_key else None
        self.status_line = status_line
        self.stop_event = asyncio.Event()
        self.new_weights = asyncio.Event()
        self.stats = Stats()
        self.state = "starting"
        self.backend: InferenceBackend | None = None
        self.spec: M.RunSpec | None = None
        self.episodes: EpisodePlayer | None = None  # multi-turn tasks only
        self._pending_step: tuple[int, Path] | None = None
        self._loading_step: int | None = None  # the step whose payload the engine is reading (the fetcher keeps it)
        self._ask_ahead = True  # ask for the next assignment while generating (_work_loop)
        self._probes: deque[dict] = deque(maxlen=PROBES_KEPT)
        self._announced = -1  # newest step the coordinator's gossip announced to us

    def stop(self) -> None:
        self.stop_event.set()

    # -- set-up ------------------------------------------------------------------------------------
    def _pin(self, key: str) -> str:
        pin_file = self.root / "coordinator.pub"
        key = key.lower()
        if self.pinned_key:
            if key != self.pinned_key:
                raise KeyPinError(f"coordinator presents key {key[:16]}…, but --coordinator-key is "
                                  f"{self.pinned_key[:16]}…; refusing to join")
            return key
        if pin_file.is_file():
            pinned = pin_file.read_text().strip()
            if pinned != key:
                raise KeyPinError(f"coordinator key changed: pinned {pinned[:16]}… in {pin_file}, now {key[:16]}…; "
                                  f"delete that file only if you trust the new key")
            return key
        pin_file.write_text(key + "\n")
        log.warning("pinned coordinator key %s on first sight (saved in %s); pass --coordinator-key to be strict",
                    key, pin_file)
        return key

    def _write_model_dir(self, spec: M.RunSpec) -> Path:
        """config.json and the tokenizer files from the run spec; the weights come as checkpoints."""
        model_dir = self.root / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(spec.model_config_json))
        for name, text in spec.tokenizer_files.items():
            if name in ALLOWED_MODEL_FILES:
                (model_dir / name).write_text(text)
        return model_dir

    # -- main --------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.p2p: P2PNode | None = None
        self.announcer: HaveAnnouncer | None = None
        try:
            await self._run()
        finally:
            if self.p2p is not None:
                await self.p2p.stop()
        log.info("worker stopped (accepted %d, rejected %d rollouts)", self.stats.accepted, self.stats.rejected)

    async def _run(self) -> None:
        async with client_session() as session:
            self.client = CoordinatorClient(self.url, self.identity, session)
            store = CheckpointDir(self.root, unmerged_adapters=self.cfg.worker.lora_serving == "adapter")
            if self.cfg.p2p.enabled:
                # Listening before the join, so that the join can list our ports and the coordinator dial them
                # back (docs/P2P.md "Reachability"); the run and its key come from GET /v1/status.
                from node.p2p.shard_store import CheckpointShards

                run = await self._until_reached(self.client.run_info)
                self.p2p = await self._start_p2p(run.run_id, self._pin(run.coordinator_key),
                                                 CheckpointShards(store.ckpt_dir))
            self.spec = spec = await self._until_reached(self._join)
            key = self._pin(spec.coordinator_key)
            if self.p2p is not None and (spec.run_id, key) != (self.p2p.run_id, self.p2p.coordinator_key):
                raise KeyPinError("the coordinator's join answer names another run or key than its status did")
            self.model_dir = self._write_model_dir(spec)
            self.episodes = EpisodePlayer(spec, self.model_dir) if spec.max_turns > 1 else None
            run_id = spec.run_id
            sources: list[ShardSource]  # HTTP servers, and the swarm with p2p
            sources = [HttpSource(self.url, "coordinator", session, swarm=self.cfg.p2p.enabled,
                                  signer=lambda method, path: sign_request(self.identity, method, path, b"",
                                                                           run_id=run_id),
                                  shard_addr=lambda: self.p2p.origin_shard_addrs if self.p2p is not None else None)]
            sources += [HttpSource(r, "relay", session) for r in spec.relays]
            if self.p2p is not None:  # peers become one more shard source, and we serve ours
                self._reachability(spec.reachability)
                self.announcer = HaveAnnouncer(self.p2p)
                sources.append(PeerSource(self.p2p))
            self.fetcher = Fetcher(store, sources, key, keep=spec.async_level + 1, on_new_step=self._on_new_step,
                                   on_shards=self._on_shards if self.announcer else None,
                                   in_use=self._payloads_in_use,
                                   progress=self.status_line)
            held = store.held_steps()
            if held:
                self._on_new_step(held[-1], store.weights_path(held[-1]))
            if self.p2p is not None:
                self.p2p.add_listener(self._on_announcement)
                if spec.p2p_bootstrap:
                    try:
                        await self.p2p.connect(spec.p2p_bootstrap)
                    except PrimeNodeError as e:  # the node can run without peers (origin, relays)
                        log.warning("p2p bootstrap: %s", e)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.fetcher.run(self.stop_event), name="fetch")
                    tg.create_task(self._heartbeat_loop(), name="heartbeat")
                    tg.create_task(self._work_loop(), name="work")
                    if self.p2p is not None and self.announcer is not None:  # both or neither
                        tg.create_task(self.announcer.run(self.stop_event), name="announce")
                    if self.status_line:
                        tg.create_task(self._status_loop(), name="status")
            except ExceptionGroup as eg:  # a node that cannot go on says why in one line (cli.main)
                fatal = [e for e in eg.exceptions if isinstance(e, PrimeNodeError)]
                if fatal:
                    raise fatal[0] from None
                raise

    def _on_shards(self, step: int, manifest_hash: str, indices: list[int]) -> None:
        """Shards of a manifest the fetcher verified: the peer table counts peers' `have`s for that step from
        now on (node/p2p/peer_table.py), and we announce the shards."""
        assert self.p2p is not None and self.announcer is not None  # the fetcher calls this only with p2p
        self.p2p.note_manifest(step, manifest_hash)
        self.announcer.add(step, manifest_hash, indices)

    async def _start_p2p(self, run_id: str, key: str, shard_source: CheckpointShards) -> P2PNode:
        """Our libp2p host (and HTTP shard server), listening; the run's bootstrap is dialled after the join."""
        from node.p2p import P2PNode

        p2p = P2PNode(self.identity, self.cfg.p2p, run_id=run_id, coordinator_key=key, shard_source=shard_source)
        await p2p.start()
        return p2p

    def _on_announcement(self, event) -> None:
        """Announcements wake the fetcher."""
        if event.announcement.kind == "manifest":  # a new step: fetch now, not at the next poll
            step = event.announcement.step
            if step > self._announced:  # once per step (bench/wan.py --loopback times it from this line)
                self._announced = step
                log.info("step %d announced", step)
            self.fetcher.wake.set()
        else:  # a peer holds new shards: wake download slots waiting for one
            self.fetcher.announce_change()

    def _reachability(self, reach: M.Reachability | None) -> None:
        """What the join's dial-back found decides what we announce (P2PNode.apply_reachability)."""
        assert self.p2p is not None  # called only with p2p
        if reach is None:
            log.info("p2p: the coordinator did not dial us back; announcing %s", self.p2p.announce_addrs or "nothing")
            return
        addrs = self.p2p.apply_reachability(reach.observed_ip, reach.libp2p, reach.http)
        if reach.libp2p is False and not reach.http:
            log.warning("p2p: NOT reachable at %s (the coordinator could not connect back: NAT or firewall?); "
                        "announcing no address: fetching from and serving over connections this node opens. "
                        "Forward the p2p port(s) to be reachable.", reach.observed_ip)
        else:
            log.info("p2p: reachable at %s (libp2p %s, HTTP %s); announcing %s", reach.observed_ip, reach.libp2p,
                     reach.http, addrs or "nothing")

    async def _until_reached(self, call):
        """`await call()`, retried with backoff while the coordinator cannot be reached."""
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                return await call()
            except Unreachable as e:
                if self.stop_event.is_set():
                    raise
                delay = backoff.next()
                log.warning("%s; retrying in %.1f s", e, delay)
                await sleep_or_stop(self.stop_event, delay)

    async def _join(self) -> M.RunSpec:
        ports = M.ListenPorts(**self.p2p.listen_ports()) if self.p2p is not None else None
        info = M.NodeInfo(backend=self.cfg.worker.backend, device=self.cfg.worker.device, listen_ports=ports)
        spec = await self.client.join(info, token=self.cfg.worker.join_token)
        log.info("joined run %s as %s (step %d, k=%d)", spec.run_id, spec.node_id[:12], spec.current_step,
                 spec.async_level)
        return spec

    def _on_new_step(self, step: int, payload: Path) -> None:
        self._pending_step = (step, payload)
        self.new_weights.set()

    def _payloads_in_use(self) -> set[int]:
        """Steps whose payload file must outlive the fetcher's next prune: the one the engine is loading (a
        load takes seconds to minutes, and the fetcher may commit several newer steps meanwhile) and the one
        it is about to load."""
        pending = self._pending_step
        return {s for s in (self._loading_step, pending[0] if pending else None) if s is not None}

    @property
    def policy_step(self) -> int:
        """Step of the weights generating now (-1 until the engine has started on a checkpoint)."""
        return self.backend.policy_step if self.backend is not None else -1

    async def _swap_weights_if_newer(self) -> None:
        pending = self._pending_step
        if pending is None or pending[0] <= self.policy_step:
            return
        step, payload = pending
        manifest = self.fetcher.store.manifest(step)
        t0 = time.monotonic()
        self._loading_step = step
        try:
            if manifest is not None and manifest.is_adapter and self.cfg.worker.lora_serving == "adapter":
                await self._load_adapter(manifest)
            else:
                await self._load_weights(payload, step, manifest.canonical_hash()
                                         if manifest is not None and manifest.encoding == "full" else None)
        finally:
            self._loading_step = None
        await self._probe(step)
        log.info("now generating with step %d (swap took %.2f s)", step, time.monotonic() - t0)

    async def _load_weights(self, payload: Path, step: int, base: str | None) -> None:
        """A payload's full weights into the engine (started on them if it is not yet); `base`: the manifest hash of a
        full checkpoint, which adapters may then apply to."""
        w = self.cfg.worker
        if self.backend is None:  # the engine starts on the first verified checkpoint
            self.state = "starting"
            log.info("starting the %s engine on step %d", w.backend, step)
            self.backend = await asyncio.to_thread(
                start_backend, w.backend, self.model_dir, payload, step, dtype=w.dtype, device=w.device,
                vllm=w.vllm.model_dump(exclude_none=True), base=base, lora_serving=w.lora_serving)
        else:
            await asyncio.to_thread(self.backend.load_payload, payload, step, base=base)

    async def _load_adapter(self, manifest: Manifest) -> None:
        """worker.lora_serving = "adapter": the engine keeps the pinned base (loaded first if it holds other weights)
        and generates with this step's adapter unmerged, as the fetcher rebuilt it from the step's verified shards."""
        store, step = self.fetcher.store, manifest.step
        assert manifest.base_step is not None  # the manifest requires it of an adapter
        base = store.manifest(manifest.base_step)
        if base is None or not store.payload_path(manifest.base_step).is_file():  # the fetcher checked it: held
            raise WeightSwapError(f"step {step} is a LoRA adapter on step {manifest.base_step}, which is not held")
        if self.backend is None or self.backend.base != base.canonical_hash():
            await self._load_weights(store.payload_path(manifest.base_step), manifest.base_step, base.canonical_hash())
        assert self.backend is not None  # started just above
        adapter = await asyncio.to_thread(LoraAdapter.from_store, store, step)
        await asyncio.to_thread(self.backend.load_adapter, adapter, step)

    async def _probe(self, step: int) -> None:
        """Generate a fixed probe after every swap. Its logprobs must move when the weights did (a swap
        that silently did nothing would have every rollout rejected), and it is kept in probes.jsonl in
        the `prime-node verify rollouts` format, so anyone can check it against the checkpoint."""
        backend, spec = self.backend, self.spec
        assert backend is not None and spec is not None  # after the join, on a started engine
        vocab = int(spec.model_config_json["vocab_size"])
        prompt = [(7 + 31 * i) % vocab for i in range(PROBE_PROMPT_TOKENS)]
        sampling: dict[str, Any] = dict(temperature=1.0, top_p=1.0, max_tokens=PROBE_MAX_TOKENS)
        (r,) = await asyncio.to_thread(backend.generate, [GenRequest(prompt, PROBE_SEED)],
                                       eos_token_id=spec.eos_token_id, **sampling)
        store = self.fetcher.store
        last = self._probes[-1] if self._probes else None
        if last is not None and last["rollouts"][0]["logprobs"] == r.logprobs:
            before, now = store.manifest(last["policy_step"]), store.manifest(step)
            if before is not None and now is not None and before.sha256 != now.sha256:
                raise WeightSwapError(f"the weights of step {step} differ from step {last['policy_step']}'s, "
                                      f"but the engine's output did not change: the weight swap failed")
        self._probes.append({
            "prompts": [{"prompt_id": "probe", "prompt_ids": prompt, "seeds": [PROBE_SEED]}],
            "sampling": sampling, "eos_token_id": spec.eos_token_id, "policy_step": step,
            "rollouts": [{"prompt_id": "probe", "sample_index": 0, "completion_ids": r.completion_ids,
                          "logprobs": r.logprobs, "finish_reason": r.finish_reason, "commitment": r.commitment}]})
        tmp = self.root / "probes.jsonl.tmp"
        tmp.write_text("".join(json.dumps(p) + "\n" for p in self._probes))
        tmp.replace(self.root / "probes.jsonl")

    async def _heartbeat_loop(self) -> None:
        while not self.stop_event.is_set():
            period = self.cfg.worker.heartbeat_seconds
            try:
                _, told_ms = await self.client.heartbeat(M.HeartbeatRequest(
                    policy_step=self.policy_step if self.policy_step >= 0 else None,
                    tokens_per_second=round(self.stats.tokens_per_s, 3), state=self.state,
                    steps_held=self.fetcher.store.held_steps()[-64:],
                    bytes_by_source=dict(self.fetcher.bytes_by_kind)))
                if told_ms is not None:  # a large swarm: the coordinator paces heartbeats (node/coordinator/pacing.py)
                    period = max(period, told_ms / 1000)
            except (Unreachable, CoordinatorError) as e:
                log.debug("heartbeat failed: %s", e)
            # jittered, so that nodes started together do not heartbeat together
            await sleep_or_stop(self.stop_event, period * (0.8 + 0.4 * random.random()))

    async def _work_loop(self) -> None:
        """Ask for work, generate, submit, with no round trip of the coordinator's between two generations:
        - the submission of an assignment travels while the next one generates (`delivering`), so a node
          200 ms away does not idle a round trip plus the coordinator's intake per assignment (docs/BENCHMARKS.md,
          "WAN lab: does k = 2 hide the broadcast?": with k = 2 the trainer waited on exactly that);
        - the next assignment is asked for while this one generates (`ahead`), once the previous submission is
          in: a node holds at most two assignments, the coordinator's run.max_assignments_per_node = 2
          ("WAN lab: work shared by compute"). With a coordinator that allows one, neither overlaps.
        Both tasks are owned here: awaited in order; on the way out an ask ahead is cancelled, and a submission in
        flight is given DELIVERY_GRACE_S to land, then cancelled and counted lost (`stats.lost`)."""
        backoff = Backoff(0.5, 30.0)
        ahead: asyncio.Task | None = None  # the next assignment, asked for while generating
        delivering: asyncio.Task | None = None  # the previous assignment's submission, in flight
        pending_sub: M.SubmitRequest | None = None  # what `delivering` carries

        async def ask_after_delivery(previous: asyncio.Task | None) -> M.Assignment | M.NoWork:
            if previous is not None:
                await asyncio.shield(previous)  # its assignment counted as held until its submission is in
            return await self.client.work(self.policy_step)

        try:
            while not self.stop_event.is_set():
                self.new_weights.clear()  # set again by a step that arrives from here on (the idle wait below)
                await self._swap_weights_if_newer()
                if self.policy_step < 0:
                    self.state = "fetching"
                    await wait_any(self.new_weights, self.stop_event, timeout=1.0)
                    self.new_weights.clear()
                    continue
                try:
                    if ahead is not None:
                        task, ahead = ahead, None
                        assignment = await task
                    else:
                        assignment = await ask_after_delivery(delivering)
                except CoordinatorError as e:
                    if e.code == "stale_policy":
                        self.state = "fetching"
                        self.fetcher.wake.set()
                        await wait_any(self.new_weights, self.stop_event, timeout=2.0)
                        self.new_weights.clear()
                        continue
                    if e.status == 403:
                        log.error("coordinator refused this node: %s", e.detail)
                        self.stop_event.set()
                        return
                    if e.code == "too_many_assignments" and self._ask_ahead:
                        # a coordinator with run.max_assignments_per_node = 1: one at a time, then
                        log.info("the coordinator allows one assignment at a time: not asking ahead")
                        self._ask_ahead = False
                        continue
                    delay = backoff.next()
                    log.warning("%s; backing off %.1f s", e, delay)
                    await sleep_or_stop(self.stop_event, delay)
                    continue
                except Unreachable as e:
                    delay = backoff.next()
                    log.warning("%s; backing off %.1f s", e, delay)
                    await sleep_or_stop(self.stop_event, delay)
                    continue
                backoff.reset()
                if isinstance(assignment, M.NoWork):
                    self.state = "idle"
                    # the coordinator paces idle nodes (node/coordinator/pacing.py), spread here by ±25 %; a newer
                    # step may open work this node could not take: ask again as soon as it is in
                    wait_s = assignment.retry_after_ms / 1000 * (0.75 + random.random() * 0.5)
                    await wait_any(self.new_weights, self.stop_event, timeout=wait_s)
                    continue
                if self._ask_ahead:
                    ahead = asyncio.create_task(ask_after_delivery(delivering), name="work-ahead")
                sub = await self._generate(assignment)
                if delivering is not None:
                    await delivering  # done by now unless the coordinator is slower than a whole generation
                    delivering = None
                if sub is not None:
                    if not self._ask_ahead:  # one at a time: the next ask waits for this submission anyway
                        await self._deliver(sub, assignment.deadline_ms)
                    else:
                        delivering = asyncio.create_task(self._deliver(sub, assignment.deadline_ms), name="submit")
                        pending_sub = sub
        finally:
            if ahead is not None:
                ahead.cancel()
                if ahead.done() and not ahead.cancelled():
                    ahead.exception()  # retrieved: an abandoned request's error is not worth a warning
            if delivering is not None and not delivering.done():
                # a submission in flight when the loop ends: delivered if the coordinator answers soon (a clean
                # stop loses no work), else abandoned and counted (its prompts are re-issued after the deadline)
                await asyncio.wait({delivering}, timeout=DELIVERY_GRACE_S)
                if not delivering.done():
                    delivering.cancel()
                    self.stats.lost += len(pending_sub.rollouts) if pending_sub is not None else 0
                    log.error("a submission still in flight %.0f s after the work loop ended was abandoned",
                              DELIVERY_GRACE_S)

    async def _generate(self, a: M.Assignment) -> M.SubmitRequest | None:
        """The assignment's rollouts, as a submission; None when stopped meanwhile (the coordinator re-issues
        the prompts after the deadline)."""
        self.state = "generating"
        backend, spec = self.backend, self.spec
        assert backend is not None and spec is not None  # work is asked for only on a started engine
        step = backend.policy_step
        sampling: dict[str, Any] = dict(temperature=a.sampling.temperature, top_p=a.sampling.top_p,
                                        max_tokens=a.sampling.max_tokens, eos_token_id=spec.eos_token_id)
        t0 = time.monotonic()
        if self.episodes is None:
            requests = [GenRequest(p.prompt_ids, seed) for p in a.prompts for seed in p.seeds]
            results = await asyncio.to_thread(backend.generate, requests, **sampling)
            played = [Episode(r, []) for r in results]
        else:  # a multi-turn task: the environment answers between the model's turns
            played = await asyncio.to_thread(self.episodes.play, backend, a.prompts, **sampling)
        self.stats.gen_seconds += time.monotonic() - t0
        self.stats.tokens += sum(len(e.first.completion_ids) + sum(len(r.completion_ids) for _, r in e.rest)
                                 for e in played)
        if self.stop_event.is_set():
            return None
        rollouts, it = [], iter(played)
        for p in a.prompts:
            for j in range(len(p.seeds)):
                e = next(it)
                rollouts.append(M.RolloutSubmission(
                    prompt_id=p.prompt_id, sample_index=j, completion_ids=e.first.completion_ids,
                    logprobs=M.wire_logprobs(e.first.logprobs), finish_reason=e.first.finish_reason,
                    commitment=e.first.commitment,
                    turns=[M.EnvTurn(env_ids=env, completion_ids=r.completion_ids,
                                     logprobs=M.wire_logprobs(r.logprobs), finish_reason=r.finish_reason,
                                     commitment=r.commitment) for env, r in e.rest]))
        return M.SubmitRequest(assignment_id=a.assignment_id, policy_step=step, rollouts=rollouts)

    async def _deliver(self, sub: M.SubmitRequest, deadline_ms: int) -> None:
        """Submit and count the answer."""
        resp = await self._submit(sub, deadline_ms)
        if resp is None:
            return
        self.stats.assignments += 1
        self.stats.accepted += len(resp.accepted)
        self.stats.rejected += len(resp.rejected)
        for r in resp.rejected:
            self.stats.rejected_reasons[r.reason] = self.stats.rejected_reasons.get(r.reason, 0) + 1
        if resp.rejected:
            log.warning("%d rollouts rejected: %s", len(resp.rejected),
                        ", ".join(sorted({r.reason for r in resp.rejected})))

    async def _submit(self, sub: M.SubmitRequest, deadline_ms: int) -> M.SubmitResponse | None:
        """Submit, retrying an unreachable coordinator with backoff until the assignment's deadline (after
        it, the prompts have been handed to another node). Work that is not delivered is logged and
        counted (`stats.lost`), never dropped silently."""
        backoff = Backoff(0.5, 30.0)
        n = len(sub.rollouts)
        while True:
            try:
                return await self.client.submit(sub)
            except CoordinatorError as e:
                log.warning("submission of %s refused: %s", sub.assignment_id, e)
                self.stats.rejected += n
                return None
            except Unreachable as e:
                delay = backoff.next()
                if self.stop_event.is_set() or time.time() * 1000 + delay * 1000 > deadline_ms:
                    self.stats.lost += n
                    log.error("%d rollouts of %s lost: the coordinator stayed unreachable (%s) until the "
                              "assignment's deadline or shutdown", n, sub.assignment_id, e)
                    return None
                log.warning("submit failed (%s); retrying in %.1f s", e, delay)
                await sleep_or_stop(self.stop_event, delay)

    async def _status_loop(self) -> None:
        while not self.stop_event.is_set():
            s = self.stats
            reach = {True: "reachable", False: "NATed", None: "reach ?"}[self.p2p.reachable] if self.p2p else "no p2p"
            line = (f"\rstep {self.policy_step} | {self.state:<10} | {reach} | "
                    f"{s.tokens_per_s:7.1f} tok/s | accepted {s.accepted} rejected {s.rejected}   ")
            sys.stderr.write(line)
            sys.stderr.flush()
            await sleep_or_stop(self.stop_event, 1.0)
        sys.stderr.write("\n")
