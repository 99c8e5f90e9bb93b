"""Synthetic arithmetic tasks: seeded, unlimited, and with a held-out split that never leaks.

``arithmetic``: ``What is {a} + {b}?`` with operands in ``[lo, hi]`` (default 10..99,
two-digit addition); ``op`` is ``+``, ``-`` or ``*``; ``answer_only`` appends an
instruction to reply with just the number.

``mode_select``: the tiny variant for CI learning tests: operands 0..9 and prompts
like ``3+4=``, short enough that a small model learns them in a few steps.

Rows: ``{"prompt", "answer": str(result), "a", "b", "op"}``.

Held-out split: each operand pair belongs to ``eval`` when a fixed hash of
``a op b`` falls under ``eval_fraction``, else to ``train``. The partition depends
on nothing else (not the seed, not the range), so no seed or range setting can put
an eval problem into training. ``seed`` only picks which rows are drawn and their
order. ``num_rows=None`` returns every pair of the split once, shuffled; a larger
``num_rows`` than the split holds repeats it in freshly shuffled rounds.
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Callable
from pathlib import Path

from areal_async.data.jsonl import EVAL_SPLITS
from areal_async.data.rows import DatasetError, Row

ANSWER_ONLY_INSTRUCTION = "Answer with just the number."

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operations the synthetic datasets ask for, by the symbol their prompts and expressions use."""


def load_arithmetic(
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    num_rows: int | None = None,
    lo: int = 10,
    hi: int = 99,
    op: str = "+",
    answer_only: bool = False,
    eval_fraction: float = 0.1,
) -> list[Row]:
    """``What is {a} {op} {b}?`` rows of ``split`` (``train``, or ``eval``/``test``)."""
    no_path("arithmetic", path)
    suffix = f" {ANSWER_ONLY_INSTRUCTION}" if answer_only else ""
    return _generate(
        template="What is {a} {op} {b}?" + suffix,
        split=split,
        seed=seed,
        num_rows=num_rows,
        lo=lo,
        hi=hi,
        op=op,
        eval_fraction=eval_fraction,
    )


def load_mode_select(
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    num_rows: int | None = None,
    lo: int = 0,
    hi: int = 9,
    op: str = "+",
    eval_fraction: float = 0.1,
) -> list[Row]:
    """Tiny ``{a}{op}{b}=`` rows (operands 0..9) for CI learning tests."""
    no_path("mode_select", path)
    return _generate(
        template="{a}{op}{b}=",
        split=split,
        seed=seed,
        num_rows=num_rows,
        lo=lo,
        hi=hi,
        op=op,
        eval_fraction=eval_fraction,
    )


def is_eval_pair(a: int, b: int, op: str, *, eval_fraction: float) -> bool:
    """Whether ``a op b`` belongs to the held-out split; a pure function of the pair."""
    digest = hashlib.blake2b(f"areal-arith:{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < eval_fraction


def _generate(
    *,
    template: str,
    split: str,
    seed: int,
    num_rows: int | None,
    lo: int,
    hi: int,
    op: str,
    eval_fraction: float,
) -> list[Row]:
    if op not in OPERATIONS:
        raise DatasetError(f"arithmetic op must be one of {sorted(OPERATIONS)}, got {op!r}")
    if lo > hi:
        raise DatasetError(f"arithmetic operand range is empty: lo={lo} > hi={hi}")
    if not 0.0 < eval_fraction < 1.0:
        raise DatasetError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if num_rows is not None and num_rows < 1:
        raise DatasetError(f"num_rows must be >= 1 or null, got {num_rows}")
    held_out = is_eval_split(split)
    pairs = [
        (a, b)
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
        if is_eval_pair(a, b, op, eval_fraction=eval_fraction) == held_out
    ]
    if not pairs:
        raise DatasetError(
            f"arithmetic split {split!r} is empty for operands {lo}..{hi}; widen lo/hi or raise eval_fraction"
        )
    rng = random.Random(f"arithmetic:{'eval' if held_out else 'train'}:{seed}")
    if num_rows is None:
        chosen = rng.sample(pairs, len(pairs))
    else:
        chosen = []
        while len(chosen) < num_rows:
            chosen += rng.sample(pairs, min(len(pairs), num_rows - len(chosen)))
    compute = OPERATIONS[op]
    return [
        {"prompt": template.format(a=a, b=b, op=op), "answer": str(compute(a, b)), "a": a, "b": b, "op": op}
        for a, b in chosen
    ]


def is_eval_split(split: str) -> bool:
    """Whether ``split`` names the held-out split (``eval``/``test``); DatasetError for an unknown one."""
    if split == "train":
        return False
    if split in EVAL_SPLITS:
        return True
    raise DatasetError(f"unknown split {split!r} for a synthetic dataset; use 'train' or 'eval'")


def no_path(kind: str, path: str | Path | None) -> None:
    """DatasetError when a generated dataset ``kind`` is given a ``path``."""
    if path is not None:
        raise DatasetError(f"dataset {kind!r} is generated; it takes no path (got {str(path)!r})")
