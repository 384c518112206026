"""Functions a config names by path: ``"package.module:function"`` (or ``"package.module.function"``).

The reward of a custom task (``data.reward_fn``) and a custom loss (``loss.custom_fn``) are found
this way, in the process that uses them, so the module must be importable there (installed, or
in the job's ``working_dir``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(path: str, what: str = "function") -> Callable[..., Any]:
    """The callable at the path (after ``:`` it may be dotted: ``"pkg.mod:Scorer.score"``); any
    failure raises ``ValueError`` naming ``what`` and the path (the config layer adds the key)."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{what} {path!r} is not of the form 'package.module:function' or 'package.module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable (it is a {type(obj).__name__})")
    return obj
