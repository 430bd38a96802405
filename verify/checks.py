"""What a replay checks and what it found, without torch: the records the coordinator's API process builds
and acts on when a verifier pool replays for it (`server.engine_process = true` imports no torch there;
docs/ARCHITECTURE.md, "Processes"). The replay itself is verify.rollouts (torch), which re-exports these.

Also the seed rules every side shares: the range of a sampling seed and the seed of each model turn of a
multi-turn episode (verify.sampler re-exports them beside the sampler they feed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MAX_SEED = 2**63 - 1


def check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"sampling seed must be an int in [0, 2**63), got {seed!r}")


def turn_seed(seed: int, turn: int) -> int:
    """The seed of model turn `turn` of a multi-turn episode (node/envs/episode.py): turn 0 keeps the
    coordinator's seed (a single-turn rollout is turn 0), later turns draw theirs from SplitMix64 of
    (seed, turn), so no two model-token positions of an episode share their random numbers."""
    check_seed(seed)
    if turn == 0:
        return seed
    mask = (1 << 64) - 1
    z = (seed + turn * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & MAX_SEED


@dataclass(frozen=True)
class RolloutClaim:
    """What a worker submits for one sample (`rollouts[]` of docs/PROTOCOL.md, "Work and submissions",
    minus the ids)."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    commitment: str

    @classmethod
    def of(cls, obj: Any) -> "RolloutClaim":
        """From a mapping, a pydantic model or any object with these attributes."""
        return cls(_field(obj, "completion_ids"), _field(obj, "logprobs"), _field(obj, "finish_reason"),
                   _field(obj, "commitment"))


def _field(obj: Any, key: str) -> Any:
    """obj[key] of a mapping, else obj's attribute `key`; None when it has neither."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


@dataclass(frozen=True)
class VerifyItem:
    """One rollout plus the assignment context it must be checked against."""

    prompt_ids: list[int]
    rollout: RolloutClaim
    seed: int
    temperature: float
    top_p: float
    max_tokens: int
    eos_token_id: int


def turn_items(prompt_ids: list[int], rollout: Any, seed: int, temperature: float, top_p: float, max_tokens: int,
               eos_token_id: int) -> list[VerifyItem]:
    """One item per model turn of a rollout (a mapping or an object; a multi-turn one has `turns`, each with the
    environment's `env_ids` before the model's turn): turn i is checked like a single-turn rollout whose prompt
    is everything before it, with seed `turn_seed(seed, i)` (node/envs/episode.py has the episode's rules).
    A single-turn rollout gives one item, itself."""
    before = list(prompt_ids)
    items = []
    for i, turn in enumerate([rollout, *(_field(rollout, "turns") or [])]):
        claim = RolloutClaim.of(turn)
        if i:
            before = before + list(turn["env_ids"] if isinstance(turn, Mapping) else turn.env_ids)
        items.append(VerifyItem(before, claim, turn_seed(seed, i), temperature, top_p, max_tokens, eos_token_id))
        before = before + list(claim.completion_ids)
    return items


@dataclass(frozen=True)
class Judgement:
    """A replay's outcome as the coordinator acts on it (its verifier pool sends the same fields)."""

    reason: str | None  # None = passed; else "verify_<Verdict.reason>"
    tokens: int
    near_ties: int
    outlier: bool = False  # failed by one sampled token only: voided, not proof of forgery
    # how far the claimed logprobs are from this step's (the verifier's mean deviation x T, whatever the
    # verdict): the stale-step audit compares it across steps (node/coordinator/stale_audit.py); None: not known
    fit: float | None = None
