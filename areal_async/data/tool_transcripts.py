"""Calculator transcripts for a supervised warm start of the ``tool_use`` workflow, made without a model.

    python -m areal_async.data.tool_transcripts --out FILE --count N [--seed S] [--config RUN.yaml]

Each row is one correct episode as OpenAI chat messages (``areal_async/data/sft.py`` renders it):

1. ``user``: the problem exactly as the RL run's dataset renders it (``load_dataset`` of the run
   file's ``dataset`` section, ``train`` split; without ``--config`` the demo's ``word_problems``
   options ``DEMO_OPTIONS``);
2. ``assistant``: one ``calculator`` call (OpenAI ``tool_calls``) on the expression the problem
   needs, ``"{a} {op} {b}"`` from the row: for ``arithmetic`` the prompt's own expression, for
   ``word_problems`` the two numbers the question is about, in order, with the operation its
   wording asks for (never the distractor);
3. ``tool``: the calculator's own output for that call (``invoke_tool(Calculator(), ...)``, as the
   agent worker runs it);
4. ``assistant``: that output as the final answer, which the ``arithmetic`` reward scores 1.

Rows also carry ``answer`` (the dataset's) for checking; SFT reads only ``messages``. A row whose
expression does not give its answer stops the command (``DatasetError``).

Held-out problems never appear: the rows come from the ``train`` split, and the synthetic datasets
put each operand pair in ``train`` or ``eval`` by a hash of the pair alone
(``synthetic.is_eval_pair``, ``word_problems.is_eval_operands``), whatever the seed. ``seed`` picks
which training problems are drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from areal_async.agents.tools import Calculator, invoke_tool
from areal_async.data.registry import load_dataset
from areal_async.data.rows import DatasetError, Row
from areal_async.rewards.arithmetic import arithmetic_last_number

DEMO_KIND = "word_problems"
DEMO_OPTIONS: dict[str, Any] = {"lo": 10, "hi": 999}
"""The dataset of ``configs/agent_tool_words_cpu.yaml``: word problems with a distractor number."""

TOOL_TIMEOUT_S = 10.0


def tool_transcripts(
    count: int, *, seed: int = 0, kind: str = DEMO_KIND, options: Mapping[str, Any] | None = None
) -> list[Row]:
    """``count`` transcripts of training-split problems of dataset ``kind`` with ``options``."""
    if count < 1:
        raise DatasetError(f"count must be >= 1, got {count}")
    options = dict(DEMO_OPTIONS if options is None else options)
    rows = load_dataset(kind, split="train", seed=seed, num_rows=count, **options)
    return anyio.run(_transcripts, rows, backend="asyncio")


async def _transcripts(rows: Sequence[Row]) -> list[Row]:
    calculator = Calculator()
    out = []
    for index, row in enumerate(rows):
        if not {"a", "b", "op"} <= set(row):
            raise DatasetError(
                f"row {index} has no expression (keys {sorted(row)}, need a, op, b); "
                "use an 'arithmetic' or 'word_problems' dataset"
            )
        arguments = {"expression": f"{row['a']} {row['op']} {row['b']}"}
        outcome = await invoke_tool(calculator, arguments, timeout_s=TOOL_TIMEOUT_S)
        if not outcome.ok:
            raise DatasetError(f"calculator refused {arguments['expression']!r}: {outcome.text}")
        if arithmetic_last_number(outcome.text, row) != 1.0:
            raise DatasetError(
                f"calculator gave {outcome.text!r} for {row['prompt']!r}, answer {row['answer']}"
            )
        call_id = f"call_{index}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": calculator.name, "arguments": json.dumps(arguments)},
        }
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": outcome.text},
            {"role": "assistant", "content": outcome.text},
        ]
        out.append({"messages": messages, "answer": row["answer"]})
    return out


def write_jsonl(rows: Sequence[Row], path: str | Path) -> Path:
    """Write ``rows`` one JSON object a line (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m areal_async.data.tool_transcripts",
        description="Write calculator transcripts (JSON lines) for `areal-async sft` of a tool_use run.",
    )
    p.add_argument("--out", required=True, help="JSON-lines file to write")
    p.add_argument("--count", type=int, default=400, help="transcripts to write (default 400)")
    p.add_argument("--seed", type=int, default=1, help="which training problems are drawn (default 1)")
    p.add_argument(
        "--config",
        default=None,
        help="run file whose dataset section the prompts follow (default: the word-problem demo's options)",
    )
    args = p.parse_args(argv)
    kind, options = DEMO_KIND, DEMO_OPTIONS
    if args.config is not None:
        from areal_async.run_file import load_config

        dataset = load_config(args.config, []).dataset
        kind, options = dataset.kind, dataset.options
    try:
        rows = tool_transcripts(args.count, seed=args.seed, kind=kind, options=options)
    except DatasetError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    path = write_jsonl(rows, args.out)
    sys.stdout.write(
        json.dumps({"out": str(path), "rows": len(rows), "kind": kind, "options": options}) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
