"""trainer.lora in a real run (issue #29, trainer side): a real coordinator and a real in-process worker on
127.0.0.1 with `trainer.lora.rank=8`. The warm start, the RL steps and the evaluation run on the LoRA model; the
worker generates with the published (merged) weights and every rollout is replayed against them and accepted;
the trainer's base weights stay those of the model it started from."""
from __future__ import annotations

import pytest
import torch

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.timeout(300)]


async def test_a_lora_run_trains_publishes_and_verifies(tmp_path):
    from node.trainer import lora
    from node.trainer.model import load_model

    async with running_coordinator(tmp_path, "trainer.lora.rank=8", "run.max_steps=2", "run.batch_prompts=4",
                                   "run.group_size=4", "trainer.warm_start_steps=2", "eval.every_steps=1",
                                   "eval.prompts=4", "verification.fraction=1.0") as (coord, url):
        worker = start_worker(tmp_path, "w", coord, url)
        try:
            await wait_for(lambda: coord.published_step >= 2, 180, "2 training steps", coord)
        finally:
            await stop_workers(worker)
        status = coord.status()
        assert status["verification"]["rejected"] == 0 and status["verification"]["accepted"] > 0, \
            status["verification"]
        assert worker[0].stats.accepted > 0 and worker[0].stats.rejected == 0
        assert [e["step"] for e in status.get("eval_curve", [])][:3] == [0, 1, 2], status.get("eval_curve")
        assert coord.ledger.steps()[0].metrics["warm_start_steps"] == 2

        model = coord.training.trainer.model
        adapters = lora.adapter_state_dict(model)
        assert adapters and all(p.shape[0] == 8 for n, p in adapters.items() if ".lora_A." in n)
        assert any(".lora_B." in n and p.abs().max() > 0 for n, p in adapters.items())  # trained from zero
        base, start = lora.base_state_dict(model), load_model(coord.model_dir, dtype="float32").state_dict()
        assert base.keys() == start.keys()
        for name, w in start.items():
            assert torch.equal(base[name], w), name
