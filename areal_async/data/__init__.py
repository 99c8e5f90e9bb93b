"""Datasets: where prompts come from, in which order, and how they become token ids.

- ``load_dataset(kind, path=, split=, seed=, **options) -> list[row]`` (``registry.py``):
  ``arithmetic`` / ``mode_select`` (synthetic), ``word_problems`` (calculator stories with a
  distractor number), ``gsm8k``, ``jsonl``.
- A row is a msgpack-able dict with ``prompt`` or ``messages``, ``answer`` and metadata
  (``rows.py``).
- ``DatasetCursor``: seeded epoch order with a checkpointable position (``cursor.py``).
- ``render_prompt(tokenizer, row)``: chat template or plain text to ids (``prompt.py``).
- SFT rows (``sft.py``) and calculator transcripts for a ``tool_use`` warm start
  (``tool_transcripts.py``).

Nothing here imports torch or transformers.
"""

from areal_async.data.cursor import DatasetCursor
from areal_async.data.gsm8k import GSM8K_INSTRUCTION, gsm8k_row, parse_gsm8k_answer
from areal_async.data.prompt import render_prompt, row_messages
from areal_async.data.registry import DATASETS, load_dataset
from areal_async.data.rows import DatasetError, Row, check_row

__all__ = [
    "DATASETS",
    "GSM8K_INSTRUCTION",
    "DatasetCursor",
    "DatasetError",
    "Row",
    "check_row",
    "gsm8k_row",
    "load_dataset",
    "parse_gsm8k_answer",
    "render_prompt",
    "row_messages",
]
