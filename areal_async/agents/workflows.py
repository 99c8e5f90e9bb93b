"""Workflows: how one dataset row becomes one ``Episode``.

A workflow is ``async def fn(client: InferenceClient, row: dict, ctx: WorkflowContext) -> Episode``.
``ctx`` carries the tokenizer, sampling parameters, ``max_turns``, tools, the reward function
(``fn(text, row) -> float``, sync or async, as in ``areal_async.rewards``) and the episode's
index in its group. Built-ins (each needs ``ctx.reward_fn``):

- ``single_turn``: one prompt, one completion; its reward is the reward function's.
- ``multi_turn``: the model answers; the reward function scores the answer; a turn scoring at
  least ``ctx.success_reward`` ends the episode (``stop_reason="correct"``), otherwise
  ``ctx.feedback`` asks it to try again (an ``environment`` turn), up to ``max_turns`` model
  turns. Every model turn keeps its reward; the episode reward discounts the k-th turn's by
  ``gamma**k`` (default ``MULTI_TURN_GAMMA``), so a later right answer is worth less.
- ``tool_use``: the model may call ``ctx.tools`` (``<tool_call>`` blocks, see ``toolcall``);
  every call runs (concurrently, ``ctx.tool_timeout_s`` each) and the results come back as tool
  messages. The loop ends at a turn without tool calls, the final answer, which the reward
  function scores (``stop_reason="answer"``), or after ``max_turns`` model turns with no final
  answer (reward 0, ``"max_turns"``; the tool calls of that last turn are not run).

Every loop also stops before a model turn that could overflow ``ctx.max_context_tokens``
(``stop_reason="context"``; the episode may then end with the context turn just added). A reward function that raises or returns a non-number scores 0 and
its error is listed in ``episode.info["reward_errors"]``.

``resolve_workflow(spec)`` returns a built-in by name or imports ``package.module:function``;
a spec that does not resolve to an ``async def`` raises WorkflowSpecError naming the fix.
``make_tools(names, timeout_s)`` builds the built-in tools a run file names (``agent.tools``).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from areal_async.agents.client import ChatSession, InferenceClient
from areal_async.agents.episode import Episode
from areal_async.agents.sandbox import PythonTool
from areal_async.agents.toolcall import parse_tool_calls, run_tool_calls, tool_message
from areal_async.agents.tools import Calculator, Tool
from areal_async.data.prompt import row_messages
from areal_async.engines.base import SamplingParams
from areal_async.errors import AreaLError
from areal_async.imports import check_import_path, import_object
from areal_async.rewards.registry import RewardFn, as_reward

MULTI_TURN_GAMMA = 0.9
DEFAULT_FEEDBACK = "That answer is not correct. Check your reasoning and try again."


@dataclass(frozen=True, kw_only=True)
class WorkflowContext:
    """Everything a workflow needs besides the client and the row."""

    tokenizer: Any
    """A Hugging Face tokenizer with a chat template."""
    sampling: SamplingParams | None = None
    """Sampling of every model turn; None: defaults that stop at the tokenizer's EOS (end of turn)."""
    max_turns: int = 4
    """Most model turns in one episode."""
    tools: tuple[Tool, ...] = ()
    reward_fn: RewardFn | None = None
    """``fn(text, row) -> float``, sync (run in a thread) or async."""
    group_index: int = 0
    """Index of this episode among the samples of the same row."""
    gamma: float | None = None
    """Discount of later turns' rewards, in (0, 1]; None: ``MULTI_TURN_GAMMA`` for multi_turn, else 1."""
    system_prompt: str | None = None
    """Prepended as a system message unless the row starts with one."""
    feedback: str = DEFAULT_FEEDBACK
    """multi_turn: the message that asks for another try after a wrong answer."""
    success_reward: float = 1.0
    """multi_turn: a turn with at least this reward ends the episode."""
    tool_timeout_s: float = 30.0
    """Wall-time limit of one tool call."""
    max_context_tokens: int | None = None
    """Stop before a turn whose prompt plus ``max_new_tokens`` would pass this; None: no limit."""
    openai_server: Any = None
    """The agent worker's ``OpenAIServer`` (``agent.http_port``), for ``openai_workflow``; None: off."""

    def __post_init__(self) -> None:
        if self.sampling is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            stop = (eos,) if eos is not None else ()
            object.__setattr__(self, "sampling", SamplingParams(stop_token_ids=stop))
        elif not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams or None, got {type(self.sampling).__name__}")
        if not _is_int(self.max_turns) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {self.max_turns!r}")
        if not _is_int(self.group_index) or self.group_index < 0:
            raise ValueError(f"group_index must be an int >= 0, got {self.group_index!r}")
        if self.gamma is not None and not (isinstance(self.gamma, int | float) and 0 < self.gamma <= 1):
            raise ValueError(f"gamma must be in (0, 1] or None, got {self.gamma!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        if self.max_context_tokens is not None and (
            not _is_int(self.max_context_tokens) or self.max_context_tokens < 1
        ):
            raise ValueError(
                f"max_context_tokens must be None or an int >= 1, got {self.max_context_tokens!r}"
            )
        if self.reward_fn is not None and not callable(self.reward_fn):
            raise ValueError(f"reward_fn must be callable fn(text, row) -> float, got {self.reward_fn!r}")
        tools = tuple(self.tools)
        if not all(isinstance(t, Tool) for t in tools):
            raise ValueError(f"tools must be Tool instances, got {[type(t).__name__ for t in tools]}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        object.__setattr__(self, "tools", tools)

    @property
    def sampling_params(self) -> SamplingParams:
        assert self.sampling is not None  # filled in __post_init__
        return self.sampling


Workflow = Callable[[InferenceClient, dict[str, Any], WorkflowContext], Awaitable[Episode]]


def make_tools(names: Sequence[str], timeout_s: float) -> tuple[Tool, ...]:
    """The built-in tools named (``agent.tools``: ``calculator``, ``python``), in order."""
    built: dict[str, Callable[[], Tool]] = {
        "calculator": Calculator,
        "python": lambda: PythonTool(timeout_s=timeout_s),
    }
    return tuple(built[name]() for name in names)


# ---- built-ins -------------------------------------------------------------------------------


async def single_turn(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> Episode:
    """One prompt, one completion, the reward function's reward."""
    reward_fn = _needs_reward(ctx, "single_turn")
    session = ChatSession(ctx.tokenizer, row_messages(row, system_prompt=ctx.system_prompt))
    errors: list[str] = []
    turn = await session.generate(client, ctx.sampling_params)
    session.set_reward(await score(reward_fn, turn.text, row, errors))
    return session.episode(
        gamma=ctx.gamma or 1.0, group_index=ctx.group_index, stop_reason="answer", **_info(errors)
    )


async def multi_turn(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> Episode:
    """Answer, get checked, retry after feedback until right or ``max_turns`` (module docstring)."""
    reward_fn = _needs_reward(ctx, "multi_turn")
    session = ChatSession(ctx.tokenizer, row_messages(row, system_prompt=ctx.system_prompt))
    errors: list[str] = []
    stop_reason = "max_turns"
    for turn_index in range(ctx.max_turns):
        if turn_index:
            session.add_messages([{"role": "user", "content": ctx.feedback}], role="environment")
        if _context_full(session, ctx):
            stop_reason = "context"
            break
        turn = await session.generate(client, ctx.sampling_params)
        reward = await score(reward_fn, turn.text, row, errors)
        session.set_reward(reward)
        if reward >= ctx.success_reward:
            stop_reason = "correct"
            break
    gamma = ctx.gamma or MULTI_TURN_GAMMA
    return session.episode(gamma=gamma, group_index=ctx.group_index, stop_reason=stop_reason, **_info(errors))


async def tool_use(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> Episode:
    """Call tools until a final answer without tool calls, or ``max_turns`` (module docstring)."""
    reward_fn = _needs_reward(ctx, "tool_use")
    if not ctx.tools:
        raise ValueError("workflow 'tool_use' needs ctx.tools (e.g. tools=(Calculator(), PythonTool()))")
    session = ChatSession(ctx.tokenizer, row_messages(row, system_prompt=ctx.system_prompt), tools=ctx.tools)
    errors: list[str] = []
    calls_run = calls_failed = 0
    stop_reason = "max_turns"
    for turn_index in range(ctx.max_turns):
        if _context_full(session, ctx):
            stop_reason = "context"
            break
        turn = await session.generate(client, ctx.sampling_params)
        calls = parse_tool_calls(turn.text, ctx.tools)
        if not calls:
            session.set_reward(await score(reward_fn, turn.text, row, errors))
            stop_reason = "answer"
            break
        if turn_index == ctx.max_turns - 1:
            break
        outcomes = await run_tool_calls(calls, ctx.tools, timeout_s=ctx.tool_timeout_s)
        calls_run += len(outcomes)
        calls_failed += sum(not outcome.ok for outcome in outcomes)
        session.add_messages([tool_message(outcome) for outcome in outcomes], role="tool")
    return session.episode(
        gamma=ctx.gamma or 1.0,
        group_index=ctx.group_index,
        stop_reason=stop_reason,
        tool_calls=calls_run,
        tool_errors=calls_failed,
        **_info(errors),
    )


async def score(reward_fn: RewardFn, text: str, row: Mapping[str, Any], errors: list[str]) -> float:
    """The reward of ``text``; 0 (and the error appended to ``errors``) when the function fails."""
    try:
        if inspect.iscoroutinefunction(reward_fn):
            result = await reward_fn(text, dict(row))
        else:  # sync reward functions may be slow (math-verify): keep the event loop free
            result = await anyio.to_thread.run_sync(reward_fn, text, dict(row))
        if inspect.isawaitable(result):
            result = await result
        return as_reward(result)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        return 0.0


def _needs_reward(ctx: WorkflowContext, workflow: str) -> RewardFn:
    if ctx.reward_fn is None:
        raise ValueError(
            f"workflow {workflow!r} needs ctx.reward_fn (e.g. resolve_reward('exact_match') from areal_async.rewards)"
        )
    return ctx.reward_fn


def _context_full(session: ChatSession, ctx: WorkflowContext) -> bool:
    limit = ctx.max_context_tokens
    return limit is not None and len(session) + ctx.sampling_params.max_new_tokens > limit


def _info(errors: Sequence[str]) -> dict[str, Any]:
    return {"reward_errors": list(errors)} if errors else {}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- by name ---------------------------------------------------------------------------------


BUILTIN_WORKFLOWS: dict[str, Workflow] = {
    "single_turn": single_turn,
    "multi_turn": multi_turn,
    "tool_use": tool_use,
}


class WorkflowSpecError(AreaLError, ValueError):
    """A workflow spec names no built-in and no importable ``async def``; the message says which."""


def resolve_workflow(spec: str) -> Workflow:
    """A built-in workflow by name, or the ``async def`` that ``package.module:function`` names."""
    if spec in BUILTIN_WORKFLOWS:
        return BUILTIN_WORKFLOWS[spec]
    path = check_import_path(spec, what="workflow", builtins=BUILTIN_WORKFLOWS, error=WorkflowSpecError)
    target = import_object(spec, path, what="workflow", where="agent worker", error=WorkflowSpecError)
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)):
        raise WorkflowSpecError(
            f"workflow {spec!r} is a {type(target).__name__}, not an async function; define it as"
            " 'async def fn(client, row, ctx) -> Episode'"
        )
    return target
