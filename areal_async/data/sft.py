"""Supervised fine-tuning rows: JSON lines in, token ids and loss masks out, rendered exactly as
the agent path renders an episode, so a warm start and the RL run after it see the same tokens.

A row is one JSON object a line, either

- ``{"messages": [...]}``: OpenAI chat messages (``system``/``developer``, ``user``, ``assistant``
  with optional ``tool_calls``, ``tool`` with the ``tool_call_id`` it answers), optionally with
  ``"tools"`` (OpenAI function tools) offered in this conversation, or
- ``{"prompt": "...", "completion": "..."}``.

``render_row`` turns a row into an ``SFTExample``: ``prompt_ids`` (the tokens before the first
trained token), ``completion_ids`` (everything after) and ``loss_mask`` (True on the tokens the
model generates). A ``messages`` row is replayed through ``ChatSession`` as the ``tool_use`` and
``multi_turn`` workflows record an episode:

- the messages before the first assistant message (``model.system_prompt`` prepended unless the
  row starts with a system message, ``data.prompt.row_messages``) open the session, with the tools
  the rollout offers (``tools``) or the row's own ``tools``;
- each assistant message is a model turn with the ids the model would generate: its text (the
  content, then one ``<tool_call>`` block per call, ``openai_messages.session_messages``) encoded
  without special tokens, then the tokenizer's EOS, where the agent's sampling stops; trained;
- the user and tool messages between assistant messages are context turns (``add_messages``), so
  the template's closing of the model's turn after its EOS and the next turn's header come from
  the session, as at rollout time; not trained;
- messages after the last assistant message are dropped (nothing after them is trained).

A ``prompt``/``completion`` row is rendered as the single-turn workflows render a dataset prompt
(``data.prompt.render_prompt``); the completion text is encoded and followed by EOS, all trained.

A row that cannot be trained as written is a ``BadRow`` naming the file, the line and what is
wrong; its ``kind`` is one of ``BAD_ROW_KINDS``: ``json`` (not a JSON object), ``format``
(neither or both formats, a malformed message), ``no_assistant`` (no assistant message, so no
token to train), ``template`` (the chat template cannot render the conversation turn by turn),
``tool_call`` (a tool call the rollout could not run: no tools offered, an unknown tool,
arguments that do not fit its schema) and ``too_long`` (more than ``max_tokens`` tokens).
``load_examples`` raises the first one, or with ``on_bad_row="skip"`` leaves them out and counts
them by kind; a bad row is never trained.

The tokenizer is any Hugging Face tokenizer; this module imports no ML library.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from areal_async.agents.client import ChatSession
from areal_async.agents.openai_messages import normalize_messages, parse_tools, session_messages
from areal_async.agents.toolcall import TOOL_CALL_OPEN, parse_tool_calls
from areal_async.agents.tools import Tool
from areal_async.data.prompt import render_prompt, row_messages
from areal_async.data.rows import DatasetError
from areal_async.engines.base import GenerationResult

BAD_ROW_KINDS = ("json", "format", "no_assistant", "template", "tool_call", "too_long")


class BadRow(DatasetError):
    """A row that cannot be trained as written; ``kind`` is one of ``BAD_ROW_KINDS``."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, kw_only=True)
class SFTExample:
    """One rendered row: the tokens before the first trained token, the rest, and its loss mask."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    """True on the completion tokens the model generates (one value per completion token)."""
    line: int = 0
    """1-based line of the row in its file (0: not from a file)."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True, kw_only=True)
class RenderOptions:
    """How rows are rendered: what the rollout of the same run file would put around them."""

    tools: tuple[Tool, ...] = ()
    """Tools the rollout offers (``agent.tools`` of a ``tool_use`` run); a row's ``tools`` win."""
    system_prompt: str | None = None
    """``model.system_prompt``: prepended unless a row starts with a system message."""
    use_chat_template: bool = True
    """``model.use_chat_template``: how a ``prompt``/``completion`` row's prompt is rendered."""


def render_row(tokenizer: Any, row: Any, options: RenderOptions = RenderOptions()) -> SFTExample:
    """The ``SFTExample`` of one row (module docstring); raises ``BadRow`` naming what is wrong."""
    if not isinstance(row, Mapping):
        raise BadRow(f"a row must be a JSON object, got {type(row).__name__}", kind="json")
    if ("messages" in row) == ("prompt" in row or "completion" in row):
        raise BadRow(
            f"a row needs 'messages', or 'prompt' and 'completion' (got keys {sorted(row)})", kind="format"
        )
    eos = end_of_turn_id(tokenizer)
    if "messages" in row:
        tools = options.tools
        if row.get("tools") is not None:
            tools = tuple(_bad_format(parse_tools, row["tools"]))
        return render_messages(
            tokenizer, row["messages"], tools=tools, system_prompt=options.system_prompt, eos=eos
        )
    prompt, completion = row.get("prompt"), row.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise BadRow(
            f"'prompt' and 'completion' must both be strings, got {type(prompt).__name__} and "
            f"{type(completion).__name__}",
            kind="format",
        )
    prompt_ids = render_prompt(
        tokenizer,
        {"prompt": prompt},
        use_chat_template=options.use_chat_template,
        system_prompt=options.system_prompt,
    )
    completion_ids = _encode(tokenizer, completion) + [eos]
    return SFTExample(
        prompt_ids=prompt_ids, completion_ids=completion_ids, loss_mask=[True] * len(completion_ids)
    )


def render_messages(
    tokenizer: Any,
    messages: Any,
    *,
    tools: Sequence[Tool] = (),
    system_prompt: str | None = None,
    eos: int | None = None,
) -> SFTExample:
    """A conversation replayed through ``ChatSession`` as the agent records it (module docstring)."""
    eos = end_of_turn_id(tokenizer) if eos is None else eos
    chat = session_messages(_bad_format(normalize_messages, messages), {})
    assistants = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
    if not assistants:
        raise BadRow("no assistant message: nothing to train", kind="no_assistant")
    first, last = assistants[0], assistants[-1]
    if first == 0:
        raise BadRow(
            "messages[0] is an assistant message; a conversation opens with a system or user message",
            kind="format",
        )
    for i in assistants:
        _check_tool_calls(chat[i]["content"], tools, where=f"messages[{i}]")
    opening = row_messages({"messages": chat[:first]}, system_prompt=system_prompt)
    try:
        session = ChatSession(tokenizer, opening, tools=tools)
        context: list[dict[str, Any]] = []
        for i, message in enumerate(chat[first : last + 1], start=first):
            if message["role"] != "assistant":
                context.append(message)
                continue
            if context:
                session.add_messages(context)
                context = []
            elif i != first:
                raise BadRow(
                    f"messages[{i - 1}] and messages[{i}] are both assistant messages; merge them into one",
                    kind="format",
                )
            ids = _encode(tokenizer, message["content"]) + [eos]
            session.add_model_turn(
                GenerationResult(
                    request_id=f"sft-{i}",
                    prompt_ids=tuple(session.token_ids),
                    token_ids=ids,
                    logprobs=[0.0] * len(ids),
                    versions=[0] * len(ids),
                    finish_reason="stop",
                )
            )
    except BadRow:
        raise
    except ValueError as exc:  # ChatTemplateError and the session's own checks
        raise BadRow(f"the chat template cannot render this conversation: {exc}", kind="template") from exc
    episode = session.episode()
    prompt_ids = episode.prompt_ids
    rest = episode.token_ids[len(prompt_ids) :]
    mask = [bool(m) for m in episode.loss_mask[len(prompt_ids) :]]
    return SFTExample(prompt_ids=prompt_ids, completion_ids=rest, loss_mask=mask)


def load_examples(
    path: str | Path,
    tokenizer: Any,
    options: RenderOptions = RenderOptions(),
    *,
    max_tokens: int | None = None,
    on_bad_row: Literal["error", "skip"] = "error",
) -> tuple[list[SFTExample], Counter[str]]:
    """Every row of the JSON-lines file ``path`` rendered, and the bad rows skipped by kind.

    Blank lines are ignored. With ``on_bad_row="error"`` the first bad row raises ``BadRow``
    (``<path>:<line>: <what is wrong>``); with ``"skip"`` it is left out and counted."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; set sft.data (or sft.eval_data) to a JSON-lines file")
    examples: list[SFTExample] = []
    skipped: Counter[str] = Counter()
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                example = _render_line(tokenizer, line, options, max_tokens=max_tokens)
            except BadRow as exc:
                if on_bad_row == "error":
                    raise BadRow(
                        f"{path}:{line_no}: {exc} (set sft.on_bad_row: skip to leave such rows out)",
                        kind=exc.kind,
                    ) from exc
                skipped[exc.kind] += 1
                continue
            examples.append(
                SFTExample(
                    prompt_ids=example.prompt_ids,
                    completion_ids=example.completion_ids,
                    loss_mask=example.loss_mask,
                    line=line_no,
                )
            )
    return examples, skipped


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that ends a model turn: the tokenizer's EOS, which the agent's sampling stops at."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id, so a model turn has no end; use a tokenizer with an "
            "EOS token (the one rollouts stop at)"
        )
    return int(eos)


def _render_line(tokenizer: Any, line: str, options: RenderOptions, *, max_tokens: int | None) -> SFTExample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})", kind="json") from exc
    example = render_row(tokenizer, row, options)
    if max_tokens is not None and example.length > max_tokens:
        raise BadRow(
            f"{example.length} tokens exceed sft.max_tokens={max_tokens}; shorten the row or raise "
            "max_tokens",
            kind="too_long",
        )
    if not any(example.loss_mask):
        raise BadRow("no trained token", kind="no_assistant")
    return example


def _check_tool_calls(text: str, tools: Sequence[Tool], *, where: str) -> None:
    """The tool calls of an assistant text are ones the rollout would run (``parse_tool_calls``)."""
    if TOOL_CALL_OPEN not in text:
        return
    if not tools:
        raise BadRow(
            f"{where} calls a tool, but no tools are offered; give the row a 'tools' list, or set "
            "rollout.workflow: tool_use with agent.tools",
            kind="tool_call",
        )
    for call in parse_tool_calls(text, tools):
        if call.error:
            raise BadRow(f"{where}: {call.error}", kind="tool_call")


def _bad_format(parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as exc:  # InvalidRequest names the field (messages[2].content)
        raise BadRow(str(exc), kind="format") from exc


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
