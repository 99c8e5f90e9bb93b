"""Value checks the run configuration's sections share; each error names the key and the value."""

from __future__ import annotations

from typing import Any


def positive(obj: Any, *names: str) -> None:
    """ValueError unless every named field of `obj` is > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def non_negative(obj: Any, *names: str) -> None:
    """ValueError unless every named field of `obj` is >= 0."""
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
