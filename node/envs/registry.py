"""Find a task by built-in name, "reasoning-gym:<dataset>", "verifiers:<environment>" or "package.module:Class".

The reasoning-gym and verifiers modules are imported only when such a task is asked for (they are
optional, the `envs` extra, and slow to import).
"""
from __future__ import annotations

from typing import Any

from node.envs.arithmetic import Arithmetic
from node.envs.base import Task, TaskError
from node.envs.guess_number import GuessNumber
from node.envs.mental_math import MentalMath
from node.envs.reverse_text import ReverseText
from node.plugins import PluginError, import_object

BUILTIN_TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ReverseText, Arithmetic, GuessNumber, MentalMath)}


def load_task(name: str, kwargs: dict[str, Any] | None = None) -> Task:
    kwargs = dict(kwargs or {})
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name](**kwargs)
    if name.startswith("reasoning-gym:"):
        from node.envs.reasoning_gym_task import PREFIX, ReasoningGymTask

        return ReasoningGymTask(_target(name, PREFIX), kwargs)
    if name.startswith("verifiers:"):
        from node.envs.verifiers_env import PREFIX, VerifiersTask

        return VerifiersTask(_target(name, PREFIX), kwargs)
    if ":" not in name:
        raise TaskError(f"unknown task {name!r} (built-ins: {', '.join(sorted(BUILTIN_TASKS))}; "
                        "or 'reasoning-gym:<dataset>', 'verifiers:<environment>', 'package.module:Class')")
    try:
        cls = import_object(name)
    except PluginError as e:
        raise TaskError(str(e)) from None
    try:
        task = cls(**kwargs)
    except TaskError:
        raise
    except TypeError as e:
        raise TaskError(f"cannot create task {name!r} with {sorted(kwargs)}: {e}") from None
    for method in ("sample", "score"):
        if not callable(getattr(task, method, None)):
            raise TaskError(f"task {name!r} has no {method}() method")
    return task


def _target(name: str, prefix: str) -> str:
    target = name[len(prefix):].strip()
    if not target:
        raise TaskError(f"task {name!r} names nothing after {prefix!r}")
    return target
