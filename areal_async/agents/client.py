"""How an agent talks to the policy: the inference client protocol and the chat session.

``InferenceClient`` is anything with ``async def generate(prompt_ids, sampling) -> GenerationResult``
(the dataclasses of ``areal_async.engines.base``, which import no ML library). ``EngineClient``
adapts an in-process ``InferenceEngine``; a client that forwards calls to remote generation
workers implements the same method.

``ChatSession`` owns the token sequence of one conversation and records it as ``Turn``s:

- it starts from the opening messages rendered with the tokenizer's chat template
  (``add_generation_prompt=True``), encoded without extra special tokens;
- ``add_model_turn(result)`` appends exactly the generated ids (with their log-probs and
  versions); the model's text is decoded for reading only, never encoded again;
- ``add_messages(messages)`` appends new user / tool / environment messages as the delta of the
  chat template: the conversation is rendered as text without and with the new messages (the
  latter with the generation prompt) and only the suffix is tokenized. In front of it goes the
  part of the template's end-of-assistant-turn text the model did not generate itself (after its
  ``<|im_end|>``: the newline; after a turn cut by ``max_new_tokens``: the whole closing). Should
  the template rewrite earlier assistant turns once a message follows (some drop reasoning text),
  the delta is taken with neutral stand-ins for the assistant contents; a template whose earlier
  text still changes raises ChatTemplateError.

Tools: with ``tools=``, a template that renders a ``tools=`` argument (Qwen2.5 / Hermes style)
gets the tool schemas that way; otherwise the text of ``render_tool_prompt`` is appended to the
system message (one is added when there is none). A template without a ``tool`` role (it raises
on it or drops it) receives each tool result as a ``user`` message that starts with
``TOOL_RESULT_PREFIX`` (``"Result of tool <name>:"`` and a newline); consecutive results share
one message.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from areal_async.agents.episode import Episode, Turn
from areal_async.agents.toolcall import render_tool_prompt
from areal_async.agents.tools import Tool
from areal_async.engines.base import GenerationRequest, GenerationResult, InferenceEngine, SamplingParams
from areal_async.errors import AreaLError

TOOL_RESULT_PREFIX = "Result of tool {name}:\n"
_SENTINEL = "areal-probe-7f3a9c"
_CONTEXT_ROLES = ("user", "tool", "environment")


class ChatTemplateError(AreaLError, ValueError):
    """The tokenizer's chat template cannot render the conversation as the session needs."""


@runtime_checkable
class InferenceClient(Protocol):
    """Samples one completion of ``prompt_ids``; the result carries ids, log-probs and versions."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult: ...


class EngineClient:
    """An ``InferenceClient`` over an in-process ``InferenceEngine`` (one request per call)."""

    def __init__(self, engine: InferenceEngine, *, request_prefix: str = "agent") -> None:
        self.engine = engine
        self._ids = (f"{request_prefix}-{n}" for n in itertools.count())

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        request = GenerationRequest(
            request_id=next(self._ids), prompt_ids=tuple(prompt_ids), sampling=sampling
        )
        [result] = await self.engine.generate([request])
        return result


class ChatSession:
    """The token sequence of one conversation (see the module docstring for the rules)."""

    def __init__(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Tool] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template; ChatSession renders conversations with one "
                "(use an instruct model's tokenizer or set tokenizer.chat_template)"
            )
        self.tokenizer = tokenizer
        self.tools = tuple(tools)
        self._template_kwargs: dict[str, Any] = {}
        opening = [_check_message(m, i) for i, m in enumerate(messages)]
        if not opening:
            raise ValueError("ChatSession needs at least one opening message")
        if self.tools:
            if template_renders_tools(tokenizer):
                self._template_kwargs["tools"] = [tool.schema() for tool in self.tools]
            else:
                opening = _with_system_text(opening, render_tool_prompt(self.tools))
        self.tool_role = template_has_tool_role(tokenizer)
        self._closing = self._assistant_closing()
        self._messages = opening
        text = self._render(opening, add_generation_prompt=True)
        self._turns: list[Turn] = [Turn(role="prompt", token_ids=tuple(self._encode(text)), text=text)]

    # ---- state ------------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self._turns for t in turn.token_ids]

    @property
    def turns(self) -> tuple[Turn, ...]:
        return tuple(self._turns)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (assistant contents decoded from the model's ids)."""
        return [dict(m) for m in self._messages]

    def __len__(self) -> int:
        return sum(len(turn.token_ids) for turn in self._turns)

    def episode(
        self, *, gamma: float = 1.0, group_index: int = 0, stop_reason: str = "", **info: Any
    ) -> Episode:
        return Episode(
            turns=tuple(self._turns), gamma=gamma, group_index=group_index, stop_reason=stop_reason, info=info
        )

    # ---- growing the conversation -------------------------------------------------------------

    async def generate(self, client: InferenceClient, sampling: SamplingParams) -> Turn:
        """Sample the model's next turn from the whole sequence and append it."""
        return self.add_model_turn(await client.generate(self.token_ids, sampling))

    def add_model_turn(self, result: GenerationResult) -> Turn:
        """Append the generated ids of ``result`` as they are; returns the model turn."""
        if self._turns[-1].trained:
            raise ValueError("the last turn is already a model turn; add a user or tool message first")
        if list(result.prompt_ids) != self.token_ids:
            raise ValueError(
                f"the result completes a different prompt ({len(result.prompt_ids)} tokens, the session "
                f"holds {len(self)}); generate from session.token_ids"
            )
        text = self.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
        turn = Turn.from_result(result, text=text)
        self._turns.append(turn)
        self._messages.append({"role": "assistant", "content": text})
        return turn

    def add_messages(self, messages: Sequence[Mapping[str, Any]], *, role: str | None = None) -> Turn:
        """Append user / tool messages after a model turn; returns the context turn (loss mask 0).

        ``role`` names the turn (``user``, ``tool`` or ``environment``); by default ``tool`` when
        every message is a tool message, else ``user``.
        """
        if not self._turns[-1].trained:
            raise ValueError(
                "add_messages follows a model turn; put every opening message in ChatSession(messages=...)"
            )
        new = [_check_message(m, i) for i, m in enumerate(messages)]
        if not new:
            raise ValueError("add_messages needs at least one message")
        if any(m["role"] == "assistant" for m in new):
            raise ValueError(
                "assistant messages come from add_model_turn(result), so their ids are the model's"
            )
        role = role or ("tool" if all(m["role"] == "tool" for m in new) else "user")
        if role not in _CONTEXT_ROLES:
            raise ValueError(f"role must be one of {_CONTEXT_ROLES}, got {role!r}")
        new = self._fit_tool_role(new)
        text = self._bridge() + self._delta(new)
        self._messages.extend(new)
        turn = Turn(role=role, token_ids=tuple(self._encode(text)), text=text)  # type: ignore[arg-type]
        self._turns.append(turn)
        return turn

    def set_reward(self, reward: float) -> Turn:
        """Give the last model turn its reward; returns the updated turn."""
        for i in range(len(self._turns) - 1, -1, -1):
            if self._turns[i].trained:
                self._turns[i] = self._turns[i].with_reward(reward)
                return self._turns[i]
        raise ValueError("set_reward needs a model turn; the session has none yet")

    # ---- template mechanics -----------------------------------------------------------------

    def _render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self._template_kwargs,
            )
        except Exception as exc:
            roles = [m["role"] for m in messages]
            raise ChatTemplateError(
                f"the chat template cannot render roles {roles} ({type(exc).__name__}: {exc})"
            ) from exc
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _assistant_closing(self) -> str:
        """The text the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._render(probe, add_generation_prompt=False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ChatTemplateError("the chat template does not render assistant message contents")
        return text[at + len(_SENTINEL) :]

    def _bridge(self) -> str:
        """What the template puts after the last model turn that the model did not generate."""
        last = self._turns[-1]
        if last.finish_reason == "stop":
            stop_text = self.tokenizer.decode([last.token_ids[-1]], skip_special_tokens=False)
            if stop_text and self._closing.startswith(stop_text):
                return self._closing[len(stop_text) :]
        return self._closing

    def _delta(self, new: list[dict[str, Any]]) -> str:
        for history in (self._messages, _stand_in_assistants(self._messages)):
            before = self._render(history, add_generation_prompt=False)
            after = self._render(history + new, add_generation_prompt=True)
            if after.startswith(before):
                if not before.endswith(self._closing):
                    raise ChatTemplateError(
                        f"the chat template ends the conversation with {before[-40:]!r}, not with the "
                        f"assistant closing {self._closing!r}; it cannot be extended turn by turn"
                    )
                return after[len(before) :]
        raise ChatTemplateError(
            "the chat template renders earlier turns differently once a message is added; "
            "the conversation cannot be extended without re-encoding the model's tokens"
        )

    def _fit_tool_role(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.tool_role:
            return messages
        fitted: list[dict[str, Any]] = []
        merge = False
        for m in messages:
            if m["role"] != "tool":
                fitted.append(m)
                merge = False
                continue
            text = TOOL_RESULT_PREFIX.format(name=m.get("name") or "call") + m["content"]
            if merge:
                fitted[-1] = {"role": "user", "content": f"{fitted[-1]['content']}\n\n{text}"}
            else:
                fitted.append({"role": "user", "content": text})
            merge = True
        return fitted


def template_has_tool_role(tokenizer: Any) -> bool:
    """Whether the chat template renders a ``tool`` message's content (no error, nothing dropped)."""
    probe = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "!"},
        {"role": "tool", "name": "probe", "content": _SENTINEL},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # templates refuse unknown roles with raise_exception
        return False
    return _SENTINEL in str(text)


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts the schemas passed as ``tools=`` into the prompt."""
    schema = {"type": "function", "function": {"name": _SENTINEL, "description": "probe", "parameters": {}}}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}], tools=[schema], tokenize=False, add_generation_prompt=True
        )
    except Exception:
        return False
    return _SENTINEL in str(text)


def _check_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {index} must be a mapping with a 'role' string, got {message!r}")
    if not isinstance(message.get("content"), str):
        raise ValueError(f"message {index} ({message['role']}): 'content' must be a string")
    return dict(message)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _stand_in_assistants(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": "..."} if m["role"] == "assistant" else m for m in messages]
