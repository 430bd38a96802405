"""Intake of one submission, in explicit steps: triage → score → reputation → record → verdict queue.

Reputation: a structurally impossible rollout costs `reputation_penalty`; a clean submission earns
`reputation_reward` (up to the start value); below `ban_below` the node is banned. A verified forgery
bans at once (verification.py).

Nothing is acknowledged before the ledger transaction commits. Which submissions are replayed against
the claimed weights is decided afterwards, in secret, by the verdict queue (verification.py): the
answer a node gets is the same, and comes as fast, whether or not its work will be checked, and its
groups enter training only after their verdict.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field

from node.config import Config
from node.coordinator.faults import crash_point
from node.coordinator.ledger import Ledger
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.records import AssignmentRow, Rejection, StoredRollout, StoredTurn, SubmittedGroup
from node.coordinator.run_model import RunModel
from node.coordinator.scheduler import PromptSlot, Scheduler
from node.coordinator.verification import VerdictQueue
from node.envs.episode import check_episode, episode_of, episodes_texts, max_turns_of, score_episode
from protocol import messages as M
from verify.commitment import CommitmentError, chunk_bounds, commitment_chunks

log = logging.getLogger("prime_node.intake")

# Reasons that are no fault of the rollout itself (it was fine; its group was not).
COLLATERAL = ("incomplete_group", "group_rejected")


def structural_problem(r: M.RolloutSubmission, *, vocab_size: int, max_tokens: int, eos: int,
                       max_turns: int = 1) -> str | None:
    """Why this rollout is impossible on its face, or None. (Pydantic already checked the types.)
    Every model turn of a multi-turn episode meets the single-turn rules."""
    if len(r.turns) + 1 > max_turns:
        return "too_many_turns"
    for t in r.turns:
        if max(t.env_ids, default=0) >= vocab_size:
            return "token_out_of_vocab"
    for turn in [r, *r.turns]:
        problem = _turn_problem(turn, vocab_size=vocab_size, max_tokens=max_tokens, eos=eos)
        if problem:
            return problem
    return None


def _turn_problem(r: M.ModelTurnWire, *, vocab_size: int, max_tokens: int, eos: int) -> str | None:
    ids = r.completion_ids
    if max(ids, default=0) >= vocab_size:  # max() in C: a generator over 512 tokens x 128 rollouts was ~10 ms
        return "token_out_of_vocab"
    if len(ids) > max_tokens:
        return "too_long"
    if eos in ids[:-1]:
        return "tokens_after_eos"
    if r.finish_reason == "stop" and ids[-1] != eos:
        return "stop_without_eos"
    if r.finish_reason == "length" and (len(ids) != max_tokens or ids[-1] == eos):
        return "length_not_reached"
    try:  # the commitment is always checked, whether or not this submission will be replayed
        chunks = commitment_chunks(r.commitment)
    except CommitmentError:
        return "bad_commitment"
    if chunks != len(chunk_bounds(len(ids))):
        return "bad_commitment"
    return None


@dataclass
class Triage:
    complete: dict[str, list[M.RolloutSubmission]] = field(default_factory=dict)  # prompt id -> G samples
    reasons: dict[tuple[str, int], str] = field(default_factory=dict)  # (prompt id, sample) -> why rejected

    @property
    def cheated(self) -> bool:
        return any(why not in COLLATERAL for why in self.reasons.values())


class Intake:
    def __init__(self, *, cfg: Config, ledger: Ledger, scheduler: Scheduler, verdicts: VerdictQueue,
                 metrics: CoordinatorMetrics, model: RunModel, recent_staleness: deque[int]):
        self.cfg = cfg
        self.ledger = ledger
        self.scheduler = scheduler
        self.verdicts = verdicts
        self.metrics = metrics
        self.model = model
        self.recent_staleness = recent_staleness

    async def process(self, node_id: str, a: AssignmentRow, req: M.SubmitRequest) -> M.SubmitResponse:
        # Off the event loop: a 1.3 MB submission costs ~0.2 s of commitment decoding, scoring, JSON and
        # an fsync'd commit (bench/load.py), which would stall every other node's request meanwhile.
        groups, rejections, accepted, banned = await asyncio.to_thread(self._record, node_id, a, req)
        crash_point("intake")
        if banned:
            log.warning("node %s banned (reputation below %.2f)", node_id[:12], self.cfg.verification.ban_below)
        self.scheduler.finish(a.assignment_id, accepted)
        if groups:
            self.verdicts.submit(a.assignment_id)
        staleness = max(0, a.batch_step - 1 - req.policy_step)
        for _ in groups:
            self.recent_staleness.append(staleness)
            self.metrics.staleness.observe(staleness)
        self.metrics.accepted.inc(sum(len(g.rollouts) for g in groups))
        for r in rejections:
            self.metrics.rejected.labels(r.reason).inc()
        return M.SubmitResponse(
            accepted=[M.RolloutRef(prompt_id=g.prompt_id, sample_index=r.sample_index)
                      for g in groups for r in g.rollouts],
            rejected=rejections,
        )

    def _record(self, node_id: str, a: AssignmentRow,
                req: M.SubmitRequest) -> tuple[list[SubmittedGroup], list[M.Rejection], set[str], bool]:
        """triage → score → reputation → one ledger transaction (thread-safe: the ledger has its lock)."""
        slots = {p.prompt_id: p for p in a.prompts}
        t = self.triage(slots, req)
        groups = self.score(slots, a, req, t)
        accepted = {g.prompt_id for g in groups}
        requeue = [p for p in a.prompts if p.prompt_id not in accepted]
        rejections = [M.Rejection(prompt_id=p, sample_index=i, reason=why) for (p, i), why in t.reasons.items()]
        vc = self.cfg.verification
        delta = -vc.reputation_penalty if t.cheated else vc.reputation_reward
        banned = self.ledger.record_submission(a.assignment_id, node_id, groups,
                                                 [Rejection(r.reason, r.prompt_id, r.sample_index) for r in rejections],
                                                 requeue, reputation_delta=delta, reputation_cap=vc.reputation_start,
                                                 ban_below=vc.ban_below)
        return groups, rejections, accepted, banned

    def triage(self, slots: dict[str, PromptSlot], req: M.SubmitRequest) -> Triage:
        """Per-rollout structural checks; a group is kept only whole (every sample present and clean)."""
        cfg = self.cfg
        G = cfg.run.group_size
        t = Triage()
        by_prompt: dict[str, dict[int, M.RolloutSubmission]] = defaultdict(dict)
        max_turns = max_turns_of(self.model.task)
        for r in req.rollouts:
            key = (r.prompt_id, r.sample_index)
            if r.prompt_id not in slots:
                t.reasons[key] = "unknown_prompt"
            elif r.sample_index >= G:
                t.reasons[key] = "bad_sample_index"
            elif r.sample_index in by_prompt[r.prompt_id]:
                t.reasons[key] = "duplicate_rollout"
            else:
                problem = structural_problem(r, vocab_size=self.model.vocab_size, max_tokens=cfg.sampling.max_tokens,
                                             eos=self.model.eos_token_id, max_turns=max_turns)
                if not problem and max_turns > 1:
                    problem = self.episode_problem(slots[r.prompt_id], r)
                if problem:
                    t.reasons[key] = problem
                by_prompt[r.prompt_id][r.sample_index] = r
        for pid, samples in by_prompt.items():
            bad = any((pid, i) in t.reasons for i in samples)
            if len(samples) != G or bad:
                for i in samples:
                    t.reasons.setdefault((pid, i), "incomplete_group" if len(samples) != G else "group_rejected")
            else:
                t.complete[pid] = [samples[i] for i in range(G)]
        return t

    def episode_problem(self, slot: PromptSlot, r: M.RolloutSubmission) -> str | None:
        """A multi-turn episode: is every environment turn the one the environment gives (re-run here from the
        same problem and the model's turns), and does the episode end where it must?"""
        task = self.model.task
        try:
            return check_episode(task, self.model.tokenizer, task.sample(self.cfg.run.seed, slot.problem_index),
                                 *episode_of(r))
        except Exception:  # the task's environment failed on this episode's text: refuse it, never a 500
            log.warning("task %s: env_response failed on an episode of %s", getattr(task, "name", "?"), r.prompt_id,
                        exc_info=True)
            return "env_error"

    def score(self, slots: dict[str, PromptSlot], a: AssignmentRow, req: M.SubmitRequest,
              t: Triage) -> list[SubmittedGroup]:
        """Rewards come from the task, computed here (a node never reports them)."""
        task, tokenizer = self.model.task, self.model.tokenizer
        # every completion of the submission decoded in one call (without the GIL: the event loop goes on)
        texts = iter(episodes_texts(tokenizer, [episode_of(r) for rs in t.complete.values() for r in rs]))
        groups = []
        for pid, rs in t.complete.items():
            slot = slots[pid]
            problem = task.sample(self.cfg.run.seed, slot.problem_index)
            rewards = [score_episode(task, problem, next(texts)) for _ in rs]
            groups.append(SubmittedGroup(
                prompt_id=pid, problem_index=slot.problem_index, batch_step=a.batch_step,
                policy_step=req.policy_step, reward_mean=sum(rewards) / len(rewards), prompt_ids=slot.prompt_ids,
                rollouts=tuple(StoredRollout(
                    sample_index=r.sample_index, completion_ids=r.completion_ids, logprobs=r.logprobs, reward=w,
                    finish_reason=r.finish_reason, commitment=r.commitment,
                    turns=tuple(StoredTurn(env_ids=t.env_ids, completion_ids=t.completion_ids, logprobs=t.logprobs,
                                           finish_reason=t.finish_reason, commitment=t.commitment) for t in r.turns))
                    for r, w in zip(rs, rewards))))
        return groups
