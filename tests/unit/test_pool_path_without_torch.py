"""With `server.engine_process = true` and a verifier pool, the API process builds the pool's jobs and reads
its verdicts (node/coordinator/verification.py: build_checks, merge_turns, the Judgement records) and must
not import torch to do it (docs/ARCHITECTURE.md, "Processes"). Run in a fresh interpreter: a two-turn and a
single-turn rollout become three checks with the episode's turn seeds, and their judgements merge per rollout."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, sys
from types import SimpleNamespace as NS
from node.config import SamplingConfig
from node.coordinator.verification import build_checks, merge_turns
from verify.checks import Judgement, turn_seed

two_turns = NS(sample_index=0, completion_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", commitment="c",
               turns=[NS(env_ids=[7], completion_ids=[8, 2], logprobs=[-0.3, -0.4], finish_reason="stop",
                         commitment="d")])
one_turn = NS(sample_index=1, completion_ids=[9, 2], logprobs=[-0.5, -0.6], finish_reason="stop", commitment="e",
              turns=None)
group = NS(prompt_id="p", prompt_ids=[1, 3], rollouts=[two_turns, one_turn])
refs, checks, owner = build_checks([group], {"p": [11, 12]}, SamplingConfig(), eos_token_id=2)
merged = merge_turns([Judgement(None, 2, 0), Judgement("verify_sampling", 2, 1, True), Judgement(None, 2, 0)],
                     owner, len(refs))
print(json.dumps({"torch": "torch" in sys.modules, "refs": refs, "owner": owner,
                  "prompts": [c.prompt_ids for c in checks], "seeds": [c.seed for c in checks],
                  "merged": [[j.reason, j.tokens, j.near_ties, j.outlier] for j in merged],
                  "turn1": turn_seed(11, 1)}))
"""


def test_the_pool_path_builds_checks_and_merges_judgements_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    assert got["refs"] == [["p", 0], ["p", 1]] and got["owner"] == [0, 0, 1]
    # turn 1 is checked with everything before it as its prompt: prompt, turn 0's tokens, the environment's
    assert got["prompts"] == [[1, 3], [1, 3, 5, 6, 7], [1, 3]]
    assert got["seeds"] == [11, got["turn1"], 12] and got["turn1"] != 11
    # one turn off by a single sampled token: the rollout is an outlier, its tokens summed over both turns
    assert got["merged"] == [["verify_sampling", 4, 1, True], [None, 2, 0, False]]
