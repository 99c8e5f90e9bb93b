"""Turn a dataset row into prompt token ids.

``render_prompt(tokenizer, row)``:

- chat template (when ``use_chat_template`` and the tokenizer has one): the row's
  ``messages``, or its ``prompt`` as one user message, with ``system_prompt``
  prepended unless the row already starts with a system message, rendered with
  ``add_generation_prompt=True`` and encoded without extra special tokens (the
  template places BOS where the model expects it);
- otherwise plain text: the contents joined by blank lines (system prompt first),
  encoded with the tokenizer's usual special tokens. Base models see exactly the
  prompt text, which is what synthetic prompts like ``3+4=`` need.

The tokenizer is anything with the Hugging Face tokenizer interface; this module
imports no ML library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Message = dict[str, str]


def row_messages(row: Mapping[str, Any], *, system_prompt: str | None = None) -> list[Message]:
    """The chat messages of a row: its ``messages``, or its ``prompt`` as one user turn."""
    if "messages" in row:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif "prompt" in row:
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError(f"row has neither 'prompt' nor 'messages' (keys: {sorted(row)})")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    tokenizer: Any,
    row: Mapping[str, Any],
    *,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[int]:
    """Prompt token ids of ``row`` (see the module docstring for the two renderings)."""
    messages = row_messages(row, system_prompt=system_prompt)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "\n\n".join(m["content"] for m in messages)
        ids = tokenizer(text)["input_ids"]
    return [int(i) for i in ids]
