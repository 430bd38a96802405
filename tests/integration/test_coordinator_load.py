"""50 concurrent simulated nodes doing join/work/submit over several steps: nothing lost or duplicated."""
import asyncio
import random
import time
from collections import Counter

import aiohttp
import pytest

from tests.integration.coordinator_harness import RawNode, fake_rollouts, running_coordinator

pytestmark = pytest.mark.timeout(240)

NODES = 50
STEPS = 4


async def test_fifty_nodes_no_lost_or_duplicated_rollouts(tmp_path):
    async with running_coordinator(tmp_path, "verification.fraction=0", "run.prompts_per_assignment=1",
                                   "run.batch_prompts=16", "run.group_size=4",
                                   f"run.max_steps={STEPS}") as (coord, base):
        statuses: Counter = Counter()
        acked: list[tuple[str, str, int]] = []  # (assignment, prompt, sample) the coordinator accepted
        connector = aiohttp.TCPConnector(limit=NODES)
        async with aiohttp.ClientSession(connector=connector) as s:
            async def node_loop(i: int) -> None:
                rng = random.Random(i)
                node = RawNode(base, s)
                st, _ = await node.post("/v1/join", {})
                statuses[("join", st)] += 1
                held = 0
                deadline = time.monotonic() + 150
                while coord.published_step < STEPS and time.monotonic() < deadline:
                    st, w = await node.post("/v1/work", {"policy_step": held})
                    statuses[("work", st)] += 1
                    if st == 409:
                        held = coord.published_step  # "fetch" the newest checkpoint
                        continue
                    if st == 204:
                        await asyncio.sleep(0.05 + rng.random() * 0.1)
                        held = coord.published_step
                        continue
                    rollouts = fake_rollouts(w, coord.eos_token_id, coord.vocab_size, rng)
                    st, res = await node.post("/v1/submit", {"assignment_id": w["assignment_id"],
                                                             "policy_step": held, "rollouts": rollouts})
                    statuses[("submit", st)] += 1
                    if st == 200:
                        acked.extend((w["assignment_id"], a["prompt_id"], a["sample_index"]) for a in res["accepted"])
                    held = coord.published_step

            await asyncio.gather(*(node_loop(i) for i in range(NODES)))

        assert coord.published_step >= STEPS
        assert not any(st >= 500 for (_, st) in statuses), statuses
        assert statuses[("join", 200)] == NODES
        unexpected = {k: v for k, v in statuses.items()
                      if k not in {("join", 200), ("work", 200), ("work", 204), ("work", 409), ("submit", 200),
                                   ("submit", 409)}}
        assert not unexpected, unexpected
        # Every acknowledged rollout is in the ledger exactly once; nothing else is.
        assert len(acked) == len(set(acked))
        rows = coord.ledger._exec("SELECT assignment_id, prompt_id, data, consumed_step FROM groups").fetchall()
        import json

        stored = [(r[0], r[1], x["sample_index"]) for r in rows for x in json.loads(r[2])["rollouts"]]
        assert sorted(stored) == sorted(acked)
        # Each trained step consumed exactly one batch of whole groups.
        per_step = Counter(r[3] for r in rows if r[3] is not None)
        assert all(per_step[n] == 16 for n in range(1, STEPS + 1)), per_step
        assert coord.status()["verification"]["accepted"] == len(acked)
