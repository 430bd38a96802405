"""verifiers environments as tasks: `task.name = "verifiers:<environment>"` (verifiers 0.4, the v1 API).

    [task]
    name = "verifiers:my-taskset"                 # an installed taskset, by id (verifiers' own loader)
    name = "verifiers:my_pkg.my_env"              # or an import path: a module exporting one Taskset
    name = "verifiers:my_pkg.my_env:MyTaskset"    #   subclass via `__all__`, or the class itself
    kwargs = { ... }                              # the taskset's config fields (`--env.taskset.*`)

An id has no "." or ":" (or has "/" or "@", as Hub ids `owner/name@version` do); anything else is an
import path. The taskset's rows (`Taskset.load()`, read once when the task is created) are the
problems: problem `index` of run seed `seed` is row `order(seed, index // N)[index % N]`, where
`order(seed, epoch)` is a permutation of the N rows drawn by `random.Random` from a string seed
(SHA-512: the same on every machine), so every epoch visits every row once. This assumes `load()`
yields the same rows in the same order each time, as verifiers' own selection (`idx`) does.

The reward is the task's own scoring (`Task.score`: its `@vf.reward` methods and config-plugged
reward functions, weighted and summed), run on the coordinator over a trace holding the prompt and
the completion as the one assistant turn; the scoring coroutine is run to completion on a private
event loop thread (bounded by `SCORE_TIMEOUT_S`), clamped to [0, 1]. A completion whose scoring
raises or times out earns 0.

Refused with a TaskError when the task is created:
- multi-turn environments (their turns cannot be re-run by the coordinator, see MULTI_TURN): an `Env` other than the single-agent one (user
  simulators, judges, best-of-n, custom `run()`), tasksets or tasks that give the model tools
  (toolsets), a taskset that bundles its own harness (agent program), rows whose prompt already
  holds assistant/tool turns or that have no prompt (the user opens the conversation);
- scoring that cannot run offline here: LLM judges (`task.judges`, they need the network), reward
  functions that need a runtime (a sandbox), tasks that need a container;
- infinite tasksets, empty ones, ones without any reward, rows with non-text prompt content.
"""
from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import math
import random
import threading
from collections import OrderedDict
from typing import Any

from node.envs.base import Problem, Task, TaskError

log = logging.getLogger(__name__)

PREFIX = "verifiers:"
INSTALL_HINT = "install prime-node's `envs` extra: pip install 'prime-node[envs]'"
# Multi-turn runs through node/envs/episode.py, which needs the environment's every turn to be a deterministic
# function of the problem and the model's text, so the coordinator can re-run it to check a worker's tokens.
# A verifiers environment's turns are arbitrary async programs (tools, user simulators, harnesses), so none
# of them qualifies; the way in is a node.envs.Task with max_turns and env_response (like guess-number).
MULTI_TURN = ("multi-turn verifiers environments are refused (the coordinator cannot re-run their turns to "
              "check a worker's tokens; write a node.envs.Task with max_turns and env_response instead)")
MAX_ROWS = 1_000_000
SCORE_TIMEOUT_S = 30.0
MAX_COMPLETION_CHARS = 65536
_CACHE_ORDERS = 4


def _import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise TaskError(f"verifiers tasks need the verifiers package ({e}); {INSTALL_HINT}") from None
    return vf


def is_import_path(target: str) -> bool:
    return "/" not in target and "@" not in target and (":" in target or "." in target)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _LoopThread:
    """One private event loop on a daemon thread: scoring coroutines run there to completion, whether
    or not the caller's thread has a running loop of its own."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, coro, timeout: float):
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="verifiers-scoring", daemon=True).start()
                self._loop = loop
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
        return future.result(timeout + 5)


class VerifiersTask(Task):
    """A single-turn verifiers taskset. Thread-safe: the coordinator samples and scores from worker threads."""

    kwargs: dict[str, Any]  # passed to the environment's loader

    def __init__(self, target: str, kwargs: dict[str, Any] | None = None) -> None:  # noqa: D107
        self.name = PREFIX + target
        self.target = target
        self.kwargs = dict(kwargs or {})
        if "id" in self.kwargs:
            raise TaskError("verifiers kwargs must not set 'id': the environment is named by task.name")
        vf = self._vf = _import_verifiers()
        taskset, env_cls, bundled_harness = self._load(vf, target, self.kwargs)
        self._refuse_multi_turn(vf, taskset, env_cls, bundled_harness)
        self._tasks = self._read_rows(taskset)
        self._prompts = [self._prompt_of(i, t.data) for i, t in enumerate(self._tasks)]
        self._check_scoring(self._tasks[0], taskset)
        self._runner = _LoopThread()
        self._lock = threading.Lock()
        self._orders: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    # -- loading -------------------------------------------------------------------------------
    def _load(self, vf, target: str, kwargs: dict[str, Any]):
        from pydantic import ValidationError

        if is_import_path(target):
            module_name, _, attr = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001 - any import failure is the name's fault here
                raise TaskError(f"cannot import verifiers environment module {module_name!r}: {_describe(e)}") from None
            exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]

            def subclasses(base):
                return [c for c in exported if isinstance(c, type) and issubclass(c, base) and c is not base]

            if attr:
                cls = getattr(module, attr, None)
                if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
                    raise TaskError(f"{target!r} is not a verifiers Taskset subclass")
            else:
                found = subclasses(vf.Taskset)
                if len(found) != 1:
                    raise TaskError(f"module {module_name!r} must export exactly one verifiers Taskset subclass "
                                    f"via __all__ (found {len(found)}); or name it: 'verifiers:{module_name}:Class'")
                cls = found[0]
            envs = subclasses(vf.Env)
            if len(envs) > 1:
                raise TaskError(f"module {module_name!r} exports {len(envs)} verifiers Env subclasses")
            env_cls = envs[0] if envs else vf.SingleAgentEnv
            from verifiers.v1.utils.generic import concrete_type

            config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            try:
                config = config_cls.model_validate({**kwargs, "id": target})
            except ValidationError as e:
                raise TaskError(f"invalid kwargs for verifiers environment {target!r}: {_errors(e)}") from None
            try:
                taskset = cls(config)
            except Exception as e:  # noqa: BLE001
                raise TaskError(f"cannot create verifiers taskset {target!r}: {_describe(e)}") from None
            return taskset, env_cls, bool(subclasses(vf.Harness))
        try:
            config = vf.resolve_env_config({"taskset": {**kwargs, "id": target}})
        except ValidationError as e:
            raise TaskError(f"invalid kwargs for verifiers environment {target!r}: {_errors(e)}") from None
        except (ModuleNotFoundError, AttributeError, TypeError) as e:
            raise TaskError(f"unknown verifiers environment {target!r} (an installed taskset package's id, or an "
                            f"import path 'verifiers:package.module'): {_describe(e)}") from None
        try:
            env_cls = vf.environment_class(config.taskset.id, config.id)
            bundled_harness = vf.default_harness_id(config.taskset.id) == config.taskset.id
            taskset = vf.load_taskset(config.taskset)
        except Exception as e:  # noqa: BLE001
            raise TaskError(f"cannot load verifiers environment {target!r}: {_describe(e)}") from None
        return taskset, env_cls, bundled_harness

    def _refuse_multi_turn(self, vf, taskset, env_cls, bundled_harness: bool) -> None:
        if not issubclass(env_cls, vf.SingleAgentEnv) or env_cls.run is not vf.SingleAgentEnv.run:
            raise TaskError(f"{MULTI_TURN}: {self.target!r} runs its agents in {env_cls.__name__} "
                            "(only the single-agent, single-turn case is)")
        if bundled_harness:
            raise TaskError(f"{MULTI_TURN}: {self.target!r} bundles its own harness (an agent program)")
        task_cls = type(taskset).task_type()
        try:
            tools = list(taskset.toolsets(taskset.config)) + list(task_cls.toolsets(taskset.config.task))
        except Exception as e:  # noqa: BLE001
            raise TaskError(f"cannot read the tools of verifiers environment {self.target!r}: {_describe(e)}") from None
        if tools:
            raise TaskError(f"{MULTI_TURN}: {self.target!r} gives the model tools "
                            f"({', '.join(type(t).__name__ for t in tools)})")
        if getattr(task_cls, "NEEDS_CONTAINER", False):
            raise TaskError(f"verifiers environment {self.target!r} needs a container runtime; prime-node scores "
                            "completions on the coordinator without one")
        if not taskset.bounded:
            raise TaskError(f"verifiers environment {self.target!r} is an infinite taskset; only finite ones "
                            "are supported (their rows are read when the task is created)")

    def _read_rows(self, taskset) -> list:
        try:
            tasks = list(itertools.islice(iter(taskset), MAX_ROWS + 1))
        except Exception as e:  # noqa: BLE001
            raise TaskError(f"cannot read the rows of verifiers environment {self.target!r}: {_describe(e)}") from None
        if not tasks:
            raise TaskError(f"verifiers environment {self.target!r} has no rows")
        if len(tasks) > MAX_ROWS:
            raise TaskError(f"verifiers environment {self.target!r} has more than {MAX_ROWS} rows; select fewer "
                            "through its kwargs")
        return tasks

    def _prompt_of(self, row: int, data) -> tuple[str | None, str]:
        """(system, user text) of one row, or a TaskError saying why it is not a single-turn prompt."""
        from verifiers.v1.types import SystemMessage, UserMessage

        where = f"verifiers environment {self.target!r}, row {row}"
        prompt, system = data.prompt, data.system_prompt
        if prompt is None:
            raise TaskError(f"{MULTI_TURN}: {where} has no prompt (the user opens the conversation)")
        if isinstance(prompt, str):
            return system, prompt
        messages = list(prompt)
        if messages and isinstance(messages[0], SystemMessage):
            system = "\n\n".join(s for s in (system, self._text(messages.pop(0).content, where)) if s)
        if len(messages) != 1 or not isinstance(messages[0], UserMessage):
            roles = [getattr(m, "role", "?") for m in data.prompt]
            raise TaskError(f"{MULTI_TURN}: {where} has a conversation as its prompt (roles {roles}); "
                            "a single-turn prompt is one user message, with an optional system message first")
        return system, self._text(messages[0].content, where)

    @staticmethod
    def _text(content, where: str) -> str:
        if isinstance(content, str):
            return content
        from verifiers.v1.types import TextContentPart

        parts = list(content or [])
        if any(not isinstance(p, TextContentPart) for p in parts):
            raise TaskError(f"{where} has non-text prompt content (images); prime-node's models take text only")
        return "\n".join(p.text for p in parts)

    def _check_scoring(self, task, taskset) -> None:
        import inspect

        judges = list(getattr(task.config, "judges", []) or [])
        if judges:
            kinds = ", ".join(str(getattr(j, "id", "") or type(j).__name__) for j in judges)
            raise TaskError(f"verifiers environment {self.target!r} scores with LLM judges ({kinds}), "
                            "which need the network; prime-node computes rewards offline on the coordinator")
        try:
            rewards = task.hooks("reward")
        except Exception as e:  # noqa: BLE001 - a plugged reward that cannot be imported
            raise TaskError(f"cannot load the rewards of verifiers environment {self.target!r}: "
                            f"{_describe(e)}") from None
        if not rewards:
            raise TaskError(f"verifiers environment {self.target!r} defines no reward (@vf.reward)")
        for fn in rewards + task.hooks("metric"):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                raise TaskError(f"verifiers environment {self.target!r}: {fn.__name__} needs a runtime (a sandbox); "
                                "prime-node scores completions on the coordinator without one")
        # The trace records the verifiers build; resolve it now (it may run `git` once) rather than
        # during the first scoring.
        from verifiers.v1.utils.version import verifiers_commit

        verifiers_commit()

    # -- problems ------------------------------------------------------------------------------
    def _order(self, seed: int, epoch: int) -> list[int]:
        key = (seed, epoch)
        with self._lock:
            order = self._orders.get(key)
            if order is not None:
                self._orders.move_to_end(key)
                return order
        order = list(range(len(self._tasks)))
        random.Random(f"{self.name}:{seed}:{epoch}").shuffle(order)
        with self._lock:
            self._orders[key] = order
            while len(self._orders) > _CACHE_ORDERS:
                self._orders.popitem(last=False)
        return order

    def row(self, seed: int, index: int) -> int:
        """Which row problem (seed, index) is."""
        if index < 0:
            raise TaskError("problem index must be >= 0")
        epoch, position = divmod(int(index), len(self._tasks))
        return self._order(int(seed), epoch)[position]

    def sample(self, seed: int, index: int) -> Problem:
        row = self.row(seed, index)
        system, prompt = self._prompts[row]
        return Problem(prompt_id=f"{self.name}:{seed}:{index}", prompt=prompt, answer={"row": row}, system=system)

    # -- reward ----------------------------------------------------------------------------------
    def _trace(self, task, completion: str):
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        vf, data = self._vf, task.data
        messages = [UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
        if data.system_prompt:
            messages.insert(0, SystemMessage(content=data.system_prompt))
        nodes: list[Any] = []  # verifiers' MessageNode (verifiers has no type information)
        for m in messages:
            nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=m))
        nodes.append(MessageNode(parent=len(nodes) - 1, message=AssistantMessage(content=completion), sampled=True))
        return Trace(task=TraceTask(type=type(task).__name__, data=data), nodes=nodes,
                     agent=AgentInfo(config=vf.AgentConfig(max_turns=1), name="agent"),
                     state=state_cls(type(task))(), is_completed=True, ok=True)

    def score(self, problem: Problem, completion: str) -> float:
        task = self._tasks[problem.answer["row"]]
        trace = self._trace(task, completion[:MAX_COMPLETION_CHARS])
        try:
            self._runner.run(task.score(trace), SCORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a completion that breaks scoring earns nothing
            log.debug("verifiers %s: scoring raised %s; reward 0", self.target, _describe(e))
            return 0.0
        reward = trace.reward
        if not math.isfinite(reward):
            return 0.0
        return min(1.0, max(0.0, reward))

    def reference(self, problem: Problem) -> str | None:
        """The row's `answer` field, when it has a string one (a common TaskData convention)."""
        answer = getattr(self._tasks[problem.answer["row"]].data, "answer", None)
        return answer if isinstance(answer, str) and answer else None


def _errors(e) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or '(root)'}: {err['msg']}" for err in e.errors())
