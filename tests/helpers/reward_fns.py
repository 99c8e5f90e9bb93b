"""Reward functions for tests, importable by path (``tests.helpers.reward_fns:NAME``) in pool workers.

``scripted_reward`` acts on the completion text so one pool can exercise every failure:
``raise`` raises, ``hang`` sleeps forever, ``exit`` kills its process, ``pid`` returns the
worker's process id, ``nan`` returns NaN, ``text`` returns a string; anything else scores
1.0 when it equals ``row["answer"]``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

NOT_A_FUNCTION = 42


def scripted_reward(completion: str, row: dict[str, Any]) -> Any:
    if completion == "raise":
        raise ValueError("scripted failure")
    if completion == "hang":
        while True:
            time.sleep(60)
    if completion == "exit":
        os._exit(3)
    if completion == "pid":
        return float(os.getpid())
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "1.0"
    return float(completion.strip() == str(row["answer"]))


async def async_reward(completion: str, row: dict[str, Any]) -> float:
    await asyncio.sleep(0.01)
    if completion == "raise":
        raise RuntimeError("async failure")
    return float(completion.strip() == str(row["answer"]))


def length_reward(completion: str, row: dict[str, Any]) -> float:
    return float(len(completion))
