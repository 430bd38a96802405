"""reasoning-gym datasets as tasks: `task.name = "reasoning-gym:<dataset>"`.

    [task]
    name = "reasoning-gym:basic_arithmetic"
    kwargs = { min_terms = 2, max_terms = 2, max_digits = 1, operators = ["+", "-"] }

`task.kwargs` are the dataset's own config fields (reasoning_gym.create_dataset(name, **kwargs)), checked
when the task is created: an unknown field, a value the dataset's `validate()` refuses or one that fails
to generate a problem is a TaskError. `seed` is not a kwarg (it is the run's `run.seed`); `size` is the
dataset's "virtual size", used here as the chunk length (below).

Determinism. `sample(seed, index)` is a pure function of (dataset, kwargs, seed, index):

    chunk, position = divmod(index, size)
    dataset = create_dataset(name, **kwargs, size=size, seed=dataset_seed(seed, chunk))
    problem = dataset[position]

Most reasoning-gym datasets generate by index: item i is drawn from `random.Random(seed + i)`. Taking
`create_dataset(name, seed=run_seed)[index]` directly would make problem i+1 of seed s the same as
problem i of seed s+1, and reasoning-gym's own ReseedingDataset (seed + chunk) repeats problems from
one chunk to the next for such datasets. Hence the chunk seed is derived by SHA-256 from (dataset,
seed, chunk) instead. Datasets that generate up front (item i depends on `size`, or an index past
`size` raises) are covered by the same rule, since `size` is fixed by the kwargs and every index
falls inside its chunk. A few datasets are refused because their problems depend on process state
(PYTHONHASHSEED), or because their scorer evaluates the completion as code (below).

Reward: the dataset's own `score_answer(answer, entry)`, run on the coordinator with the dataset
instance that generated the problem. `answer` is the text of the completion's last
`<answer>...</answer>` block when it has one (reasoning-gym's convention), otherwise the whole
completion, stripped. A scorer that raises counts as 0; the reward is clamped to [0, 1].
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import OrderedDict
from typing import Any

from node.envs.base import Problem, Task, TaskError

log = logging.getLogger(__name__)

PREFIX = "reasoning-gym:"
INSTALL_HINT = "install prime-node's `envs` extra: pip install 'prime-node[envs]'"
AUDITED_VERSION = "0.1.25"  # UNSAFE_SCORERS and PROCESS_DEPENDENT were checked against this release

# score_answer() of these evaluates the completion as Python (eval) or through sympy's parse_expr
# (itself eval-based): a worker could run code on the coordinator by submitting a crafted completion.
# tests/unit/test_envs_external.py re-runs the audit on the installed package.
UNSAFE_SCORERS: dict[str, str] = {
    **{name: "calls eval() on the completion" for name in
       ("binary_matrix", "n_queens", "spiral_matrix", "string_insertion")},
    **{name: "parses the completion with sympy's parse_expr (eval-based)" for name in
       ("countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "intermediate_integration")},
}
# Problems differ from one process to the next (they depend on PYTHONHASHSEED), so a coordinator
# restart or a verifier would see other problems under the same (seed, index). Measured on 0.1.25:
# two processes with different PYTHONHASHSEED, 60 problems per dataset (every other dataset matched,
# and generated the same items in any order and on repeated reads).
PROCESS_DEPENDENT: frozenset[str] = frozenset({
    "codeio", "intermediate_integration", "isomorphic_strings", "knight_swap", "list_functions",
    "polynomial_multiplication", "ransom_note", "word_ladder"})
UNSUPPORTED: dict[str, str] = {"composite": "mixes datasets; run one dataset per task"}

MAX_COMPLETION_CHARS = 8192  # bounded work for a scorer on untrusted text
_CACHE_DATASETS = 8


def _import_reasoning_gym():
    try:
        import reasoning_gym  # noqa: F401 - registers every dataset
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import extract_answer
    except ImportError as e:
        raise TaskError(f"reasoning-gym tasks need the reasoning-gym package ({e}); {INSTALL_HINT}") from None
    return DATASETS, extract_answer


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning-gym")
    except PackageNotFoundError:
        return "unknown"


def dataset_seed(dataset: str, seed: int, chunk: int) -> int:
    """The seed of chunk `chunk` of run seed `seed`: 31 bits of SHA-256, the same on every machine."""
    digest = hashlib.sha256(f"reasoning-gym:{dataset}:{seed}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**31)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class ReasoningGymTask(Task):
    """One reasoning-gym dataset. Thread-safe: the coordinator samples and scores from worker threads."""

    kwargs: dict[str, Any]  # the dataset config's own fields, checked by reasoning-gym

    def __init__(self, dataset: str, kwargs: dict[str, Any] | None = None) -> None:  # noqa: D107
        self.name = PREFIX + dataset
        self.dataset = dataset
        self.kwargs = dict(kwargs or {})
        datasets, self._extract_answer = _import_reasoning_gym()
        version = _installed_version()
        if dataset not in datasets:
            raise TaskError(f"unknown reasoning-gym dataset {dataset!r} (reasoning-gym {version} has "
                            f"{len(datasets)}: e.g. {', '.join(sorted(datasets)[:6])}, ...)")
        if version != AUDITED_VERSION:
            log.warning("reasoning-gym %s is installed; its scorers were audited for %s (UNSAFE_SCORERS)",
                        version, AUDITED_VERSION)
        if dataset in UNSUPPORTED:
            raise TaskError(f"reasoning-gym dataset {dataset!r} is not supported: {UNSUPPORTED[dataset]}")
        if dataset in UNSAFE_SCORERS:
            raise TaskError(f"reasoning-gym dataset {dataset!r} is refused: its scorer {UNSAFE_SCORERS[dataset]}, "
                            "and rewards are computed on the coordinator from completions that workers submit")
        if dataset in PROCESS_DEPENDENT:
            raise TaskError(f"reasoning-gym dataset {dataset!r} is refused: its problems depend on PYTHONHASHSEED, "
                            "so the coordinator could not re-create them after a restart")
        if "seed" in self.kwargs:
            raise TaskError("reasoning-gym kwargs must not set 'seed': problems are seeded by run.seed")
        self._dataset_cls, self._config_cls = datasets[dataset]
        size = self.kwargs.pop("size", None)
        if size is None:
            size = getattr(self._config_cls, "size", 500)
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 10**7:
            raise TaskError(f"reasoning-gym kwarg 'size' must be an integer in 1..10000000, not {size!r}")
        self.size = size
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int], Any] = OrderedDict()
        # Bad kwargs show here, not at the first prompt: build one chunk and generate from it.
        probe = self._make_dataset(0, 0)
        try:
            entry = probe[0]
            self._check_entry(entry)
        except TaskError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to generate is the kwargs' fault here
            raise TaskError(f"reasoning-gym dataset {dataset!r} cannot generate problems with kwargs "
                            f"{self.kwargs}: {_describe(e)}") from None

    # -- problems ------------------------------------------------------------------------------
    def _make_dataset(self, seed: int, chunk: int):
        try:
            config = self._config_cls(**self.kwargs, size=self.size, seed=dataset_seed(self.dataset, seed, chunk))
        except TypeError as e:
            fields = ", ".join(f for f in sorted(getattr(self._config_cls, "__dataclass_fields__", {})) if f != "seed")
            raise TaskError(f"invalid kwargs for reasoning-gym dataset {self.dataset!r}: {e} "
                            f"(task.kwargs are the dataset's config fields: {fields})") from None
        try:
            if hasattr(config, "validate"):
                config.validate()
            return self._dataset_cls(config=config)
        except Exception as e:  # noqa: BLE001 - AssertionError/ValueError from the dataset's validate()
            raise TaskError(f"invalid kwargs for reasoning-gym dataset {self.dataset!r}: {_describe(e)}") from None

    def _chunk(self, seed: int, chunk: int):
        key = (seed, chunk)
        with self._lock:
            ds = self._cache.get(key)
            if ds is not None:
                self._cache.move_to_end(key)
                return ds
        ds = self._make_dataset(seed, chunk)
        with self._lock:
            self._cache[key] = ds
            while len(self._cache) > _CACHE_DATASETS:
                self._cache.popitem(last=False)
        return ds

    def _check_entry(self, entry: dict) -> None:
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str) or "answer" not in entry:
            raise TaskError(f"reasoning-gym dataset {self.dataset!r} produced an item without question/answer")

    def entry(self, seed: int, index: int) -> dict:
        """The dataset's own item for (seed, index): question, answer, metadata."""
        if index < 0:
            raise TaskError("problem index must be >= 0")
        chunk, position = divmod(int(index), self.size)
        entry = self._chunk(int(seed), chunk)[position]
        self._check_entry(entry)
        return entry

    def sample(self, seed: int, index: int) -> Problem:
        entry = self.entry(seed, index)
        answer = {"answer": entry["answer"], "metadata": entry.get("metadata", {})}
        return Problem(prompt_id=f"{self.name}:{seed}:{index}", prompt=entry["question"], answer=answer)

    # -- reward ----------------------------------------------------------------------------------
    def _scorer_for(self, problem: Problem):
        """The dataset instance that generated `problem` (scorers may read their instance's config)."""
        try:
            seed, index = (int(x) for x in problem.prompt_id[len(self.name) + 1:].split(":"))
            return self._chunk(seed, index // self.size)
        except (ValueError, TaskError):
            return self._chunk(0, 0)

    def extract(self, completion: str) -> str:
        """What the scorer is given: the last <answer>...</answer> block, else the stripped completion."""
        text = completion[:MAX_COMPLETION_CHARS]
        if "<answer>" in text:
            found = self._extract_answer(text)
            if found is not None:
                return found
        return text.strip()

    def score(self, problem: Problem, completion: str) -> float:
        entry = {"question": problem.prompt, **problem.answer}
        try:
            reward = float(self._scorer_for(problem).score_answer(self.extract(completion), entry))
        except Exception as e:  # noqa: BLE001 - a completion that breaks the scorer earns nothing
            log.debug("reasoning-gym %s: scorer raised %s; reward 0", self.dataset, _describe(e))
            return 0.0
        if not math.isfinite(reward):
            return 0.0
        return min(1.0, max(0.0, reward))

    def reference(self, problem: Problem) -> str | None:
        answer = problem.answer.get("answer")
        return answer if isinstance(answer, str) and answer else None
