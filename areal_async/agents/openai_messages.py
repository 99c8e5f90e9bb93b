"""OpenAI chat messages and tools, and how they map onto ``ChatSession`` and back.

Incoming (``normalize_messages``): ``system`` (also ``developer``), ``user``, ``assistant`` (with
optional ``tool_calls``) and ``tool`` messages; ``content`` is a string, a list of ``text`` parts
(joined), or null for an assistant message with tool calls. Anything else raises
``InvalidRequest`` naming the field (``messages[2].content``) and the fix.

To the chat template (``session_messages``): an assistant message from the request's history is
its content followed by one ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block per
tool call, the format the model itself writes (``toolcall``); a tool message gets the ``name``
of the call it answers (looked up by ``tool_call_id``).

Outgoing (``assistant_reply``): when the request offered tools, every ``<tool_call>`` block of
the model's text with a JSON object and a ``name`` becomes an OpenAI ``tool_calls`` entry (its
arguments re-serialised as a JSON string; they are not checked against the tool's schema) and
the content is the text outside those blocks (null when empty); ``finish_reason`` is then
``tool_calls`` unless the turn was cut by ``max_tokens``. Blocks that are not JSON stay in the
content.

``message_key`` is what makes two messages "the same" when a request repeats the conversation:
role and content (assistant contents compared without surrounding whitespace), the tool call
names with their arguments compared as parsed JSON, and a tool message's ``tool_call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from areal_async.agents.toolcall import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from areal_async.agents.tools import Tool, ToolError
from areal_async.errors import AreaLError

ROLES = ("system", "developer", "user", "assistant", "tool")


class InvalidRequest(AreaLError, ValueError):
    """A request field has a value the endpoint cannot serve; ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class FunctionTool(Tool):
    """A tool the client described (OpenAI ``{"type": "function", ...}``); the client runs it."""

    def __init__(self, name: str, description: str, parameters: dict[str, Any]) -> None:
        self.name = name  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.parameters = parameters  # type: ignore[misc]

    async def call(self, arguments: dict[str, Any]) -> str:
        raise ToolError(f"tool {self.name!r} runs in the client, not in the endpoint")


def parse_tools(tools: Any) -> list[FunctionTool]:
    """The ``tools`` field of a request as ``FunctionTool``s."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools must be a list of function tools, got {_short(tools)}", param="tools")
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise InvalidRequest(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}, '
                f"got {_short(tool)}",
                param=f"tools[{i}]",
            )
        name, parameters = (
            function.get("name"),
            function.get("parameters", {"type": "object", "properties": {}}),
        )
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}]")
        if not isinstance(parameters, dict):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be a JSON-schema object, got {_short(parameters)}",
                param=f"tools[{i}]",
            )
        parsed.append(FunctionTool(name, str(function.get("description", "")), parameters))
    names = [tool.name for tool in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools must have unique names, got {names}", param="tools")
    return parsed


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as ``{"role", "content"}`` dicts (module docstring); raises InvalidRequest."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            f"messages must be a non-empty list of chat messages, got {_short(messages)}", param="messages"
        )
    return [_normalize(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _normalize(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else None
        raise InvalidRequest(
            f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role"
        )
    role = "system" if message["role"] == "developer" else message["role"]
    tool_calls = (message.get("tool_calls") or []) if role == "assistant" else []
    content = _content(message.get("content"), f"{where}.content", optional=bool(tool_calls))
    if role == "assistant":
        return {
            "role": role,
            "content": content,
            "tool_calls": _tool_calls(tool_calls, f"{where}.tool_calls"),
        }
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidRequest(
                f"{where}.tool_call_id must be the id of the tool call it answers",
                param=f"{where}.tool_call_id",
            )
        return {"role": role, "content": content, "tool_call_id": call_id, "name": message.get("name")}
    return {"role": role, "content": content}


def _content(content: Any, where: str, *, optional: bool) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise InvalidRequest(
        f"{where} must be a string or a list of text parts, got {_short(content)} (only text is supported)",
        param=where,
    )


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(tool_calls, list):
        raise InvalidRequest(f"{where} must be a list, got {_short(tool_calls)}", param=where)
    calls = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f'{where}[{i}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                f'"arguments": "<json>"}}}}, got {_short(call)}',
                param=f"{where}[{i}]",
            )
        arguments = function.get("arguments", "{}")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": str(call.get("id", "")), "name": function["name"], "arguments": arguments})
    return calls


def session_messages(
    messages: Sequence[Mapping[str, Any]], tool_names: Mapping[str, str]
) -> list[dict[str, str]]:
    """The normalized ``messages`` as the chat template gets them (module docstring)."""
    names = dict(tool_names)
    out = []
    for m in messages:
        if m["role"] == "assistant":
            blocks = [_block(call) for call in m["tool_calls"]]
            names.update((call["id"], call["name"]) for call in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *blocks]))})
        elif m["role"] == "tool":
            name = names.get(m["tool_call_id"]) or m.get("name") or "tool"
            out.append({"role": "tool", "name": name, "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _block(call: Mapping[str, str]) -> str:
    try:
        arguments: Any = json.loads(call["arguments"])
    except json.JSONDecodeError:
        arguments = call["arguments"]
    body = json.dumps({"name": call["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def assistant_reply(
    text: str, finish_reason: str, tools: Sequence[Tool], *, call_ids: str
) -> tuple[dict[str, Any], str]:
    """The OpenAI ``message`` and ``finish_reason`` of a model turn; tool call ids are ``<call_ids>_<i>``."""
    calls = []
    content = text
    for call in parse_tool_calls(text, tools) if tools else ():
        if not call.name:  # not JSON or no name: the block stays text
            continue
        arguments = call.arguments if not call.error else json.loads(call.raw).get("arguments", {})
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        function = {"name": call.name, "arguments": arguments}
        calls.append({"id": f"{call_ids}_{len(calls)}", "type": "function", "function": function})
        content = content.replace(f"{TOOL_CALL_OPEN}{call.raw}{TOOL_CALL_CLOSE}", "", 1)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """Equality of messages across requests (module docstring); takes normalized or reply messages."""
    role = message["role"]
    if role == "assistant":
        calls = tuple(
            (c["function"]["name"], _canonical(c["function"]["arguments"]))
            if "function" in c
            else (c["name"], _canonical(c["arguments"]))
            for c in message.get("tool_calls") or ()
        )
        return (role, (message.get("content") or "").strip(), calls)
    if role == "tool":
        return (role, message["content"], message["tool_call_id"])
    return (role, message["content"])


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
