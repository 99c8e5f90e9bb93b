"""The text format of tool calls, and running the calls of one model turn.

A model calls tools by writing, anywhere in its turn, one block per call in the Hermes / Qwen2
format that many chat templates document::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

``parse_tool_calls(text, tools)`` returns every call in order. A call that cannot run (not JSON,
no ``name``, an unknown tool, arguments that do not match the tool's JSON schema, a block never
closed because the turn hit ``max_new_tokens``) is still returned, with ``error`` set to a message
for the model; it never raises. ``run_tool_calls(calls, tools, timeout_s=)`` runs the calls
concurrently and returns one ``ToolOutcome`` per call, in order; a malformed call's outcome is
its error. ``tool_message(outcome)`` is the ``{"role": "tool", ...}`` chat message of an outcome.

``render_tool_prompt(tools)`` is the system-prompt text that describes the tools and the format,
for chat templates that do not take ``tools=`` themselves.

Argument checking covers the JSON-schema subset tools use for their parameters: an object with
``properties`` (each with a ``type`` among string, number, integer, boolean, array, object,
null, and optionally ``enum``), ``required`` and ``additionalProperties: false``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from areal_async.agents.tools import Tool, ToolOutcome, invoke_tool

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)
_FORMAT_HINT = f'write {TOOL_CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{TOOL_CALL_CLOSE}'
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One call found in a model turn; ``error`` is non-empty when it cannot run."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    raw: str = ""
    """The text between the tags, as the model wrote it."""


def parse_tool_calls(text: str, tools: Sequence[Tool] | Mapping[str, Tool]) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order, checked against ``tools``."""
    by_name = _by_name(tools)
    calls = []
    for number, match in enumerate(_BLOCK.finditer(text), start=1):
        raw, closed = match.group(1), bool(match.group(2))
        if closed:
            calls.append(_parse_block(raw, by_name, number))
        else:
            error = f"tool call {number}: no closing {TOOL_CALL_CLOSE} (the turn ended inside the call)"
            calls.append(ToolCall(name="", error=error, raw=raw))
    return calls


def _parse_block(raw: str, tools: Mapping[str, Tool], number: int) -> ToolCall:
    def bad(message: str, name: str = "") -> ToolCall:
        return ToolCall(name=name, error=f"tool call {number}: {message}", raw=raw)

    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        return bad(f"not valid JSON ({exc.msg} at position {exc.pos}); {_FORMAT_HINT}")
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return bad(f'needs a JSON object with a "name" string; {_FORMAT_HINT}')
    name = body["name"]
    if name not in tools:
        available = ", ".join(tools) or "none"
        return bad(f"unknown tool {name!r} (available: {available})", name)
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return bad(f'"arguments" of {name!r} must be a JSON object', name)
    if not isinstance(arguments, dict):
        return bad(f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}', name)
    problem = check_arguments(arguments, tools[name].parameters)
    if problem:
        return bad(f"tool {name!r}: {problem}", name)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def check_arguments(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    """What is wrong with ``arguments`` under ``schema`` (see the module docstring); "" when nothing."""
    properties: Mapping[str, Any] = schema.get("properties", {})
    missing = [key for key in schema.get("required", ()) if key not in arguments]
    if missing:
        return f"missing argument {missing[0]!r} (arguments: {', '.join(properties) or 'none'})"
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {key!r} (arguments: {', '.join(properties) or 'none'})"
            continue
        expected = spec.get("type")
        if expected is not None:
            kinds = (expected,) if isinstance(expected, str) else tuple(expected)
            if not any(_is_json_type(value, kind) for kind in kinds):
                return f"argument {key!r} must be {' or '.join(kinds)}, got {_json_type_name(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return ""


def _is_json_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("number", "integer"):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, object))


def _json_type_name(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _is_json_type(value, kind):
            return kind
    return type(value).__name__


async def run_tool_calls(
    calls: Sequence[ToolCall], tools: Sequence[Tool] | Mapping[str, Tool], *, timeout_s: float
) -> list[ToolOutcome]:
    """Run the valid calls concurrently; one outcome per call, in call order, never raising."""
    by_name = _by_name(tools)
    outcomes: list[ToolOutcome | None] = [None] * len(calls)

    async def run(i: int, call: ToolCall) -> None:
        outcomes[i] = await invoke_tool(by_name[call.name], call.arguments, timeout_s=timeout_s)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            if call.error:
                outcomes[i] = ToolOutcome(name=call.name or "invalid", text=f"error: {call.error}", ok=False)
            else:
                tg.start_soon(run, i, call)
    assert all(outcome is not None for outcome in outcomes)
    return [outcome for outcome in outcomes if outcome is not None]


def tool_message(outcome: ToolOutcome) -> dict[str, str]:
    """The chat message that carries a tool's result back to the model."""
    return {"role": "tool", "name": outcome.name, "content": outcome.text}


def render_tool_prompt(tools: Sequence[Tool]) -> str:
    """System-prompt text listing the tools (one JSON schema a line) and how to call them."""
    schemas = "\n".join(json.dumps(tool.schema(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more tools to help with the task. The tools are described "
        f"by these JSON schemas:\n<tools>\n{schemas}\n</tools>\n\n"
        "To call a tool, write a JSON object with its name and arguments between tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <tool name>, "arguments": <arguments object>}}\n{TOOL_CALL_CLOSE}\n'
        "The results come back in the next message. Answer without tool calls when you are done."
    )


def _by_name(tools: Sequence[Tool] | Mapping[str, Tool]) -> dict[str, Tool]:
    if isinstance(tools, Mapping):
        return dict(tools)
    by_name = {tool.name: tool for tool in tools}
    if len(by_name) != len(tools):
        names = [tool.name for tool in tools]
        raise ValueError(f"tool names must be unique, got {names}")
    return by_name
