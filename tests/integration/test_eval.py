"""Evaluation during training in a real coordinator: the warm-started θ_0 and every step are evaluated
on held-out prompts; the curve shows in GET /v1/status (optional `eval_curve`) and /metrics."""
from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(300)


async def drive_until_step(node: RawNode, coord, step: int, rng, max_seconds: float = 200):
    t0 = time.monotonic()
    while coord.published_step < step:
        assert time.monotonic() - t0 < max_seconds, "the coordinator did not reach the step"
        held = coord.published_step
        st, w = await node.post("/v1/work", {"policy_step": held})
        if st in (204, 429):
            await asyncio.sleep(0.05)
            continue
        assert st == 200, (st, w)
        st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"], "policy_step": held,
                                                 "rollouts": fake_rollouts(w, coord.eos_token_id, coord.vocab_size, rng)})
        assert st in (200, 409), (st, res)


async def test_eval_curve_in_status_and_metrics(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0", "run.max_steps=2", "run.batch_prompts=2",
                                   "run.group_size=4", "eval.every_steps=1", "eval.prompts=8",
                                   "trainer.warm_start_steps=2") as (coord, base):
        async with aiohttp.ClientSession() as s:
            node = RawNode(base, s)
            assert (await node.post("/v1/join", {}))[0] == 200
            await drive_until_step(node, coord, 2, random.Random(0))
            for _ in range(200):  # the evaluation of step 2 runs in the training thread just after publishing
                async with s.get(base + "/v1/status") as r:
                    status = await r.json()
                if [e["step"] for e in status.get("eval_curve", [])] == [0, 1, 2]:
                    break
                await asyncio.sleep(0.1)
            curve = status["eval_curve"]
            assert [e["step"] for e in curve] == [0, 1, 2], curve
            assert all(e["n"] == 8 and 0.0 <= e["reward"] <= 1.0 for e in curve)
            assert status["reward_curve"] and status["step"] == 2  # the existing contract is untouched
            async with s.get(base + "/metrics") as r:
                metrics = await r.text()
            values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("prime_eval_")}
            assert values["prime_eval_step"] == 2
            assert values["prime_eval_reward"] == pytest.approx(curve[-1]["reward"])
        step0 = coord.ledger.steps()[0].metrics
        assert step0["warm_start_steps"] == 2 and step0["warm_start_nll"] > 0  # θ_0 is the warm-started policy
        # the prompts handed out for training never came from the evaluation's seed stream (the evaluator is in the
        # engine process by default: its problems are the task's on eval_seed, node/coordinator/evaluation.py)
        from node.coordinator.evaluation import eval_seed

        eval_ids = {coord.task.sample(eval_seed(coord.cfg.run.seed), i).prompt_id for i in range(coord.cfg.eval.prompts)}
        if coord.engine is None:
            assert eval_ids == {p.prompt_id for p in coord.training.evaluator.problems}
        served = {g.prompt_id.split(":", 1)[1] for g in coord.ledger.groups(list(range(1, 200)))}
        assert served and not served & eval_ids


async def test_no_eval_curve_when_off(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0", "eval.every_steps=0") as (coord, base):
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/status") as r:
                status = await r.json()
        assert "eval_curve" not in status and getattr(coord.training, "evaluator", None) is None
