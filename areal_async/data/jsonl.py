"""Generic JSON-lines datasets, and the file/split resolution the file-backed sources share.

Each non-blank line is one JSON object with ``prompt`` (str) or ``messages`` (list of
``{role, content}``), ``answer``, and any metadata columns. ``prompt_key`` /
``answer_key`` / ``messages_key`` rename columns of files that call them otherwise.
A bad line raises DatasetError naming the file, the 1-based line number and the field.

Splits: ``path`` is a folder holding ``<split>.jsonl``, or one file. A file serves
``train`` as itself; any other split is looked up beside it (``train.jsonl`` ->
``test.jsonl``, ``gsm8k_train.jsonl`` -> ``gsm8k_test.jsonl``) and is an error when
absent, so an eval set never silently repeats the training data. ``eval`` also finds
``test``, ``validation`` and ``val`` files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_async.data.rows import DatasetError, Row, check_row

EVAL_SPLITS = ("test", "eval", "validation", "val")
"""Names a held-out split may go by; asking for any of them finds the first that exists."""


def split_candidates(split: str) -> tuple[str, ...]:
    """File stems that may hold ``split`` (``eval`` -> test, eval, validation, val)."""
    if split in EVAL_SPLITS:
        return (split, *(s for s in EVAL_SPLITS if s != split))
    return (split,)


def resolve_split_file(path: str | Path | None, split: str, *, kind: str) -> Path:
    """The file holding ``split`` for a folder or file ``path``; DatasetError says what to pass instead."""
    if path is None:
        raise DatasetError(f"dataset {kind!r} needs a path (a .jsonl file or a folder with {split}.jsonl)")
    path = Path(path).expanduser()
    if path.is_dir():
        for stem in split_candidates(split):
            candidate = path / f"{stem}.jsonl"
            if candidate.is_file():
                return candidate
        raise DatasetError(f"{path}: no {split}.jsonl in this folder (files: {_listing(path)})")
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder (dataset {kind!r}, split {split!r})")
    if split == "train" or path.stem in split_candidates(split):
        return path
    if "train" in path.name:
        for stem in split_candidates(split):
            sibling = path.with_name(path.name.replace("train", stem))
            if sibling.is_file():
                return sibling
    raise DatasetError(
        f"{path}: no {split!r} split beside this file; put test.jsonl next to it, pass the folder,"
        " or set dataset.eval_size: 0"
    )


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line; DatasetError names file and line."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{line_number}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}:{line_number}: expected a JSON object, got {type(obj).__name__}")
            yield line_number, obj


def load_jsonl(
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    num_rows: int | None = None,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
) -> list[Row]:
    """Rows of a JSON-lines file in file order (``seed`` is unused: the cursor shuffles).

    ``num_rows`` keeps the first N rows. Renamed columns are stored under the standard names.
    """
    del seed
    file = resolve_split_file(path, split, kind="jsonl")
    rows: list[Row] = []
    for line_number, obj in read_jsonl(file):
        for key, standard in ((prompt_key, "prompt"), (messages_key, "messages"), (answer_key, "answer")):
            if key != standard and key in obj:
                obj[standard] = obj.pop(key)
        where = f"{file}:{line_number}"
        if "prompt" not in obj and "messages" not in obj:
            raise DatasetError(
                f"{where}: missing field {prompt_key!r} (each row needs {prompt_key!r} or {messages_key!r},"
                f" plus {answer_key!r}); columns present: {sorted(obj)}"
            )
        if "answer" not in obj:
            raise DatasetError(f"{where}: missing field {answer_key!r}; columns present: {sorted(obj)}")
        rows.append(check_row(obj, where=where))
        if num_rows is not None and len(rows) >= num_rows:
            break
    if not rows:
        raise DatasetError(f"{file}: no rows")
    return rows


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
