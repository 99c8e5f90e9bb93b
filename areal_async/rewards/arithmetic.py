"""Rewards for the synthetic arithmetic tasks (``areal_async.data.synthetic``), and exact match.

- ``arithmetic_last_number``: 1.0 when the last number in the reply equals
  ``row["answer"]`` ("The sum is 42." scores; so does "42"). A minus sign counts only
  where it cannot be a binary operator, so "50-8" ends in 8, not -8.
- ``arithmetic_strict``: 1.0 only when the reply is exactly the number, after
  trimming whitespace and end-of-sequence markers (``</s>``, ``<|im_end|>``, ...).
- ``exact_match``: 1.0 when the trimmed reply equals ``str(row["answer"])`` trimmed.

All are pure, fast and total: any completion string gives 0.0 or 1.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

EOS_MARKERS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<eos>", "<|end_of_text|>")
"""End-of-sequence strings a decoded completion may end with (when special tokens were kept)."""

_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?\d+(?:\.\d+)?")


def arithmetic_last_number(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 when the last number in ``completion`` equals ``row["answer"]``."""
    numbers = _NUMBER.findall(completion.replace("\u2212", "-"))
    if not numbers:
        return 0.0
    return float(Fraction(numbers[-1]) == Fraction(str(row["answer"]).strip()))


def arithmetic_strict(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 when ``completion`` is exactly the answer, whitespace and EOS markers trimmed."""
    return float(strip_reply(completion) == str(row["answer"]).strip())


def exact_match(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 when the trimmed completion equals the trimmed ``str(row["answer"])``."""
    return float(strip_reply(completion) == str(row["answer"]).strip())


def strip_reply(completion: str) -> str:
    """``completion`` without surrounding whitespace and trailing EOS markers."""
    text = completion.strip()
    trimmed = True
    while trimmed:
        trimmed = False
        for marker in EOS_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                trimmed = True
    return text
