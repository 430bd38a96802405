"""A verdict that fails (an exception out of the replay: a bug, a broken disk, an engine that died) must not stop
training. Its submission's groups are voided as `verify_error` after one more try, with no ban, and their places go
out again (node/coordinator/verification.py, VerdictQueue._decide_one). Before, they stayed undecided: counted in
their batch, which trains decided groups only, so the run waited forever (a CI run of the vLLM lane waited 480 s).

The failure is a real exception raised where a replay is asked for (node/coordinator/faults.py, "replay"); the
coordinator, its engine process and the worker (transformers backend, real generation) are the real ones."""
from __future__ import annotations

import pytest

from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = pytest.mark.timeout(300)


async def test_a_verdict_that_fails_voids_its_groups_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_NODE_FAULT", "replay")
    async with running_coordinator(tmp_path, "run.max_steps=2", "verification.fraction=1.0") as (coord, url):
        worker = start_worker(tmp_path, "w", coord, url)
        node = worker[0]
        try:
            await wait_for(lambda: coord.ledger.rejection_counts().get("verify_error", 0) > 0, 120,
                           "a submission voided after its replay failed twice", coord, workers=[worker])
            failed_at = coord.published_step
            monkeypatch.delenv("PRIME_NODE_FAULT")  # the verifier mended: the places voided go out again
            await wait_for(lambda: coord.published_step >= max(2, failed_at + 1), 180,
                           "training past the failed verdicts", coord, workers=[worker])
        finally:
            await stop_workers(worker)
        # every submission gets its verdict (those in the queue when the worker stopped too): none is left hanging
        await wait_for(lambda: not coord.ledger.undecided_submissions(), 60, "a verdict on every submission", coord)
        status, me = coord.status(), coord.ledger.node(node.spec.node_id)
    # not the node's fault: voided, not banned, and nothing else held against it
    assert me is not None and not me.banned and node.stats.accepted > 0
    replay_reasons = {r for r in status["verification"]["rejected_by_reason"] if r.startswith("verify_")}
    assert replay_reasons == {"verify_error"}, status["verification"]  # no replay found anything wrong
