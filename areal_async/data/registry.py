"""``load_dataset(kind, ...)``: one entry point for every dataset source.

``DATASETS`` maps a kind to its loader; every loader takes keyword arguments
``path``, ``split``, ``seed`` plus its own options and returns a list of rows
(see ``rows.py``). An unknown kind or option is a DatasetError with a
"did you mean" hint, so a typo in a run file fails at start-up, not mid-run.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_async.data.gsm8k import load_gsm8k
from areal_async.data.jsonl import load_jsonl
from areal_async.data.rows import DatasetError, Row
from areal_async.data.synthetic import load_arithmetic, load_mode_select
from areal_async.data.word_problems import load_word_problems

Loader = Callable[..., list[Row]]

DATASETS: dict[str, Loader] = {
    "arithmetic": load_arithmetic,
    "mode_select": load_mode_select,
    "word_problems": load_word_problems,
    "gsm8k": load_gsm8k,
    "jsonl": load_jsonl,
}


def load_dataset(
    kind: str,
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    **options: Any,
) -> list[Row]:
    """Rows of ``split`` from the source ``kind`` (``arithmetic``, ``mode_select``, ``word_problems``, ``gsm8k``,
    ``jsonl``).

    ``options`` are the source's own keyword arguments (``lo``/``hi`` for arithmetic,
    ``num_rows``, ``instruction``, ...); see each loader's signature.
    """
    loader = DATASETS.get(kind)
    if loader is None:
        raise DatasetError(
            f"unknown dataset kind {kind!r}{_hint(kind, DATASETS)} (known: {', '.join(DATASETS)})"
        )
    accepted = [
        name for name in inspect.signature(loader).parameters if name not in ("path", "split", "seed")
    ]
    for name in options:
        if name not in accepted:
            raise DatasetError(
                f"dataset {kind!r}: unknown option {name!r}{_hint(name, accepted)}"
                f" (options: {', '.join(accepted) or 'none'})"
            )
    return loader(path=path, split=split, seed=seed, **options)


def _hint(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
