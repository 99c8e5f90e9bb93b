"""Loading user code named in a run file: ``package.module:attribute`` (dots allowed after the colon).

One loader for every pluggable piece (reward functions, agent workflows): a spec is a built-in name
or an import path; errors name the spec, what is wrong and the fix, and are raised as the caller's
error type so each piece keeps its own exception.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from typing import Any


def check_import_path(spec: str, *, what: str, builtins: Iterable[str], error: type[Exception]) -> str:
    """``spec`` if it has the shape ``package.module:attribute``; ``error`` naming the built-ins otherwise."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        names = list(builtins)
        close = difflib.get_close_matches(spec, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise error(
            f"unknown {what} {spec!r}{hint} (built-ins: {', '.join(names)};"
            f" a custom {what} is 'package.module:function')"
        )
    return spec


def import_object(spec: str, path: str, *, what: str, where: str, error: type[Exception]) -> Any:
    """The object ``path`` (``package.module:attr.attr``) names; ``error`` when it does not import.

    ``spec`` is what the user wrote (for messages); ``where`` names the processes that import it.
    """
    module_name, _, attr_path = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise error(
            f"{what} {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc});"
            f" check the spelling and that it is on PYTHONPATH of every {where}"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise error(f"{what} {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from exc
    return target
