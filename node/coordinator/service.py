"""The coordinator: run state behind the HTTP API. One object owns the ledger, the scheduler, the
trainer loop and the publisher; the aiohttp handlers in app.py only translate HTTP to these calls.

Threads: the asyncio loop (HTTP, scheduler, intake), one training thread (TrainingLoop), one
verification thread. The scheduler is touched only on the loop; the training thread reaches it
through `loop.call_soon_threadsafe`. Every background task and the training thread are owned by one
Supervisor (node/coordinator/supervisor.py): the first to die marks the coordinator failed.

With `server.engine_process = true` the training thread and the replays run in a child process instead
(node/coordinator/engine.py; this one talks to it through engine_client.EngineProcess, whose channel
reader is one more critical task), and this process imports nothing of torch: its tokenizer is
node/trainer/light_tokenizer.py's (tests/unit/test_engine_imports.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING

from node.checkpoint_dir import CheckpointDir
from node.config import Config, coordinator_warnings
from node.coordinator.faults import fault_point
from node.coordinator.intake import Intake
from node.coordinator.ledger import Ledger, NodeStanding, now_ms
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator import pacing
from node.coordinator.node_bytes import NodeBytes
from node.coordinator.records import AssignmentRow, Liveness, NodeState
from node.coordinator.reachability import DialBack
from node.coordinator.refusals import Refused
from node.coordinator.run_model import load_run_model
from node.coordinator.scheduler import Scheduler, StaleNode, assignment_id, min_policy_for_batch
from node.coordinator.seeding import SuperSeeder
from node.coordinator.status import build_status
from node.coordinator.supervisor import Failure, Supervisor
from node.coordinator.verification import VerdictQueue
from node.coordinator.verifier_jobs import JobBoard
from node.envs import encode_prompt
from node.envs.episode import max_turns_of
from protocol import messages as M
from protocol.admission import AdmissionError, check_join_token, check_pow
from protocol.identity import Identity

if TYPE_CHECKING:
    from node.coordinator.engine_client import EngineProcess
    from node.coordinator.training import TrainingLoop
    from node.p2p import P2PNode

log = logging.getLogger("prime_node.coordinator")

LIVENESS_FLUSH_MS = 2_000  # heartbeats and work requests reach the ledger in one transaction this often
IDLE_KEY_FORGET_MS = 3_600_000  # a key that joined and never submitted anything is dropped after an hour
POW_CHECKS_AT_ONCE = 2  # proof-of-work checks (one scrypt each) running at once, off the event loop
POW_MAX_WAITING = 64  # joins waiting for a check; more are refused with 503 (the per-address join limit is first)
PRUNE_EVERY_MS = 5_000  # declined assignments past their hold, settled ones of old batches, old rejections
PRUNE_MARGIN_STEPS = 4  # settled assignments are kept this many steps past the window (k) before deletion
SMALL_MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "generation_config.json")


def _dialled(ok: bool | None) -> str:
    return {True: "dialled back", False: "NOT reachable", None: "not tried"}[ok]


class Coordinator:
    def __init__(self, cfg: Config, identity: Identity):
        self.cfg = cfg
        for warning in coordinator_warnings(cfg):
            log.warning("%s", warning)
        self.identity = identity
        self.k = cfg.run.async_level
        self.root = Path(cfg.storage.dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.root / "ledger.sqlite")
        self.metrics = CoordinatorMetrics()
        self.metrics.watch_nodes(lambda: self.ledger.node_summary(now_ms() - self.online_ms(),
                                                                  self.published_step)["by_state"])
        self.checkpoints = CheckpointDir(self.root)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop, once started
        self.bytes_by_source: Counter[str] = Counter()
        # What each node says it fetched, by source: bounded per node and in nodes (node_bytes.py).
        self.node_bytes = NodeBytes(ttl_ms=IDLE_KEY_FORGET_MS)
        self.recent_staleness: deque[int] = deque(maxlen=10_000)
        self._submitting: set[str] = set()
        self._pow_checks = asyncio.Semaphore(POW_CHECKS_AT_ONCE)
        self._pow_waiting = 0
        self.supervisor = Supervisor(on_failure=self._on_failure)
        self.p2p: P2PNode | None = None
        self.url: str | None = None  # its HTTP server's base URL, set by app.start_server once the port is bound
        self.started_ms = now_ms()
        self._status: tuple[float, dict] | None = None
        self._status_body: tuple[float, bytes] | None = None  # the cached document, serialised (status_json)
        self._liveness: dict[str, Liveness] = {}  # node id -> what it last said, not yet in the ledger
        # when a node told "no work" asks again, and when a node heartbeats next (node/coordinator/pacing.py)
        self.work_pacer = pacing.Pacer(cfg.server.idle_work_requests_per_s,
                                       pacing.work_min_ms(cfg.server.rate_limit_per_second), pacing.WORK_MAX_MS)
        self.heartbeat_pacer = pacing.Pacer(cfg.server.heartbeats_per_s, pacing.HEARTBEAT_MIN_MS,
                                            pacing.HEARTBEAT_MAX_MS)
        # The join's dial-back (reachability.py): at most one dial per listed port per join the address may make.
        self.dialback = DialBack(timeout_s=cfg.p2p.dialback_timeout_s,
                                 per_minute=2 * cfg.admission.joins_per_address_per_minute,
                                 allow_private=cfg.p2p.allow_private_addrs)
        # First copies go to nodes that others can dial (a NATed holder cannot serve those deferred to it), and
        # to NATed nodes holding a reservation on our relay hop (every peer reaches them through it) while fewer than
        # two direct nodes ask: a circuit fetch costs about twice a direct one (seeding.py).
        self.relay_reserved: frozenset[str] = frozenset()  # refreshed every second by _relay_loop
        self.seeder = SuperSeeder(cfg.distribution.super_seed_seconds, reachable=self.can_serve, relayed=self.relayed)
        # The run's model, then every collaborator, built here and handed what it uses (by keyword).
        self.model = load_run_model(cfg, self.root)
        self.model_dir, self.tokenizer, self.task = self.model.model_dir, self.model.tokenizer, self.model.task
        self.vocab_size, self.eos_token_id = self.model.vocab_size, self.model.eos_token_id
        self.scheduler = Scheduler(
            async_level=self.k, batch_prompts=cfg.run.batch_prompts, group_size=cfg.run.group_size,
            prompts_per_assignment=cfg.run.prompts_per_assignment, make_prompt=self._make_prompt,
        )
        self.engine: EngineProcess | None = None
        self._local: TrainingLoop | None = None  # the training thread of the one-process layout
        self.training: TrainingLoop | EngineProcess
        if cfg.server.engine_process:  # training, publishing and replays in the engine process (engine.py)
            from node.coordinator.engine_client import EngineProcess

            self.engine = self.training = EngineProcess(
                cfg=cfg, identity=identity, metrics=self.metrics, on_groups_dropped=self.on_groups_dropped,
                on_step_published=self.on_step_published,  # called on the loop: no _on_loop
                on_failed=self.supervisor.fail)
            self.policies = None
        else:  # torch comes in here, with the trainer and the policy models
            from node.coordinator.publisher import Publisher
            from node.coordinator.training import TrainingLoop
            from node.coordinator.verification import PolicyStore

            publisher = Publisher(self.checkpoints, identity, cfg.run.run_id, async_level=self.k,
                                  shard_size=cfg.distribution.shard_size, level=cfg.distribution.compression_level,
                                  full_every=cfg.distribution.full_every)
            self.policies = PolicyStore(self.model_dir, keep=self.k + 2)
            self.training = self._local = TrainingLoop(
                cfg=cfg, storage=self.root, ledger=self.ledger, checkpoints=self.checkpoints, publisher=publisher,
                policies=self.policies, model=self.model, metrics=self.metrics,
                on_groups_dropped=self._on_loop(self.on_groups_dropped),
                on_step_published=self._on_loop(self.on_step_published))
        v = cfg.verification
        self.verifier_board = JobBoard(v.verifier_keys, v.job_lease_seconds, refusals=v.unavailable_tries,
                                       metrics=self.metrics) \
            if v.verifier_keys else None
        self.verdicts = VerdictQueue(cfg=v, sampling=cfg.sampling, ledger=self.ledger,
                                     scheduler=self.scheduler, policies=self.policies, metrics=self.metrics,
                                     eos_token_id=self.eos_token_id, on_decided=self.training.notify_decided,
                                     board=self.verifier_board,
                                     remote_judge=self.engine.verify if self.engine is not None else None,
                                     holds=self.engine.holds if self.engine is not None else None)
        self.intake = Intake(cfg=cfg, ledger=self.ledger, scheduler=self.scheduler, verdicts=self.verdicts,
                             metrics=self.metrics, model=self.model, recent_staleness=self.recent_staleness)

    def _on_loop(self, fn):
        """`fn`, callable from another thread: it runs on the event loop (dropped before the loop started)."""
        def post(*args) -> None:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(fn, *args)
        return post

    def _make_prompt(self, index: int) -> tuple[str, list[int]]:
        problem = self.task.sample(self.cfg.run.seed, index)
        return f"{index}:{problem.prompt_id}", list(encode_prompt(self.tokenizer, problem))

    def _env_state(self, index: int) -> str | None:
        """A multi-turn task's problem answer (JSON) for the worker's environment; None for single-turn tasks."""
        if max_turns_of(self.task) == 1:
            return None
        return json.dumps(self.task.sample(self.cfg.run.seed, index).answer)

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.supervisor.bind(self.loop)
        if self.engine is not None:
            await self.engine.start()  # it restores the run (or publishes θ_0) before it answers
            self._restore_scheduler()
            await self.engine.begin()
            self._spawn(self.engine.serve(), "engine")
        else:
            assert self._local is not None  # one of the two layouts
            await asyncio.to_thread(self._local.restore_or_init)
            self._restore_scheduler()
            self._local.start(self.supervisor.start_thread)
        if self.cfg.p2p.enabled:
            await self._start_p2p()
        self._spawn(self._expire_loop(), "expire-assignments")
        self._spawn(self.verdicts.run(), "verdicts")

    def _restore_scheduler(self) -> None:
        s = self.scheduler
        s.published_step = self.published_step
        s.next_problem_index = int(self.ledger.get("next_problem_index", 0))
        s.waiting_by_batch.update(self.ledger.accepted_by_batch())
        for a in self.ledger.open_assignments():
            s.add_inflight(a.assignment_id, list(a.prompts))
        s.requeue.extend(self.ledger.requeued())

    async def stop(self) -> None:
        await self.supervisor.stop()  # from here on a task or thread ending is expected, not a failure
        if self.engine is not None:
            await self.engine.stop(self.cfg.server.stop_timeout_s)
        elif self._local is not None:
            await asyncio.to_thread(self._local.stop, self.cfg.server.stop_timeout_s)
        self._flush_liveness()
        if self.p2p is not None:
            await self.p2p.stop()
        self.verdicts.close()
        if self.engine is None and self.training.running:  # left behind, stuck: the process exits under it (crash safety redoes its step)
            log.warning("the ledger is left open: the training thread may still write to it")
        else:
            self.ledger.close()

    async def _expire_loop(self) -> None:
        last_forget, last_flush, last_prune = 0.0, 0.0, 0.0
        while True:
            await asyncio.sleep(0.5)
            fault_point("expire-loop")
            t = now_ms()
            if t - last_flush >= LIVENESS_FLUSH_MS:
                last_flush = t
                self._flush_liveness()
            vc = self.cfg.verification
            if t - last_forget > 60_000:
                last_forget = t
                forgotten = self.ledger.forget_idle_nodes(t - IDLE_KEY_FORGET_MS)
                if forgotten:
                    log.info("forgot %d keys that joined and never submitted anything", forgotten)
            if t - last_prune >= PRUNE_EVERY_MS:
                last_prune = t
                await self._prune_ledger()
            for a in self.ledger.open_assignments(deadline_before_ms=t):
                if a.assignment_id not in self._submitting:
                    again = self.scheduler.expire(a.assignment_id)
                    banned = self.ledger.expire_assignment(a.assignment_id, a.node_id, again, vc.expiry_penalty,
                                                           vc.ban_below)
                    self.metrics.assignments_expired.inc()
                    log.info("assignment %s of node %s expired; its prompts go back in the queue%s",
                             a.assignment_id, a.node_id[:12], " (node banned)" if banned else "")

    async def _prune_ledger(self) -> dict[str, int]:
        """Keeps the ledger's history bounded (Ledger.prune), off the event loop."""
        pruned = await asyncio.to_thread(self.ledger.prune,
                                         oldest_batch=self.published_step - self.k - PRUNE_MARGIN_STEPS,
                                         keep_rejections=self.cfg.storage.keep_rejections)
        if any(pruned.values()):
            log.debug("ledger pruned: %s", pruned)
        return pruned

    # -- state shared with the training thread -----------------------------------------------------
    @property
    def published_step(self) -> int:
        """Newest step committed to the ledger: nothing newer is ever served (a crash may redo it)."""
        return self.training.published_step if self.training else 0

    def servable_steps(self) -> list[int]:
        return [s for s in self.checkpoints.steps() if s <= self.published_step]

    def on_groups_dropped(self, by_batch: dict[int, int], keep_rate: float) -> None:
        """Called on the loop by the training thread when it drops groups (stale, filtered)."""
        self.scheduler.keep_rate = keep_rate  # oversample prompts when filters drop groups
        self.scheduler.forget_waiting(by_batch)

    def on_step_published(self, step: int, consumed: dict[int, int]) -> None:
        """Called on the loop by the training thread after the ledger committed `step`."""
        self.scheduler.on_step_published(step, consumed)
        self.metrics.step.set(step)
        if self.p2p is not None:
            manifest = self.checkpoints.manifest(step)
            assert manifest is not None  # published just now: on disk
            self._spawn(self.p2p.announce_manifest(step, manifest.canonical_hash()),
                        f"announce-{step}", critical=False)  # a lost announcement is repaired by the next

    def _spawn(self, coro, name: str, *, critical: bool = True) -> None:
        """A background task owned by the supervisor: cancelled by stop(); a critical one that dies fails
        the coordinator, a non-critical one's failure is logged."""
        self.supervisor.spawn(coro, name, critical=critical)

    @property
    def failure(self) -> Failure | None:
        """Why the coordinator stopped handing out work (a background task or thread died); None: healthy."""
        return self.supervisor.failure

    def _on_failure(self, failure: Failure) -> None:
        self.metrics.failed.labels(failure.component).set(1)
        self._status = self._status_body = None  # the next status read shows it

    # -- API operations ----------------------------------------------------------------------------
    def _known_node(self, node_id: str) -> NodeStanding:
        node = self.ledger.standing(node_id)
        if node is None:
            raise Refused("unknown_node", "this key has not joined; POST /v1/join first")
        if node.banned:
            raise Refused("banned", "this node is banned after repeated failed verification")
        return node

    async def join(self, node_id: str, req: M.JoinRequest, *, remote: str | None = None,
                   local_ip: str | None = None) -> M.RunSpec:
        """`remote`: the address the request came from (dialled back at the node's listed ports, never an
        address the node names); `local_ip`: ours it came in on (the p2p bootstrap address when we listen on
        a wildcard)."""
        existing = self.ledger.node(node_id)
        if existing and existing.banned:
            raise Refused("banned", "this node is banned after repeated failed verification")
        await self._admit(node_id, req, known=existing is not None)
        info = req.node.model_dump() if req.node else {}
        self.ledger.upsert_node(node_id, self.cfg.verification.reputation_start, info)
        t0 = time.monotonic()
        reach = await self.dialback.check(node_id, remote, req.node.listen_ports if req.node else None)
        if reach is not None:
            log.info("join of %s from %s: libp2p port %s, HTTP port %s (dial-back %.0f ms)", node_id[:12],
                     reach.observed_ip, _dialled(reach.libp2p), _dialled(reach.http), 1000 * (time.monotonic() - t0))
        files = {}
        for name in SMALL_MODEL_FILES:
            p = self.model_dir / name
            if p.is_file() and p.stat().st_size < 16 * 1024 * 1024:
                files[name] = p.read_text()
        return M.RunSpec(
            run_id=self.cfg.run.run_id, node_id=node_id, coordinator_key=self.identity.public_hex,
            task=self.cfg.task.name, async_level=self.k, current_step=self.published_step,
            group_size=self.cfg.run.group_size, model_config_json=self.model.model_config, tokenizer_files=files,
            eos_token_id=self.eos_token_id, checkpoint_dtype=self.cfg.trainer.broadcast_dtype,
            p2p_bootstrap=list(self.p2p_bootstrap(local_ip)), relays=list(self.cfg.distribution.relays),
            task_kwargs=dict(self.cfg.task.kwargs), max_turns=max_turns_of(self.model.task), reachability=reach,
        )

    # -- the verifier pool (docs/PROTOCOL.md, "HTTP API": verifier keys only) ------------------------
    def _board(self, key: str) -> JobBoard:
        if self.verifier_board is None:
            raise Refused("not_a_verifier", "this run has no verifier pool (verification.verifier_keys is empty)")
        self.verifier_board.check_verifier(key)
        return self.verifier_board

    def verify_jobs(self, key: str, req: M.VerifyJobsRequest) -> M.VerifyJobsResponse | None:
        """The run facts a verifier needs (when it asks for them), else the oldest job nobody holds; None: no job."""
        board = self._board(key)
        spec = M.VerifierSpec(run_id=self.cfg.run.run_id, coordinator_key=self.identity.public_hex,
                              model_config_json=self.model.model_config, eos_token_id=self.eos_token_id,
                              async_level=self.k, checkpoint_dtype=self.cfg.trainer.broadcast_dtype,
                              relays=list(self.cfg.distribution.relays)) if req.spec else None
        job = None if spec else board.lease(key)
        if spec is None and job is None:
            return None
        return M.VerifyJobsResponse(spec=spec, job=job.wire() if job else None)

    def verify_verdicts(self, key: str, req: M.VerdictsRequest) -> M.VerdictsResponse:
        self._board(key).complete(key, req)
        return M.VerdictsResponse(accepted=True)

    async def _check_pow(self, node_id: str, nonce_hex: str | None) -> None:
        """The proof of work of a new key, checked off the event loop, POW_CHECKS_AT_ONCE at a time: a
        stranger's join costs the coordinator at most one scrypt (~40 ms of one core, 16 MiB at the defaults),
        and strangers together at most POW_CHECKS_AT_ONCE cores and as many scrypt buffers; above
        POW_MAX_WAITING waiting joins a join is refused (503, Retry-After) instead of queued."""
        a = self.cfg.admission
        if a.pow_bits <= 0:
            return
        if self._pow_waiting >= POW_MAX_WAITING:
            raise Refused("busy", "too many joins are being checked; try again in a moment", retry_after_s=1)
        self._pow_waiting += 1
        try:
            async with self._pow_checks:
                await asyncio.to_thread(check_pow, node_id, self.cfg.run.run_id, nonce_hex, a.pow_bits, a.pow_log2_n)
        finally:
            self._pow_waiting -= 1

    async def _admit(self, node_id: str, req: M.JoinRequest, *, known: bool) -> None:
        """Admission (docs/PROTOCOL.md, "Admission"): a new key of an open run pays a proof of work; an
        allowlist run admits its listed keys only (checked at every join); a token run admits a new key with a
        join token."""
        a = self.cfg.admission
        try:
            if a.mode == "allowlist" and node_id not in a.allowlist:
                raise AdmissionError("not_allowlisted", "this key is not on the run's allowlist")
            if known:
                return
            if a.mode == "open":
                await self._check_pow(node_id, req.pow)
            elif a.mode == "token":
                # recorded under the token's canonical identity: another spelling is not another token
                token_id = check_join_token(req.token, coordinator_key=self.identity.public_hex,
                                            run_id=self.cfg.run.run_id, node_id=node_id, now_ms=now_ms())
                if not self.ledger.use_join_token(token_id, node_id):
                    raise AdmissionError("token_used", "this join token has already admitted another key")
        except AdmissionError as e:
            raise Refused(e.code, e.detail) from None  # type: ignore[arg-type]  # admission's codes are RefusalCodes

    async def _start_p2p(self) -> None:
        """A libp2p host that nodes bootstrap from and that gossips "step n is out". It serves no
        shards: every byte the coordinator uploads goes over HTTP, under the one upload cap."""
        from node.p2p import P2PNode

        # A circuit relay v2 hop for NATed nodes (docs/P2P.md "Relaying and hole punching"), within the
        # p2p.relay_* limits, unless p2p.relay_hop = false: the coordinator's role default.
        cfg = self.cfg.p2p.model_copy(update={"relay_hop": self.cfg.p2p.relay_hop is not False})
        p2p = self.p2p = P2PNode(self.identity, cfg, run_id=self.cfg.run.run_id,
                                 coordinator_key=self.identity.public_hex)
        await p2p.start()
        p2p.add_listener(self._on_announcement)
        if self.cfg.p2p.relay_hop is not False:
            self._spawn(self._relay_loop(), "relay-reservations", critical=False)
        self.metrics.watch_p2p(p2p.stats.totals)  # no per-peer tables: a scrape copies a few counters

    def can_serve(self, node_id: str) -> bool | None:
        """Whether peers can connect to `node_id`: its libp2p port was dialled back at join, or it is NATed and
        holds a reservation on our relay hop (node/p2p/nat.py). None: unknown (no dial-back tried)."""
        return True if self.relayed(node_id) else self.dialback.reachable(node_id)

    def relayed(self, node_id: str) -> bool:
        """Peers reach `node_id` only through our relay hop: NATed, holding a reservation."""
        return self.dialback.reachable(node_id) is False and node_id in self.relay_reserved

    async def _relay_loop(self) -> None:
        """Which NATed nodes hold a reservation on our hop, every second (at most p2p.relay_max_reservations)."""
        assert self.p2p is not None  # spawned by _start_p2p
        try:
            while True:
                self.relay_reserved = frozenset(await self.p2p.relay_reserved_nodes())
                await asyncio.sleep(1.0)
        finally:  # stopped or failed (logged by the supervisor): no NATed node is taken for servable any more
            self.relay_reserved = frozenset()

    def _on_announcement(self, event) -> None:
        """A node's verified `have` announcement keeps its super-seeding claims alive."""
        a = event.announcement
        if a.kind == "have":
            self.seeder.announced(a.signer, [(a.step, i) for i in a.indices])

    def p2p_bootstrap(self, local_ip: str | None = None) -> list[str]:
        """Our libp2p address for nodes to dial: the announced ones, else (listening on a wildcard) the address
        the node's request reached us at, with our libp2p port; then the relay hops of `p2p.relay_addrs`
        (`prime-node relay`), on which NATed nodes reserve slots too (docs/P2P.md "Relaying and hole punching")."""
        if self.p2p is None:
            return []
        ours = list(self.p2p.announce_addrs) if self.p2p.announce_addrs else self.p2p.addrs_at(local_ip or "127.0.0.1")
        return ours + [a for a in self.cfg.p2p.relay_addrs if a not in ours]

    def _seen(self, node_id: str, policy_step: int | None = None, tokens_per_s: float | None = None,
              state: NodeState | None = None) -> None:
        """Liveness, kept in memory and written to the ledger in batches (_flush_liveness)."""
        old = self._liveness.get(node_id)
        if old is not None:
            policy_step = policy_step if policy_step is not None else old.policy_step
            tokens_per_s = tokens_per_s if tokens_per_s is not None else old.tokens_per_s
            state = state or old.state
        self._liveness[node_id] = Liveness(node_id, now_ms(), policy_step, tokens_per_s, state)

    def _flush_liveness(self) -> None:
        seen, self._liveness = list(self._liveness.values()), {}
        if seen:
            self.ledger.record_liveness(seen)

    def _claimed_step(self, node: NodeStanding) -> int | None:
        live = self._liveness.get(node.node_id)
        return live.policy_step if live is not None and live.policy_step is not None else node.policy_step

    def heartbeat(self, node_id: str, req: M.HeartbeatRequest) -> M.HeartbeatResponse:
        self._known_node(node_id)
        self._seen(node_id, req.policy_step, req.tokens_per_second, req.state)
        self.node_bytes.record(node_id, req.bytes_by_source, now_ms())
        return M.HeartbeatResponse(current_step=self.published_step)

    def next_heartbeat_ms(self, node_id: str) -> int:
        """When `node_id`, which just heartbeated, should send its next one (the 200's X-Prime-Retry-After-Ms)."""
        return self.heartbeat_pacer.asked(node_id, now_ms())

    def online_ms(self) -> int:
        """How long a node counts as online after it was last heard from (status, metrics)."""
        return pacing.online_ms(self.heartbeat_pacer.wait_ms())

    def work(self, node_id: str, req: M.WorkRequest) -> M.Assignment | M.NoWork:
        node = self._known_node(node_id)
        m = req.policy_step
        if m > self.published_step:
            raise Refused("unpublished_policy", f"policy step {m} has not been published (newest {self.published_step})")
        claimed = self._claimed_step(node)
        if claimed is not None and m < claimed:  # a node never goes back in time
            raise Refused("policy_went_back", f"policy step {m} is older than step {claimed}, which this "
                                              f"node already reported holding")
        cap = self.cfg.run.max_assignments_per_node
        if self.ledger.open_assignments_of(node_id) >= cap:
            raise Refused("too_many_assignments", f"this node already has {cap} assignments in flight; "
                                                  f"submit one first")
        if m > self.scheduler.published_step:  # published a moment ago; the scheduler hears of it on its next turn
            return M.NoWork(retry_after_ms=pacing.WORK_MIN_MS)
        self._seen(node_id, m)
        aid = assignment_id()
        need = min_policy_for_batch(self.published_step + 1, self.k)
        try:
            if m < need:  # stale against the newest step, though the scheduler may not have heard of it yet and
                self.scheduler.note_stale(node_id)  # still hold the batch that made it (full: it would say 204)
                raise StaleNode()
            picked = self.scheduler.assign(m, aid, node_id)  # shared fairly when scarce
        except StaleNode:
            raise Refused("stale_policy",
                          f"policy step {m} is too old: fetch step {need} or newer (newest {self.published_step})")
        if picked is None:
            return M.NoWork(retry_after_ms=self.work_pacer.asked(node_id, now_ms()))
        self.work_pacer.forget(node_id)
        batch, slots = picked
        deadline = now_ms() + int(self.cfg.run.assignment_deadline_seconds * 1000)
        self.ledger.add_assignment(AssignmentRow(
            assignment_id=aid, node_id=node_id, batch_step=batch, min_policy_step=min_policy_for_batch(batch, self.k),
            created_ms=now_ms(), deadline_ms=deadline, state="open", prompts=tuple(slots),
        ), self.scheduler.next_problem_index)
        self.metrics.assignments_issued.inc()
        s = self.cfg.sampling
        return M.Assignment(
            assignment_id=aid, batch_step=batch, min_policy_step=min_policy_for_batch(batch, self.k),
            group_size=self.cfg.run.group_size,
            sampling=M.Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens),
            deadline_ms=deadline,
            prompts=[M.PromptWork(prompt_id=x.prompt_id, prompt_ids=x.prompt_ids, seeds=x.seeds,
                                  env_state=self._env_state(x.problem_index)) for x in slots],
        )

    def _decline(self, node_id: str, aid: str, *, never_published: bool, n_rollouts: int) -> None:
        """A submission outside the window: its prompts go back in the queue now, and declining costs the
        decliner (else one key cycles work -> decline as fast as it can send, issue #25): the assignment keeps
        one of the node's slots for run.decline_hold_seconds, and its reputation pays decline_penalty, a
        little, when steps published during generation made it stale (an honest mishap), or
        reputation_penalty when it claims a step that was never published (no honest node holds one)."""
        vc = self.cfg.verification
        again = self.scheduler.expire(aid)
        banned = self.ledger.decline_assignment(
            aid, node_id, again, reason="stale_policy",
            penalty=vc.reputation_penalty if never_published else vc.decline_penalty, ban_below=vc.ban_below,
            hold_until_ms=now_ms() + int(self.cfg.run.decline_hold_seconds * 1000))
        self.metrics.rejected.labels("stale_policy").inc(n_rollouts)
        if banned:
            log.info("node %s banned after declining work (reputation below %s)", node_id[:12], vc.ban_below)

    async def submit(self, node_id: str, req: M.SubmitRequest) -> M.SubmitResponse:
        node = self._known_node(node_id)

        aid = req.assignment_id
        a = self.ledger.assignment(aid)
        if a is None:
            raise Refused("unknown_assignment", f"no assignment {aid}")
        if a.node_id != node_id:
            raise Refused("not_your_assignment", "this assignment was given to another node")
        if a.state == "submitted" or aid in self._submitting:
            raise Refused("duplicate", "this assignment was already submitted")
        if a.state == "expired":
            raise Refused("expired", "the assignment's deadline passed; its prompts were given to another node")
        if a.state == "declined":
            raise Refused("declined", "this assignment was already declined (submitted outside the window)")
        m = req.policy_step
        oldest_usable = max(a.min_policy_step, self.published_step - self.k)
        if m > self.published_step or m < oldest_usable:
            self._decline(node_id, aid, never_published=m > self.published_step, n_rollouts=len(req.rollouts))
            raise Refused("stale_policy",
                          f"policy step {m} is outside the window [{oldest_usable}, {self.published_step}]")
        self._submitting.add(aid)
        try:
            result = await self.intake.process(node.node_id, a, req)
        finally:
            self._submitting.discard(aid)
        return result

    # -- observability -----------------------------------------------------------------------------
    def status(self, max_age_s: float = 0.0) -> dict:
        """The status document, rebuilt when the cached one is older than `max_age_s` (0: always)."""
        now = time.monotonic()
        if self._status is None or now - self._status[0] > max_age_s:
            self._status = (now, build_status(self))
        return self._status[1]

    def status_json(self, max_age_s: float = 0.0) -> bytes:
        """`status(max_age_s)` as JSON, serialised once per document built: every node GETs /v1/status before it
        joins, and serialising the document per request was most of that request's CPU (bench/load.py)."""
        doc = self.status(max_age_s)
        assert self._status is not None  # built just now, or cached
        built = self._status[0]
        if self._status_body is None or self._status_body[0] != built:
            self._status_body = (built, json.dumps(doc).encode())
        return self._status_body[1]
