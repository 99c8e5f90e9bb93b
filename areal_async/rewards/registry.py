"""Reward functions by name: the built-ins, or any ``package.module:function``.

A reward function is ``fn(completion: str, row: dict) -> float``, sync or ``async def``;
``row`` is the dataset row (``answer`` plus metadata). Built-in names:

    gsm8k              areal_async.rewards.math:gsm8k_reward
    arithmetic         areal_async.rewards.arithmetic:arithmetic_last_number
    arithmetic_strict  areal_async.rewards.arithmetic:arithmetic_strict
    exact_match        areal_async.rewards.arithmetic:exact_match

``resolve_reward(spec)`` imports and returns the function; a spec that is not a
built-in, does not import, or is not callable raises RewardSpecError (a ValueError)
saying which and how to fix it. ``call_reward(fn, completion, row)`` runs one call
to completion (``asyncio.run`` for async functions) and checks the result is a
finite number (``run_reward`` + ``as_reward``, the two steps each pool worker runs).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from areal_async.errors import AreaLError
from areal_async.imports import check_import_path, import_object

RewardFn = Callable[[str, dict[str, Any]], float | Awaitable[float]]

BUILTIN_REWARDS: dict[str, str] = {
    "gsm8k": "areal_async.rewards.math:gsm8k_reward",
    "arithmetic": "areal_async.rewards.arithmetic:arithmetic_last_number",
    "arithmetic_strict": "areal_async.rewards.arithmetic:arithmetic_strict",
    "exact_match": "areal_async.rewards.arithmetic:exact_match",
}


class RewardSpecError(AreaLError, ValueError):
    """A reward spec names no built-in and no importable callable; the message says which."""


def reward_import_path(spec: str) -> str:
    """``package.module:function`` for a built-in name or a custom spec (checked for shape only)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    return check_import_path(spec, what="reward", builtins=BUILTIN_REWARDS, error=RewardSpecError)


def resolve_reward(spec: str) -> RewardFn:
    """Import the reward function named by ``spec`` (a built-in name or ``package.module:function``)."""
    path = reward_import_path(spec)
    target = import_object(spec, path, what="reward", where="reward worker", error=RewardSpecError)
    if not callable(target):
        raise RewardSpecError(
            f"reward {spec!r} is not callable (it is {type(target).__name__});"
            " it must be a function fn(completion: str, row: dict) -> float"
        )
    return target


def call_reward(fn: RewardFn, completion: str, row: Mapping[str, Any]) -> float:
    """One reward call, sync or async, checked to be a finite number (TypeError / ValueError otherwise)."""
    return as_reward(run_reward(fn, completion, row))


def run_reward(fn: RewardFn, completion: str, row: Mapping[str, Any]) -> Any:
    """Call ``fn`` and, when it returns an awaitable, run that to completion with ``asyncio.run``."""
    result: Any = fn(completion, dict(row))
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


def as_reward(result: Any) -> float:
    """``result`` as a finite float; TypeError for non-numbers (strings included), ValueError for nan/inf."""
    if isinstance(result, str | bytes) or not hasattr(result, "__float__"):
        raise TypeError(f"reward function returned {type(result).__name__}, expected a float")
    reward = float(result)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}, expected a finite float")
    return reward


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
