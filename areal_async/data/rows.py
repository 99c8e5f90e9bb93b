"""What a dataset row is, and the checks every loader applies.

A row is a plain dict that travels in PromptTask events (msgpack), so its values are
str / int / float / bool / None / list / dict only. It holds either

- ``prompt``: str, rendered as one user message (or encoded as-is without a chat template), or
- ``messages``: a non-empty list of ``{"role": str, "content": str}``,

plus ``answer`` (what the reward compares against) and any metadata columns, which
ride along untouched to the reward function.

``DatasetError`` is a ValueError whose message names the file, the line and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from areal_async.errors import AreaLError

Row = dict[str, Any]

_SCALARS = (str, int, float, bool, type(None))


class DatasetError(AreaLError, ValueError):
    """A dataset file, row or option is invalid; the message says where and what to do."""


def check_row(row: Mapping[str, Any], *, where: str) -> Row:
    """Validate one row and return it as a plain dict; ``where`` prefixes errors (``file:line``)."""
    if not isinstance(row, Mapping):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    has_prompt = "prompt" in row
    has_messages = "messages" in row
    if not has_prompt and not has_messages:
        raise DatasetError(
            f"{where}: missing field 'prompt' (each row needs 'prompt' or 'messages', plus 'answer')"
        )
    if "answer" not in row:
        raise DatasetError(
            f"{where}: missing field 'answer' (each row needs 'prompt' or 'messages', plus 'answer')"
        )
    if has_prompt and not isinstance(row["prompt"], str):
        raise DatasetError(f"{where}: field 'prompt' must be a string, got {type(row['prompt']).__name__}")
    if has_messages:
        _check_messages(row["messages"], where=where)
    for key, value in row.items():
        _check_value(value, where=f"{where}: field {key!r}")
    return dict(row)


def _check_messages(messages: Any, *, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: messages[{i}] must be an object with string 'role' and 'content', got {message!r:.80}"
            )


def _check_value(value: Any, *, where: str) -> None:
    if isinstance(value, _SCALARS):
        return
    if isinstance(value, list):
        for item in value:
            _check_value(item, where=where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise DatasetError(f"{where}: dict keys must be strings, got {key!r}")
            _check_value(item, where=where)
        return
    raise DatasetError(
        f"{where}: {type(value).__name__} cannot travel in an event; use str, number, list or dict"
    )
