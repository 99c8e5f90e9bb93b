"""Rewards: functions ``fn(completion, row) -> float`` and the process pool that runs them.

- ``registry.py``: built-in names (``gsm8k``, ``arithmetic``, ``arithmetic_strict``,
  ``exact_match``) and custom functions by ``package.module:function``, sync or async.
- ``math.py``: the GSM8K reward (answer extraction, normalisation, math-verify with a deadline).
- ``arithmetic.py``: rewards for the synthetic arithmetic tasks, and exact match.
- ``pool.py``: ``RewardPool``, which runs a reward function in worker processes; a call that
  raises or hangs yields reward 0 with the error recorded, and a hung worker is replaced.

Importing this package is cheap: math-verify (sympy) loads on the first gsm8k call.
"""

from areal_async.rewards.arithmetic import arithmetic_last_number, arithmetic_strict, exact_match, strip_reply
from areal_async.rewards.math import extract_answer, gsm8k_reward
from areal_async.rewards.pool import RewardOutcome, RewardPool
from areal_async.rewards.registry import (
    BUILTIN_REWARDS,
    RewardFn,
    RewardSpecError,
    call_reward,
    resolve_reward,
    reward_import_path,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardOutcome",
    "RewardPool",
    "RewardSpecError",
    "arithmetic_last_number",
    "arithmetic_strict",
    "call_reward",
    "exact_match",
    "extract_answer",
    "gsm8k_reward",
    "resolve_reward",
    "reward_import_path",
    "strip_reply",
]
