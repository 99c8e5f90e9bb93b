"""Multi-turn and tool-using agents: episodes, chat sessions, tools and workflows.

- ``Episode`` / ``Turn`` (``episode.py``): the token record of a conversation, with per-token
  log-probs, policy versions and loss mask, per-turn rewards and the discounted episode reward.
- ``InferenceClient`` / ``EngineClient`` / ``ChatSession`` (``client.py``): sampling turns and
  growing the token sequence without re-encoding the model's tokens.
- ``Tool``, ``invoke_tool``, ``Calculator`` (``tools.py``), ``PythonTool`` (``sandbox.py``).
- ``parse_tool_calls``, ``run_tool_calls``, ``render_tool_prompt`` (``toolcall.py``): the
  ``<tool_call>{...}</tool_call>`` text format.
- ``WorkflowContext``, ``single_turn``, ``multi_turn``, ``tool_use``, ``resolve_workflow``,
  ``make_tools`` (``workflows.py``).
- ``OpenAIServer``, ``openai_workflow`` (``openai_server.py``), ``EpisodeRecorder``
  (``openai_recorder.py``): the OpenAI-compatible endpoint that trains ``openai``-based agent code.

Nothing here imports torch or the bus; the tokenizer is any Hugging Face tokenizer.
"""

from areal_async.agents.client import (
    ChatSession,
    ChatTemplateError,
    EngineClient,
    InferenceClient,
    template_has_tool_role,
    template_renders_tools,
)
from areal_async.agents.episode import Episode, Turn, discounted_sum
from areal_async.agents.openai_messages import InvalidRequest
from areal_async.agents.openai_recorder import CallRecord, EpisodeRecorder, UnknownEpisode
from areal_async.agents.openai_server import OpenAIServer, openai_workflow
from areal_async.agents.sandbox import PythonTool
from areal_async.agents.toolcall import (
    ToolCall,
    parse_tool_calls,
    render_tool_prompt,
    run_tool_calls,
    tool_message,
)
from areal_async.agents.tools import Calculator, Tool, ToolError, ToolOutcome, invoke_tool
from areal_async.agents.workflows import (
    BUILTIN_WORKFLOWS,
    Workflow,
    WorkflowContext,
    WorkflowSpecError,
    make_tools,
    multi_turn,
    resolve_workflow,
    single_turn,
    tool_use,
)

__all__ = [
    "BUILTIN_WORKFLOWS",
    "Calculator",
    "CallRecord",
    "ChatSession",
    "ChatTemplateError",
    "EngineClient",
    "Episode",
    "EpisodeRecorder",
    "InferenceClient",
    "InvalidRequest",
    "OpenAIServer",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolOutcome",
    "Turn",
    "UnknownEpisode",
    "Workflow",
    "WorkflowContext",
    "WorkflowSpecError",
    "discounted_sum",
    "invoke_tool",
    "make_tools",
    "multi_turn",
    "openai_workflow",
    "parse_tool_calls",
    "render_tool_prompt",
    "resolve_workflow",
    "run_tool_calls",
    "single_turn",
    "template_has_tool_role",
    "template_renders_tools",
    "tool_message",
    "tool_use",
]
