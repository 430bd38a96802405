"""Verification of untrusted rollouts on the coordinator, off the event loop.

`PolicyStore` keeps one model per step in the async window (the exact weights nodes downloaded),
and `VerdictQueue` decides in secret, after a submission is recorded, whether to replay it against
the claimed step's weights (in its own thread, so the HTTP API never blocks on a forward pass).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, TypeVar

from node.config import SamplingConfig, VerificationConfig
from node.coordinator.faults import fault_point
from node.coordinator.ledger import Ledger, NodeRow
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.records import Rejection
from node.coordinator.scheduler import Scheduler
from node.coordinator.stale_audit import REASON as STALE, StaleAudit
from node.coordinator.verifier_jobs import JobBoard
from node.trainer.model import load_model
from protocol import messages as M
from protocol.checkpoint import load_payload
from verify.checks import Judgement, VerifyItem, turn_items

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from node.coordinator.records import GroupRow

_T = TypeVar("_T")
Judged = tuple[list[tuple[str, int]], list[Any]]  # (prompt_id, sample_index) and its Judgement, per rollout

# verify.rollouts imports torch: it is imported where a replay is run in this process, never at import time,
# so that the API process of `server.engine_process = true` (node/coordinator/engine.py) imports no torch of
# its own. What the pool path builds and reads (checks, judgements) is verify.checks, torch-free.

log = logging.getLogger("prime_node.verification")

VERIFY_ERROR = "verify_error"  # a verdict that failed twice (an exception, not a replay's finding): VerdictQueue


def merge_turns(answers: list[Judgement], owner: list[int], n: int) -> list[Judgement]:
    """Per-turn judgements -> one per rollout: it passes when every turn passes; it is an outlier (one token
    off the sampler's choice, possibly numerical) only when that is its one failure."""
    turns: list[list[Judgement]] = [[] for _ in range(n)]
    for j, i in zip(answers, owner):
        turns[i].append(j)
    out = []
    for js in turns:
        failed = [j for j in js if j.reason]
        tokens = sum(j.tokens for j in js)
        fits = [j.fit for j in js]  # the rollout's fit: its turns' token-weighted mean (the stale-step audit's)
        fit = None if not js or None in fits or not tokens else sum(
            f * j.tokens for f, j in zip(fits, js) if f is not None) / tokens
        out.append(Judgement(failed[0].reason if failed else None, tokens, sum(j.near_ties for j in js),
                             len(failed) == 1 and failed[0].outlier, fit))
    return out


def build_checks(undecided: list[GroupRow], seeds: dict[str, list[int]], s: SamplingConfig, eos_token_id: int,
                 ) -> tuple[list[tuple[str, int]], list[VerifyItem], list[int]]:
    """The replay checks of a submission's undecided groups, one per model turn (a single-turn rollout has
    one): (prompt_id, sample_index) per rollout, the checks, and each check's rollout (its index in the first)."""
    refs: list[tuple[str, int]] = []
    checks: list[VerifyItem] = []
    owner: list[int] = []
    for g in undecided:
        for r in g.rollouts:
            for it in turn_items(g.prompt_ids, r, seeds[g.prompt_id][r.sample_index],
                                 s.temperature, s.top_p, s.max_tokens, eos_token_id):
                checks.append(it)
                owner.append(len(refs))
            refs.append((g.prompt_id, r.sample_index))
    return refs, checks, owner


class PolicyStore:
    """step -> model with that step's broadcast weights (upcast to the verifier's dtype), the `keep` newest.

    A new step reloads the oldest model in place rather than building another (an allocation the size of the model
    per step), unless that model is leased: a replay holds its step's model for as long as it runs (`lease`), and the
    training thread may publish meanwhile. Reloaded under a replay, the model would give it another step's weights
    halfway through, and an honest node's rollouts would fail (a ban). A leased model that falls out of the window is
    dropped instead, and freed when its lease ends."""
    def __init__(self, model_dir: Path, keep: int, dtype: str = "float32"):
        self.model_dir = Path(model_dir)
        self.keep = keep
        self.dtype = dtype
        self._models: dict[int, PreTrainedModel] = {}
        self._leases: dict[int, int] = {}  # id(model) -> replays running on it
        self._lock = threading.Lock()

    def put(self, step: int, state: dict[str, Any]) -> None:
        with self._lock:
            reuse = None
            while len(self._models) >= self.keep:
                oldest = self._models.pop(min(self._models))
                if id(oldest) not in self._leases:
                    reuse = oldest
        model = reuse if reuse is not None else load_model(self.model_dir, dtype=self.dtype)
        model.load_state_dict({k: v for k, v in state.items()}, strict=False)
        model.eval()
        with self._lock:
            self._models[step] = model

    def put_payload(self, step: int, path: Path) -> None:
        self.put(step, load_payload(path))

    def get(self, step: int) -> PreTrainedModel | None:
        """Whether `step` is held (its model); a replay takes `lease` instead."""
        with self._lock:
            return self._models.get(step)

    @contextlib.contextmanager
    def lease(self, step: int) -> Iterator[PreTrainedModel | None]:
        """`step`'s model for the length of the block (None when not held); never reloaded with another step's
        weights meanwhile."""
        with self._lock:
            model = self._models.get(step)
            if model is not None:
                self._leases[id(model)] = self._leases.get(id(model), 0) + 1
        try:
            yield model
        finally:
            if model is not None:
                with self._lock:
                    left = self._leases.pop(id(model)) - 1
                    if left:
                        self._leases[id(model)] = left

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._models)


class VerdictQueue:
    """Decides, after a submission is recorded and in secret, whether to replay it; then gives its
    groups a verdict. A group enters training only after its verdict:

    - passed over (`unchecked`): a fresh secret draw (`secrets`) said no. The draw is made here, after the
      node has its answer, and is not derived from anything a node can see or predict.
    - `verified`: every rollout was replayed against the claimed step's weights and passed; the node's
      near-tie count (tokens that were not the sampler's first choice) is kept for the ban rule below.
    - `void`: a replay failed. A verified forgery bans the node at once and voids every group of it that
      has not been trained on yet. A rollout off by one token alone (its logprob a little over the limit, or
      the sampler's choice; every other check passed: possibly numerical, verify.rollouts) voids its own group
      and costs `outlier_penalty`; the submission's other groups get their verdict as usual.

    A node's first `new_node_submissions` are replayed at `new_node_fraction` (default: all of them),
    unless `fraction` is 0 (replays off).
    Replays run one at a time in their own thread (or in the engine process's, `remote_judge`, with
    `server.engine_process = true`), or, with a verifier pool (`board`), as jobs for the pool's processes, many
    at once; undecided submissions survive a restart (the ledger has them) and are decided again. The pool path
    runs in either layout: it builds the checks and reads the verdicts with verify.checks alone (no torch).

    Whether a submission is replayed depends on the draw alone, never on the step, size or timing its node
    chose: a job no pool verifier can do (each answered `unavailable`) is replayed by the coordinator itself,
    in-process or in its engine process. The one
    submission passed over without a draw is one whose step's weights this coordinator no longer holds; it
    holds the k + 2 newest steps and every open batch takes steps >= published - k only, so such a
    submission is stale for every batch and is dropped, never trained.
    """
    POOL_IN_FLIGHT = 256  # submissions awaiting the pool's verdicts at once

    def __init__(self, *, cfg: VerificationConfig, sampling: SamplingConfig, ledger: Ledger, scheduler: Scheduler,
                 policies: PolicyStore | None, metrics: CoordinatorMetrics, eos_token_id: int,
                 on_decided: Callable[[], None], board: JobBoard | None = None,
                 remote_judge: Callable[[str, int, bool], Awaitable[Judged | None]] | None = None,
                 holds: Callable[[int], bool] | None = None):
        self.cfg = cfg
        self.sampling = sampling
        self.ledger = ledger
        self.scheduler = scheduler
        self.policies = policies
        self.metrics = metrics
        self.eos_token_id = eos_token_id
        self.on_decided = on_decided  # a verdict may complete a batch: wake the trainer
        self.board = board
        # server.engine_process: the engine process holds the policies and replays there (node/coordinator/engine.py);
        # `holds` says whether it still holds a step's weights (EngineProcess.holds)
        self.remote_judge = remote_judge
        self.holds = holds
        assert (policies is None) != (remote_judge is None), "one holder of the policies: this process or the engine"
        assert (remote_judge is None) == (holds is None), "the engine's replays come with the steps it holds"
        self.stale_audit = StaleAudit(cfg.stale_audit_window, cfg.stale_audit_alpha)
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")

    def submit(self, assignment_id: str) -> None:
        self._queue.put_nowait(assignment_id)

    def pending(self) -> int:
        return self._queue.qsize()

    def chosen(self, node: NodeRow) -> bool:
        """A fresh secret draw (`fraction` = 0 switches replays off entirely, new nodes included)."""
        rate = self.cfg.fraction
        if 0 < rate and node.submissions <= self.cfg.new_node_submissions:
            rate = max(rate, self.cfg.new_node_fraction)
        return rate >= 1.0 or secrets.randbelow(1 << 32) < int(rate * (1 << 32))

    async def run(self) -> None:
        for aid in self.ledger.undecided_submissions():  # recorded before a crash, never decided
            self.submit(aid)
        slots = asyncio.Semaphore(self.POOL_IN_FLIGHT if self.board else 1)
        async with asyncio.TaskGroup() as decisions:  # cancelled with run(): every decision in flight stops
            while True:
                aid = await self._queue.get()
                await slots.acquire()
                decisions.create_task(self._decide_one(aid, slots))

    async def _decide_one(self, assignment_id: str, slots: asyncio.Semaphore) -> None:
        """One submission's verdict. A verdict that fails (a bug, a broken disk, an engine that died: an exception
        out of `decide`) is tried once more; failing again, the submission's undecided groups are voided as
        `verify_error`, with no ban and no cost to the node's reputation (nothing says it was the node's fault), and
        their places go out again. Left undecided they would hold their places in a batch that can only train
        decided groups: training stopped for good (a CI run waited 480 s on one), and after a restart as well if the
        failure repeats. Passing them unchecked instead would train whatever makes a replay fail."""
        try:
            for attempt in (1, 2):
                try:
                    await self.decide(assignment_id)
                    return
                except Exception:  # one bad submission must not stop every later verdict
                    if attempt == 2:
                        log.exception("verdict on %s failed twice; its undecided groups are voided (verify_error, no "
                                      "ban) and their places handed out again", assignment_id)
                    else:
                        log.warning("verdict on %s failed; trying once more", assignment_id, exc_info=True)
            await self._void_unjudged(assignment_id)
        except Exception:  # the ledger itself failing: nothing more to do for this submission here
            log.exception("voiding the undecided groups of %s failed; they stay undecided until the next restart",
                          assignment_id)
        finally:
            slots.release()

    async def _void_unjudged(self, assignment_id: str) -> None:
        head = self.ledger.undecided_head(assignment_id)
        node = None if head is None else self.ledger.node(head.node_id)
        if head is None or node is None:
            return
        voided = await self._void_groups(assignment_id, node.node_id, [Rejection(VERIFY_ERROR)], node.reputation,
                                         node.banned)
        self.metrics.rejected.labels(VERIFY_ERROR).inc(voided)
        self.on_decided()

    async def decide(self, assignment_id: str) -> None:
        # On the event loop: what the verdict needs is read without the submission's rollouts (Ledger.undecided_head:
        # two columns; decoding a 1.3 MB submission's data here took ~25 ms, a stall for every other request).
        # The rollouts are read, in a thread, only when this process builds the replay's checks (_undecided).
        ledger = self.ledger
        head = ledger.undecided_head(assignment_id)
        if head is None:
            return
        node = ledger.node(head.node_id)
        if node is None or node.banned:
            await self._void(head.node_id, None, [])
            return
        step = head.policy_step
        if not self.chosen(node):
            await self._write(ledger.set_verdict, assignment_id, "unchecked")
        elif not self._held(step):
            # fell out of the window while queued: not the node's fault
            log.warning("no weights of step %d left to verify %s against; passed over", step, assignment_id)
            await self._write(ledger.set_verdict, assignment_id, "unchecked")
        else:
            # the engine builds its checks from the ledger itself; the pool and an in-process replay need the rollouts
            undecided = await self._undecided(assignment_id) \
                if self.board is not None or self.remote_judge is None else None
            if undecided == []:
                return  # decided (voided with its node) while its rollouts were read
            judged = await self._judge(assignment_id, step, undecided)
            if judged is None:  # the step fell out of the window meanwhile: stale for every batch, never trained
                log.warning("no weights of step %d left to verify %s against; passed over (stale)", step,
                            assignment_id)
                await self._write(ledger.set_verdict, assignment_id, "unchecked")
                self.on_decided()
                return
            refs, verdicts = judged
            fresh = ledger.node(node.node_id)
            assert fresh is not None  # a node that submitted is never forgotten (Ledger.forget_idle_nodes)
            node = fresh
            if node.banned or ledger.undecided_head(assignment_id) is None:
                return  # banned and voided while its replay was out with the pool
            self.metrics.verified.inc(len(refs))
            failed = [Rejection(v.reason, p, i) for (p, i), v in zip(refs, verdicts) if v.reason]
            for f in failed:
                self.metrics.rejected.labels(f.reason).inc()
            if any(not v.outlier for v in verdicts if v.reason):
                voided = await self._void(node.node_id, assignment_id, failed)
                log.warning("node %s banned: a verified forgery (%s); %d rollouts voided", node.node_id[:12],
                            ", ".join(sorted({f.reason for f in failed})), voided)
                self.on_decided()  # voided groups: the trainer's batch health counts them now (not VOID_POLL_S later)
                return
            if failed:  # only single-token outliers: possibly numerical; their groups are never trained, no ban
                rep = node.reputation - self.cfg.outlier_penalty * len(failed)
                banned = rep < self.cfg.ban_below
                await self._void_groups(assignment_id, node.node_id, failed, rep, banned,
                                        {f.prompt_id for f in failed if f.prompt_id})
                log.info("node %s: %d rollouts of submission %s off by one token; their groups voided%s",
                         node.node_id[:12], len(failed), assignment_id, " (out of reputation: banned)" if banned else "")
                if banned:
                    self.on_decided()
                    return
            if await self._stale(node.node_id, assignment_id, step, undecided, refs, verdicts):
                return  # banned for generating with the previous step's weights, or banned and voided meanwhile
            tokens = sum(v.tokens for v in verdicts)
            near_ties = sum(v.near_ties for v in verdicts)
            await self._write(ledger.set_verdict, assignment_id, "verified", node_id=node.node_id, tokens=tokens,
                              near_ties=near_ties)
            await self._check_steering(node.node_id)
        self.on_decided()

    async def _undecided(self, assignment_id: str) -> list[GroupRow]:
        """The submission's groups without a verdict, rollouts decoded, in a thread (tens of ms for a large one)."""
        groups = await asyncio.to_thread(self.ledger.submission_groups, assignment_id)
        return [g for g in groups if g.verdict is None]

    async def _stale(self, node_id: str, assignment_id: str, step: int, undecided: list[GroupRow] | None,
                     refs: list[tuple[str, int]], verdicts: list[Any]) -> bool:
        """The stale-step audit (node/coordinator/stale_audit.py) of a submission that passed its replay: on a
        fresh secret draw, its rollouts replayed against step - 1 as well (before the verdict is set: the engine
        and the pool replay a submission's undecided groups); True when the node was banned for it, or was
        banned and voided by another verdict while the audit's replay ran (no verdict to set then)."""
        rate = self.cfg.stale_audit_fraction
        if step == 0 or rate <= 0 or not self._held(step - 1) or \
                not (rate >= 1.0 or secrets.randbelow(1 << 32) < int(rate * (1 << 32))):
            return False
        older = await self._judge(assignment_id, step - 1, undecided, audit=True)
        node = self.ledger.node(node_id)
        if node is None or node.banned or self.ledger.undecided_head(assignment_id) is None:
            return True  # banned and voided while the audit's replay ran
        if older is None or older[0] != refs:
            return False  # step - 1 fell out of the window meanwhile: no evidence
        if not self.stale_audit.record(node_id, [(v.fit, o.fit) for v, o in zip(verdicts, older[1])]):
            return False
        self.metrics.rejected.labels(STALE).inc()
        n = await self._void(node_id, None, [Rejection(STALE)])
        log.warning("node %s banned: its rollouts fit step %d better than the step %d they claimed, in at least %d "
                    "of a window of %d audited rollouts; %d rollouts voided", node_id[:12], step - 1, step,
                    self.stale_audit.threshold, self.stale_audit.window, n)
        return True

    def _held(self, step: int) -> bool:
        """Whether this coordinator still holds `step`'s weights, in this process or in its engine."""
        if self.policies is not None:
            return self.policies.get(step) is not None
        assert self.holds is not None  # the engine's (__init__)
        return self.holds(step)

    def _checks(self, assignment_id: str, undecided: list[GroupRow]):
        a = self.ledger.assignment(assignment_id)
        assert a is not None  # kept while a group of it waits for its verdict (Ledger.prune)
        return build_checks(undecided, {p.prompt_id: p.seeds for p in a.prompts}, self.sampling, self.eos_token_id)

    async def _judge(self, assignment_id: str, step: int, undecided: list[GroupRow] | None,
                     audit: bool = False) -> Judged | None:
        """Every rollout of the submission replayed (by the pool, else by this coordinator: here, or in its
        engine process): (prompt_id, sample_index) and its judgement, per rollout; None when no weights of
        `step` are held any more. `undecided` (the groups) is None only when the engine replays, which reads them
        itself."""
        fault_point("replay")
        built = None
        if self.board is not None:
            assert undecided is not None
            built = refs, checks, owner = self._checks(assignment_id, undecided)
            answers = await self._pool_replay(step, checks)
            if answers is not None:
                return refs, merge_turns(answers, owner, len(refs))
            # no pool verifier could get the step: never passed over for it, the coordinator replays it
            log.warning("no pool verifier could get step %d to verify %s; replaying it %s", step, assignment_id,
                        "in the engine process" if self.remote_judge is not None else "in-process")
        if self.remote_judge is not None:  # the engine holds the policies: it builds the checks from the ledger
            return await self.remote_judge(assignment_id, step, audit)
        assert undecided is not None
        refs, checks, owner = built or self._checks(assignment_id, undecided)
        answers = await self._replay_here(step, checks, audit)
        if answers is None:
            return None
        return refs, merge_turns(answers, owner, len(refs))

    async def _replay_here(self, step: int, checks: list[VerifyItem], audit: bool = False) -> list[Judgement] | None:
        """Replay in this process's verify thread; None if the step's weights are no longer held."""
        from verify.rollouts import judge

        policies = self.policies
        assert policies is not None  # in-process replays only (remote_judge otherwise)

        def replay() -> list[Judgement] | None:
            with policies.lease(step) as model:
                return None if model is None else judge(model, checks, claimed=not audit)

        return await asyncio.get_running_loop().run_in_executor(self._pool, replay)

    async def _pool_replay(self, step: int, checks: list[VerifyItem]) -> list[Judgement] | None:
        """The pool's verdicts on `checks`; None if no pool verifier could get the step (JobBoard.replay)."""
        assert self.board is not None
        s = self.sampling
        items = [M.ReplayItem(prompt_ids=c.prompt_ids, completion_ids=c.rollout.completion_ids,
                              logprobs=c.rollout.logprobs, finish_reason=c.rollout.finish_reason,
                              commitment=c.rollout.commitment or "", seed=c.seed) for c in checks]
        answers = await self.board.replay(step, items, M.Sampling(temperature=s.temperature, top_p=s.top_p,
                                                                  max_tokens=s.max_tokens))
        if answers is None:
            return None
        return [Judgement(a.reason, a.tokens, a.near_ties, a.outlier, a.fit) for a in answers]

    async def _check_steering(self, node_id: str) -> None:
        """Ban a node whose tokens are far more often not the sampler's first choice than an honest
        node's (near-ties are numerical noise; choosing among them on purpose is steering)."""
        node = self.ledger.node(node_id)
        assert node is not None  # it was just given a verdict
        if node.verified_tokens >= self.cfg.near_tie_min_tokens and \
                node.near_ties > self.cfg.near_tie_max_rate * node.verified_tokens:
            n = await self._void(node_id, None, [Rejection("verify_near_tie_rate")])
            log.warning("node %s banned: %d of its %d verified tokens were near-ties; %d rollouts voided",
                        node_id[:12], node.near_ties, node.verified_tokens, n)

    async def _write(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """A ledger write of a verdict, in a thread: a write waits for the ledger's lock, which an intake thread
        holds through its fsync'd commit of a submission (tens of ms on a slow disk, one after another while a
        batch's submissions come in); on the event loop that wait would hold up every other request."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _void_groups(self, assignment_id: str, node_id: str, rejections: list[Rejection], reputation: float,
                           banned: bool, prompt_ids: set[str] | None = None) -> int:
        """Void a submission's undecided groups (those of `prompt_ids` only, when given) in the ledger, with the
        node's new standing; the scheduler hands their places out again. Returns the rollouts voided."""
        voided, by_batch = await self._write(self.ledger.void_submission, assignment_id, node_id, rejections,
                                             reputation, banned, prompt_ids)
        self.scheduler.forget_waiting(by_batch)
        return voided

    async def _void(self, node_id: str, assignment_id: str | None, rejections: list[Rejection]) -> int:
        """Ban and void in the ledger; the scheduler hands the voided groups' places out again."""
        voided, by_batch = await self._write(self.ledger.ban_and_void, node_id, assignment_id, rejections)
        self.scheduler.forget_waiting(by_batch)
        return voided

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
