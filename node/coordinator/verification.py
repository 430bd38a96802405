"""Verification of untrusted rollouts on the coordinator, off the event loop.

`PolicyStore` keeps one model per step in the async window (the exact weights nodes downloaded),
and `VerificationWorker` replays a configurable fraction of rollouts against the claimed step's
weights in its own thread, so the HTTP API never blocks on a forward pass.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("prime_node.verification")


@dataclass
class RolloutCheck:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    commitment: str
    seed: int


class PolicyStore:
    """step -> model with that step's broadcast weights (upcast to the verifier's dtype)."""

    def __init__(self, model_dir: Path, keep: int, dtype: str = "float32"):
        self.model_dir = Path(model_dir)
        self.keep = keep
        self.dtype = dtype
        self._models: dict[int, object] = {}
        self._lock = threading.Lock()

    def put(self, step: int, state) -> None:
        from node.trainer.model import load_model

        with self._lock:
            reuse = None
            while len(self._models) >= self.keep:
                oldest = min(self._models)
                reuse = self._models.pop(oldest)
        model = reuse if reuse is not None else load_model(self.model_dir, dtype=self.dtype)
        model.load_state_dict({k: v for k, v in state.items()}, strict=False)
        model.eval()
        with self._lock:
            self._models[step] = model

    def put_payload(self, step: int, path: Path) -> None:
        from protocol.checkpoint import load_payload

        self.put(step, load_payload(path))

    def get(self, step: int):
        with self._lock:
            return self._models.get(step)

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._models)


class VerificationWorker:
    def __init__(self, store: PolicyStore, *, fraction: float, eos_token_id: int, seed: int = 0):
        self.store = store
        self.fraction = fraction
        self.eos_token_id = eos_token_id
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")

    def should_verify(self) -> bool:
        return self.fraction >= 1.0 or self._rng.random() < self.fraction

    async def verify(self, step: int, checks: list[RolloutCheck], sampling: dict) -> list[str | None]:
        """Reason code per rollout (None = passed). Runs in the verification thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._verify_sync, step, checks, sampling)

    def _verify_sync(self, step: int, checks: list[RolloutCheck], sampling: dict) -> list[str | None]:
        from verify.rollouts import RolloutClaim, RolloutVerifier, VerifyItem

        model = self.store.get(step)
        if model is None:
            return ["unknown_policy_step"] * len(checks)
        items = [VerifyItem(c.prompt_ids, RolloutClaim(c.completion_ids, c.logprobs, c.finish_reason, c.commitment),
                            c.seed, sampling["temperature"], sampling["top_p"], sampling["max_tokens"],
                            self.eos_token_id) for c in checks]
        verdicts = RolloutVerifier(model).verify_many(items)
        return [None if v.ok else f"verify_{v.reason}" for v in verdicts]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
