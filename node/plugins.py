"""Load a user-supplied object by "package.module:Name" (losses, advantages, tasks)."""
from __future__ import annotations

import importlib
import re
from typing import Any

from protocol.errors import PrimeNodeError

_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class PluginError(PrimeNodeError):
    pass


def import_object(path: str) -> Any:
    """Import `package.module:Name`. Only a well-formed dotted path is accepted (no file paths)."""
    if not _PATH.match(path or ""):
        raise PluginError(f"{path!r} is not an import path of the form 'package.module:Name'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"cannot import {module_name!r} (from {path!r}): {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"module {module_name!r} has no attribute {attr!r}") from None
