"""The stale-step audit (node/coordinator/stale_audit.py) on real LoRA rollouts, where the per-rollout replay cannot
tell step n - 1 from step n (tests/integration/test_verify_matrix_lora.py's docstring: at a 1.0 % per-step change of
the adapted weights, 0/24 stale rollouts rejected).

The fixtures are test_verify_matrix_lora's: a real tiny Qwen2 with a real peft adapter trained by real AdamW steps,
published by the real Publisher and rebuilt the way a worker rebuilds it; rollouts generated in bf16 by the
transformers engine; `verify.rollouts.judge` (what every replay path of the coordinator runs) replays each in fp32
against the claimed step and, for the audit, against step - 1; the two judgements' fits go through the wire form the
pool and the engine process send (ReplayVerdict) into the coordinator's StaleAudit with its default window and
alpha. An honest node (generates with the step it claims) is never flagged over all its rollouts; a stale node
(claims step n, generates with n - 1) is, although the per-rollout replay accepts its rollouts.
"""
from __future__ import annotations

import pytest

from node.config import VerificationConfig
from node.coordinator.stale_audit import StaleAudit
from node.coordinator.verification import merge_turns
from protocol import messages as M
from tests.integration.test_verify_matrix import items_for, prompts
from tests.integration.test_verify_matrix_lora import STEPS, _gen, _plain, lora_run
from verify.rollouts import judge

N = 64  # rollouts per node: 4 windows of 16
PER_SUBMISSION = 8  # audited a submission (8 rollouts) at a time, as VerdictQueue feeds it


def _wire(judgements):
    """Through the pool's / the engine channel's wire form and back (VerdictQueue._pool_replay, merge_turns)."""
    answers = [M.ReplayVerdict.model_validate_json(
        M.ReplayVerdict(reason=j.reason, tokens=j.tokens, near_ties=j.near_ties, outlier=j.outlier,
                        fit=j.fit).model_dump_json()) for j in judgements]
    from verify.checks import Judgement
    return merge_turns([Judgement(a.reason, a.tokens, a.near_ties, a.outlier, a.fit) for a in answers],
                       list(range(len(answers))), len(answers))


def _audit(run, generator_step: int, seed: int) -> tuple[int, int | None, int | None, int]:
    """A node claiming step STEPS and generating with `generator_step`: (rollouts the per-rollout replay rejected,
    the audited rollouts after which StaleAudit flagged it or None: as in VerdictQueue, auditing only submissions
    that passed their replay (one with a rejected rollout is the per-rollout check's: voided or banned there),
    the same auditing every submission (the audit's power alone), rollouts where step - 1 fit better)."""
    w = run["weights"]
    claimed, older = _plain(w[STEPS]).float(), _plain(w[STEPS - 1]).float()
    ps, seeds = prompts(N, seed=seed), [seed * 1000 + i for i in range(N)]
    items = items_for(ps, seeds, _gen(_plain(w[generator_step]), ps, seeds))
    now, before = _wire(judge(claimed, items)), _wire(judge(older, items))
    cfg = VerificationConfig()
    flagged_at: list[int | None] = []
    for passed_only in (True, False):
        audit = StaleAudit(cfg.stale_audit_window, cfg.stale_audit_alpha)
        flagged, audited = None, 0
        for s in range(0, N, PER_SUBMISSION):
            if passed_only and any(j.reason for j in now[s:s + PER_SUBMISSION]):
                continue
            audited += PER_SUBMISSION
            if audit.record("node", [(a.fit, b.fit) for a, b in zip(now[s:s + PER_SUBMISSION],
                                                                    before[s:s + PER_SUBMISSION])]):
                flagged = flagged or audited
        flagged_at.append(flagged)
    older_better = sum(1 for a, b in zip(now, before) if b.fit < a.fit)
    return sum(1 for j in now if j.reason), flagged_at[0], flagged_at[1], older_better


@pytest.mark.parametrize("lr, rejected_at_most", [(1e-2, N // 8), (1.5e-2, N)])
def test_stale_node_flagged_where_the_per_rollout_replay_misses_it(tmp_path, lr, rejected_at_most):
    """lr 1e-2 moves the adapted matrices by 1.0 % in step 3 (the docstring's case: the per-rollout replay misses
    nearly every stale rollout: 0/24 there, 3/64 here, 15/256 over more prompts), 1.5e-2 by 1.6 % (per rollout more than half are caught:
    15/24 in the matrix's measurement, 39/64 here; the audit still sees the submissions that slip through)."""
    run = lora_run(tmp_path / "pub", tmp_path / "worker", lr=lr)
    rel = run["rel"][STEPS]
    rejected, flagged, flagged_alone, better = _audit(run, STEPS, seed=11)
    print(f"step change {rel:.4f}: honest node: {rejected}/{N} rejected, step - 1 fit better in {better}/{N}, "
          f"flagged at {flagged_alone}")
    assert rejected == 0 and flagged_alone is None, "an honest node was rejected or flagged as stale"
    rejected, flagged, flagged_alone, better = _audit(run, STEPS - 1, seed=12)
    print(f"step change {rel:.4f}: stale node: {rejected}/{N} rejected per rollout, step - 1 fit better in "
          f"{better}/{N}; flagged after {flagged} audited rollouts of the submissions that passed their replay, "
          f"after {flagged_alone} auditing every submission")
    assert rejected <= rejected_at_most, f"{rejected} stale rollouts rejected per rollout: not the case this covers"
    assert flagged_alone is not None, f"stale node not flagged over {N} audited rollouts (step change {rel:.4f})"
    # what the coordinator does: the per-rollout replay bans on a rejected rollout, the audit sees the rest; where
    # the replay misses nearly all (1.0 %), the audit of the submissions it passed must flag the node by itself
    assert flagged is not None or (rejected_at_most == N and rejected > 0)


async def test_verdict_queue_bans_the_stale_node_and_verifies_the_honest_one(tmp_path):
    """The coordinator's own path at a 0.8 % step change (lr 8e-3; at 1.0 % the per-rollout replay catches a few
    stale rollouts, 0-3 of 64, and bans the node for them first, so the audit's part would depend on the draw of
    prompts): a real Ledger, the VerdictQueue replaying in-process
    against a PolicyStore holding steps STEPS - 1 and STEPS, submissions recorded as intake records them, audited at
    `stale_audit_fraction` 1. The honest node's submissions are all verified; the stale node is banned with
    `verify_stale_step`, every rollout of it voided. Without the audit its submissions pass their replays."""
    from node.config import SamplingConfig
    from node.coordinator.ledger import Ledger
    from node.coordinator.metrics import CoordinatorMetrics
    from node.coordinator.records import AssignmentRow, StoredRollout, SubmittedGroup
    from node.coordinator.scheduler import PromptSlot, Scheduler
    from node.coordinator.verification import PolicyStore, VerdictQueue
    from tests.integration.test_verify_matrix import EOS, MAX_TOKENS, tiny_model

    run = lora_run(tmp_path / "pub", tmp_path / "worker", lr=8e-3)
    w = run["weights"]
    tiny_model(0).save_pretrained(tmp_path / "model", safe_serialization=True)
    policies = PolicyStore(tmp_path / "model", keep=4)
    for step in (STEPS - 1, STEPS):
        policies.put(step, w[step])
    ledger = Ledger(tmp_path / "ledger.sqlite")
    scheduler = Scheduler(async_level=2, batch_prompts=64, group_size=2, prompts_per_assignment=4,
                          make_prompt=lambda i: (f"{i}:p", [3, 4]))
    vq = VerdictQueue(cfg=VerificationConfig(stale_audit_fraction=1.0), sampling=SamplingConfig(max_tokens=MAX_TOKENS),
                      ledger=ledger, scheduler=scheduler, policies=policies, metrics=CoordinatorMetrics(),
                      eos_token_id=EOS, on_decided=lambda: None)
    nodes = {"honest": ("a" * 64, STEPS, 21), "stale": ("b" * 64, STEPS - 1, 12)}
    for name, (node_id, gen_step, seed) in nodes.items():
        ledger.upsert_node(node_id, 1.0, {})
        ps, seeds = prompts(N // 2, seed=seed), [seed * 1000 + i for i in range(N)]
        pairs = [seeds[2 * i:2 * i + 2] for i in range(N // 2)]  # G = 2 seeds per prompt
        res = _gen(_plain(w[gen_step]), [p for p in ps for _ in range(2)], seeds)
        for a in range(N // PER_SUBMISSION):  # 4 prompts x 2 samples per submission
            aid, idx = f"{name}-{a}", range(4 * a, 4 * a + 4)
            slots = tuple(PromptSlot(f"{i}:{name}", i, ps[i], pairs[i], 1) for i in idx)
            ledger.add_assignment(AssignmentRow(assignment_id=aid, node_id=node_id, batch_step=1, min_policy_step=0,
                                                created_ms=0, deadline_ms=10**13, state="open", prompts=slots),
                                  next_problem_index=0)
            groups = [SubmittedGroup(f"{i}:{name}", i, 1, STEPS, 0.0, ps[i], tuple(
                StoredRollout(j, r.completion_ids, r.logprobs, 0.0, r.finish_reason, r.commitment)
                for j, r in enumerate(res[2 * i:2 * i + 2]))) for i in idx]
            ledger.record_submission(aid, node_id, groups, [], [], reputation_delta=0.0, reputation_cap=1.0,
                                     ban_below=0.0)
            await vq.decide(aid)
    honest, stale = ledger.node(nodes["honest"][0]), ledger.node(nodes["stale"][0])
    verdicts = {name: [g.verdict for a in range(N // PER_SUBMISSION) for g in ledger.submission_groups(f"{name}-{a}")]
                for name in nodes}
    rejections = ledger.rejection_counts()
    print("verdicts:", {n: {v: vs.count(v) for v in set(vs)} for n, vs in verdicts.items()}, "rejections:", rejections)
    assert honest is not None and not honest.banned and set(verdicts["honest"]) == {"verified"}
    assert stale is not None and stale.banned and set(verdicts["stale"]) == {"void"}
    assert rejections.get("verify_stale_step") == 1, rejections
    vq.close()
    ledger.close()


@pytest.mark.parametrize("lr", [2.5e-4, 5e-4])
def test_full_parameter_stale_node_flagged(lr):
    """The same attack on a full-parameter policy (a lazy node that did not fetch step n): test_verify_matrix's
    tiny Qwen2 and one real AdamW step of all its weights (`training_step`; lr 5e-3 there moves them ~2.5 %, caught
    per rollout), both steps broadcast in bf16. Full-parameter steps are caught per rollout at smaller changes than
    LoRA's (lr 1e-3, 0.6 % of the projections: 11/64 rejected), so these are smaller: 0.26 % and 0.37 %, where the
    replay rejected 0/64 stale rollouts and step n - 1 fit 60/64 and 63/64 of them better (honest: 3/64, 0/64).
    Honest node never flagged, stale node flagged."""
    import torch

    from tests.integration.test_verify_matrix import tiny_model, training_step

    before = tiny_model(0)
    after = training_step(before, lr=lr)
    weights = {STEPS - 1: {k: v.to(torch.bfloat16) for k, v in before.state_dict().items()},
               STEPS: {k: v.to(torch.bfloat16) for k, v in after.state_dict().items()}}
    rel = max(float((weights[STEPS][k].float() - weights[STEPS - 1][k].float()).norm()
                    / weights[STEPS - 1][k].float().norm()) for k in weights[STEPS] if k.endswith("proj.weight"))
    run = {"weights": weights}
    rejected, _, flagged_alone, better = _audit(run, STEPS, seed=13)
    print(f"full-parameter step change {rel:.4f}: honest node: {rejected}/{N} rejected, step - 1 fit better in "
          f"{better}/{N}, flagged at {flagged_alone}")
    assert rejected == 0 and flagged_alone is None
    rejected, flagged, flagged_alone, better = _audit(run, STEPS - 1, seed=14)
    print(f"full-parameter step change {rel:.4f}: stale node: {rejected}/{N} rejected per rollout, step - 1 fit "
          f"better in {better}/{N}; flagged after {flagged} audited rollouts of the submissions that passed")
    assert rejected <= N // 8, f"{rejected} stale rollouts rejected per rollout: not the case this covers"
    assert flagged is not None and flagged_alone is not None
