"""Intake of one submission: bounds, completeness, verification, rewards, reputation, ledger.

Order matters: cheap structural checks first (no model needed), then the verification replay for
a configurable fraction, then rewards from the task (never from the node). Nothing is acknowledged
before the ledger transaction commits.
"""
from __future__ import annotations

import logging
from collections import defaultdict

from node.coordinator.faults import crash_point
from node.coordinator.verification import RolloutCheck
from protocol import messages as M

log = logging.getLogger("prime_node.intake")


def structural_problem(r: M.RolloutSubmission, *, vocab_size: int, max_tokens: int, eos: int) -> str | None:
    """Why this rollout is impossible on its face, or None. (Pydantic already checked the types.)"""
    ids = r.completion_ids
    if any(t >= vocab_size for t in ids):
        return "token_out_of_vocab"
    if len(ids) > max_tokens:
        return "too_long"
    if eos in ids[:-1]:
        return "tokens_after_eos"
    if r.finish_reason == "stop" and ids[-1] != eos:
        return "stop_without_eos"
    if r.finish_reason == "length" and (len(ids) != max_tokens or ids[-1] == eos):
        return "length_not_reached"
    return None


class Intake:
    def __init__(self, coord):
        self.c = coord

    async def process(self, node: dict, a: dict, req: M.SubmitRequest) -> M.SubmitResponse:
        c = self.c
        cfg = c.cfg
        G = cfg.run.group_size
        slots = {p["prompt_id"]: p for p in a["prompts"]}
        reasons: dict[tuple[str, int], str] = {}
        by_prompt: dict[str, dict[int, M.RolloutSubmission]] = defaultdict(dict)

        for r in req.rollouts:
            key = (r.prompt_id, r.sample_index)
            if r.prompt_id not in slots:
                reasons[key] = "unknown_prompt"
            elif r.sample_index >= G:
                reasons[key] = "bad_sample_index"
            elif r.sample_index in by_prompt[r.prompt_id]:
                reasons[key] = "duplicate_rollout"
            else:
                problem = structural_problem(r, vocab_size=c.vocab_size, max_tokens=cfg.sampling.max_tokens,
                                             eos=c.eos_token_id)
                if problem:
                    reasons[key] = problem
                by_prompt[r.prompt_id][r.sample_index] = r

        # A group is trained on only whole: every sample present and clean.
        complete: dict[str, list[M.RolloutSubmission]] = {}
        for pid, samples in by_prompt.items():
            bad = any((pid, i) in reasons for i in samples)
            if len(samples) != G or bad:
                for i in samples:
                    reasons.setdefault((pid, i), "incomplete_group" if len(samples) != G else "group_rejected")
            else:
                complete[pid] = [samples[i] for i in range(G)]

        # Verification replay against the claimed step's weights.
        if complete and c.verifier.should_verify():
            order = [(pid, r) for pid, rs in complete.items() for r in rs]
            checks = [_verification_input(slots[pid], r) for pid, r in order]
            verdicts = await c.verifier.verify(req.policy_step, checks, dict(
                temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, max_tokens=cfg.sampling.max_tokens))
            failed_prompts = set()
            for (pid, r), v in zip(order, verdicts):
                if v is not None:
                    reasons[(pid, r.sample_index)] = v
                    failed_prompts.add(pid)
            for pid in failed_prompts:
                for r in complete.pop(pid):
                    reasons.setdefault((pid, r.sample_index), "group_rejected")
            c.metrics.verified.inc(len(order))

        # Rewards come from the task, computed here.
        groups = []
        for pid, rs in complete.items():
            slot = slots[pid]
            problem = c.task.sample(cfg.run.seed, slot["problem_index"])
            rewards = [float(c.task.score(problem, c.tokenizer.decode(r.completion_ids, skip_special_tokens=True)))
                       for r in rs]
            groups.append({
                "prompt_id": pid, "problem_index": slot["problem_index"], "batch_step": a["batch_step"],
                "policy_step": req.policy_step, "reward_mean": sum(rewards) / len(rewards),
                "data": {"prompt_ids": slot["prompt_ids"], "rollouts": [
                    {"completion_ids": r.completion_ids, "logprobs": r.logprobs, "reward": w,
                     "finish_reason": r.finish_reason, "sample_index": r.sample_index}
                    for r, w in zip(rs, rewards)]},
            })

        rejections = [{"prompt_id": p, "sample_index": i, "reason": why} for (p, i), why in reasons.items()]
        # Missing prompts (not submitted at all) go back to the queue via scheduler.finish below.
        rep = node["reputation"]
        vc = cfg.verification
        cheating = [r for r in rejections if r["reason"] not in ("incomplete_group", "group_rejected")]
        rep = rep - vc.reputation_penalty if cheating else min(vc.reputation_start, rep + vc.reputation_reward)
        banned = rep < vc.ban_below
        c.ledger.record_submission(a["assignment_id"], node["node_id"], groups, rejections, rep, banned)
        crash_point("intake")
        if banned:
            log.warning("node %s banned (reputation %.2f)", node["node_id"][:12], rep)

        accepted_ids = {g["prompt_id"] for g in groups}
        c.scheduler.finish(a["assignment_id"], accepted_ids)
        staleness = max(0, a["batch_step"] - 1 - req.policy_step)
        for g in groups:
            c.recent_staleness.append(staleness)
            c.metrics.staleness.observe(staleness)
        n_acc = sum(len(g["data"]["rollouts"]) for g in groups)
        c.metrics.accepted.inc(n_acc)
        for r in rejections:
            c.metrics.rejected.labels(r["reason"]).inc()
        if groups:
            c.training.notify()
        return M.SubmitResponse(
            accepted=[M.RolloutRef(prompt_id=g["prompt_id"], sample_index=r["sample_index"])
                      for g in groups for r in g["data"]["rollouts"]],
            rejected=[M.Rejection(**r) for r in rejections],
        )


def _verification_input(slot: dict, r: M.RolloutSubmission) -> RolloutCheck:
    return RolloutCheck(prompt_ids=slot["prompt_ids"], completion_ids=r.completion_ids, logprobs=r.logprobs,
                        finish_reason=r.finish_reason, commitment=r.commitment, seed=slot["seeds"][r.sample_index])
