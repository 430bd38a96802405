"""The contract every inference backend meets (what the worker's rollout loop relies on)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, runtime_checkable

from protocol.errors import PrimeNodeError

if TYPE_CHECKING:  # torch stays out of start-up imports
    from pathlib import Path

    from torch import Tensor

    from .adapter import LoraAdapter


class BackendError(PrimeNodeError):
    """The engine cannot start here (missing extra, wrong device): a user's setting, said in one line."""


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    seed: int  # the coordinator's per-sample seed (verify.sampler)


@dataclass(frozen=True)
class GenResult:
    completion_ids: list[int]  # ends with EOS when finish_reason == "stop"
    logprobs: list[float]  # one per completion token, under the distribution actually sampled from
    finish_reason: str  # "stop" | "length"
    commitment: str  # base64 activation commitment (verify.commitment)


@runtime_checkable
class InferenceBackend(Protocol):
    policy_step: int  # step of the weights currently loaded (-1 before the first load)
    base: str | None  # manifest hash of the full checkpoint loaded (adapters may pin it); None for merged weights

    def load_payload(self, payload: "str | Path", step: int, *, base: str | None = None) -> None:
        """Swap in the weights of a checkpoint payload (a verified .safetensors file of the same
        architecture) in place, dropping any adapter; afterwards `policy_step == step` and `self.base == base`."""

    def load_state_dict(self, state: Mapping[str, "Tensor"], step: int, *, base: str | None = None) -> None:
        """The same from tensors in memory."""

    def load_adapter(self, adapter: "LoraAdapter", step: int) -> None:
        """Generate with a verified LoRA adapter unmerged on the loaded base (worker.lora_serving = "adapter"),
        replacing the previous adapter; CheckpointError("base_mismatch") unless `self.base == adapter.base`."""

    def generate(self, requests: list[GenRequest], *, temperature: float, top_p: float, max_tokens: int,
                 eos_token_id: int) -> list[GenResult]:
        """Sample one completion per request with `verify.sampler`; results in request order."""


def check_generate_args(requests: list[GenRequest], temperature: float, top_p: float, max_tokens: int,
                        vocab_size: int) -> None:
    """Argument checks shared by the backends (raise ValueError: these are programming errors)."""
    from verify.sampler import check_sampling, check_seed

    check_sampling(temperature, top_p)
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    for r in requests:
        check_seed(r.seed)
        if not r.prompt_ids:
            raise ValueError("empty prompt")
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab_size:
            raise ValueError("prompt token id outside the vocabulary")
