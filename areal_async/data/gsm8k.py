"""GSM8K, from the released JSON-lines files or a local copy read by ``datasets``.

Released form (github.com/openai/grade-school-math, ``train.jsonl`` / ``test.jsonl``):
one object per line with ``question`` and ``answer``, where ``answer`` is the worked
solution ending in ``#### N``. Each row becomes

    {"prompt": question + instruction, "answer": "N", "solution": <worked solution>,
     "question": question}

with ``N`` stripped of thousands separators. ``instruction`` (default: put the final
answer in ``\\boxed{}``, which the ``gsm8k`` reward looks for first) can be replaced or
turned off with ``instruction=""``.

``path`` is a file, a folder with ``train.jsonl`` / ``test.jsonl``, or a folder the
``datasets`` library reads (``save_to_disk`` output, or a downloaded copy of the hub
repo ``openai/gsm8k``). ``datasets`` is imported only for the last case, and nothing
is downloaded: a path that does not exist is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_async.data.jsonl import read_jsonl, resolve_split_file, split_candidates
from areal_async.data.rows import DatasetError, Row, check_row

GSM8K_INSTRUCTION = "Solve the problem step by step, then put the final answer in \\boxed{}."
"""Appended to every question (after a blank line) unless ``instruction`` says otherwise."""


def parse_gsm8k_answer(solution: str) -> str:
    """The final answer of a released GSM8K solution: the text after the last ``####``, commas removed."""
    _, marker, tail = solution.rpartition("####")
    lines = tail.strip().splitlines()
    answer = lines[0].replace(",", "").strip() if lines else ""
    if not marker or not answer:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return answer


def gsm8k_row(question: str, solution: str, *, instruction: str = GSM8K_INSTRUCTION) -> Row:
    """One dataset row from a GSM8K question and its released worked solution."""
    prompt = f"{question.strip()}\n\n{instruction}" if instruction else question.strip()
    return {
        "prompt": prompt,
        "answer": parse_gsm8k_answer(solution),
        "solution": solution,
        "question": question,
    }


def load_gsm8k(
    *,
    path: str | Path | None = None,
    split: str = "train",
    seed: int = 0,
    num_rows: int | None = None,
    instruction: str = GSM8K_INSTRUCTION,
) -> list[Row]:
    """GSM8K rows of ``split`` in file order (``seed`` is unused: the cursor shuffles).

    ``num_rows`` keeps the first N rows (a fixed eval subset, a quick smoke run).
    """
    del seed
    if path is None:
        raise DatasetError(
            "dataset 'gsm8k' needs a path: the released train.jsonl/test.jsonl, their folder,"
            " or a local copy of the hub dataset openai/gsm8k"
        )
    folder = Path(path).expanduser()
    if folder.is_dir() and not any(folder.glob("*.jsonl")):
        records = _records_from_datasets(folder, split)
        source = str(folder)
    else:
        file = resolve_split_file(folder, split, kind="gsm8k")
        records = ((f"{file}:{n}", obj) for n, obj in read_jsonl(file))
        source = str(file)
    rows: list[Row] = []
    for where, obj in records:
        rows.append(_row(obj, where=where, instruction=instruction))
        if num_rows is not None and len(rows) >= num_rows:
            break
    if not rows:
        raise DatasetError(f"{source}: no GSM8K rows in split {split!r}")
    return rows


def _row(obj: dict[str, Any], *, where: str, instruction: str) -> Row:
    for field in ("question", "answer"):
        if not isinstance(obj.get(field), str):
            raise DatasetError(
                f"{where}: missing field {field!r} (released GSM8K rows have 'question' and 'answer'"
                f" ending in '#### N'); columns present: {sorted(obj)}"
            )
    try:
        return check_row(gsm8k_row(obj["question"], obj["answer"], instruction=instruction), where=where)
    except ValueError as e:
        raise DatasetError(f"{where}: {e}") from e


def _records_from_datasets(folder: Path, split: str) -> Any:
    """``(where, record)`` pairs of a local copy read by the ``datasets`` library."""
    try:
        import datasets  # heavy and optional: only this source needs it
    except ImportError as e:
        raise DatasetError(
            f"{folder}: reading this folder needs the 'datasets' package (pip install datasets),"
            " or pass the released train.jsonl / test.jsonl instead"
        ) from e
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        loaded = datasets.load_from_disk(str(folder))
        table = _pick_split(loaded, split, folder) if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        data_dir = "main" if (folder / "main").is_dir() else None
        loaded = datasets.load_dataset(str(folder), data_dir=data_dir)
        table = _pick_split(loaded, split, folder)
    return ((f"{folder}[{split}]:{i + 1}", dict(record)) for i, record in enumerate(table))


def _pick_split(splits: Any, split: str, folder: Path) -> Any:
    for name in split_candidates(split):
        if name in splits:
            return splits[name]
    raise DatasetError(f"{folder}: no split {split!r} (has {sorted(splits)})")
