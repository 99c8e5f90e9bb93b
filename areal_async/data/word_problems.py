"""Word problems for the calculator: the model builds the expression from the wording.

``word_problems``: one- or two-sentence stories with three numbers, two of which the question
needs; the third is a distractor (a distance, a time, a count of something else). The wording
decides the operation (``+``: more, together; ``-``: gave away, unloaded, left; ``*``: each), so
a right answer needs the right two numbers in the right order with the right operator, e.g.

    Sam packs 23 crates with 417 apples in each crate and has 5 empty baskets. How many apples
    are in the crates?                                                       -> 23 * 417 = 9591

Rows: ``{"prompt", "answer": str(result), "a", "b", "op", "distractor", "template"}``, where
``a op b`` is the expression the problem needs (``a > b`` for ``-``), ``distractor`` the unused
number and ``template`` the story's name. Numbers are drawn from ``[lo, hi]``, the three of a
row distinct; names, objects and the story vary with the seed.

Held-out split: a row belongs to ``eval`` when a fixed hash of its unordered operand pair
``{a, b}`` falls under ``eval_fraction``, else to ``train``. Nothing else enters the hash (not
the seed, the range, the operation, the story or the distractor), so no option can put a
held-out pair of numbers into a training problem, in either order or with any operation.
``seed`` picks the stories, numbers and order; ``num_rows`` rows are drawn (repeats possible).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from areal_async.data.rows import DatasetError, Row
from areal_async.data.synthetic import OPERATIONS, is_eval_split, no_path

OPS = ("+", "-", "*")
"""The operations with stories, in the order error messages list them."""

NAMES = ("Sam", "Maya", "Leo", "Ana", "Omar", "Ivy", "Ben", "Zoe", "Raj", "Lena", "Tom", "Kira")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "stamps", "beads")


class Template(NamedTuple):
    """A story: its operation and text with ``{name}``, ``{item}``, ``{a}``, ``{b}``, ``{c}``
    (``c``: the distractor)."""

    name: str
    op: str
    text: str


TEMPLATES = (
    Template(
        "crates",
        "*",
        "{name} packs {a} crates with {b} {item} in each crate and has {c} empty baskets. "
        "How many {item} are in the crates?",
    ),
    Template(
        "bags",
        "*",
        "{name} is {c} days into a trip and buys {a} bags of {item} with {b} {item} in each bag. "
        "How many {item} did {name} buy?",
    ),
    Template(
        "rows",
        "*",
        "A hall with {c} windows has {a} rows of {item} with {b} {item} in each row. "
        "How many {item} are in the rows?",
    ),
    Template(
        "gift",
        "+",
        "{name} has {a} {item} and gets {b} more from a friend who lives {c} meters away. "
        "How many {item} does {name} have now?",
    ),
    Template(
        "shop",
        "+",
        "{name} waited {c} minutes at a shop that sold {a} {item} in the morning and {b} {item} "
        "in the afternoon. How many {item} did the shop sell that day?",
    ),
    Template(
        "floors",
        "+",
        "A library had {c} visitors today. It keeps {a} {item} on one floor and {b} {item} on "
        "another. How many {item} are on the two floors together?",
    ),
    Template(
        "give",
        "-",
        "{name} has {a} {item}, gives {b} of them away and then reads for {c} minutes. "
        "How many {item} does {name} have left?",
    ),
    Template(
        "truck",
        "-",
        "A truck carries {a} {item}. At a stop {c} km away, {b} {item} are unloaded. "
        "How many {item} are still on the truck?",
    ),
    Template(
        "lost",
        "-",
        "{name} collected {c} coins and {a} {item}, then lost {b} {item}. "
        "How many {item} does {name} have now?",
    ),
)

_MAX_DRAWS = 100_000


def load_word_problems(
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    num_rows: int = 1000,
    lo: int = 10,
    hi: int = 999,
    ops: Sequence[str] = OPS,
    eval_fraction: float = 0.1,
) -> list[Row]:
    """``num_rows`` word problems of ``split`` (``train``, or ``eval``/``test``); see the module docstring."""
    no_path("word_problems", path)
    templates = _check_options(num_rows=num_rows, lo=lo, hi=hi, ops=ops, eval_fraction=eval_fraction)
    held_out = is_eval_split(split)
    rng = random.Random(f"word_problems:{'eval' if held_out else 'train'}:{seed}")
    rows = []
    for _ in range(num_rows):
        template = rng.choice(templates)
        a, b = _draw_pair(rng, lo, hi, held_out=held_out, eval_fraction=eval_fraction)
        if template.op == "-" and a < b:
            a, b = b, a
        c = rng.randint(lo, hi)
        while c in (a, b):
            c = rng.randint(lo, hi)
        prompt = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, c=c)
        rows.append(
            {
                "prompt": prompt,
                "answer": str(OPERATIONS[template.op](a, b)),
                "a": a,
                "b": b,
                "op": template.op,
                "distractor": c,
                "template": template.name,
            }
        )
    return rows


def is_eval_operands(a: int, b: int, *, eval_fraction: float) -> bool:
    """Whether a problem on ``a`` and ``b`` (either order, any operation) is held out."""
    low, high = sorted((a, b))
    digest = hashlib.blake2b(f"areal-words:{low},{high}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < eval_fraction


def _draw_pair(
    rng: random.Random, lo: int, hi: int, *, held_out: bool, eval_fraction: float
) -> tuple[int, int]:
    for _ in range(_MAX_DRAWS):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if a != b and is_eval_operands(a, b, eval_fraction=eval_fraction) == held_out:
            return a, b
    split = "eval" if held_out else "train"
    raise DatasetError(
        f"word_problems: no {split} operand pair found in lo..hi = {lo}..{hi}; widen lo/hi or change eval_fraction"
    )


def _check_options(
    *, num_rows: int, lo: int, hi: int, ops: Sequence[str], eval_fraction: float
) -> list[Template]:
    if isinstance(ops, str) or not ops or any(op not in OPS for op in ops):
        raise DatasetError(
            f"word_problems option ops: got {ops!r}; use a non-empty list of {', '.join(OPS)} (e.g. ['+', '*'])"
        )
    if lo < 1 or hi - lo < 9:
        raise DatasetError(
            f"word_problems options lo/hi: got lo={lo}, hi={hi}; use lo >= 1 and hi >= lo + 9 "
            "(three distinct numbers a problem, and room for both splits)"
        )
    if not 0.0 < eval_fraction < 1.0:
        raise DatasetError(
            f"word_problems option eval_fraction: got {eval_fraction!r}; use a value in (0, 1)"
        )
    if num_rows < 1:
        raise DatasetError(f"word_problems option num_rows: got {num_rows!r}; use a count >= 1")
    return [t for t in TEMPLATES if t.op in ops]
