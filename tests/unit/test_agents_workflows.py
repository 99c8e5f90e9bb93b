"""Agent workflows against a scripted model: turns, masks, rewards, retries, tool loops, max_turns.

``ScriptedClient`` stands in for the policy: each generate() call answers with the next scripted
reply, spelled one character-token at a time (ids a re-encode would change under BPE) and ended
with the end-of-turn token, so every check also sees that the model's ids reach the episode as
they were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from areal_async.agents import (
    BUILTIN_WORKFLOWS,
    Calculator,
    ChatSession,
    EngineClient,
    Episode,
    InferenceClient,
    WorkflowContext,
    WorkflowSpecError,
    multi_turn,
    resolve_workflow,
    single_turn,
    tool_use,
)
from areal_async.agents.client import TOOL_RESULT_PREFIX
from areal_async.data.prompt import row_messages
from areal_async.engines.base import GenerationRequest, GenerationResult, InferenceEngine, SamplingParams
from tests.helpers.models import build_tokenizer
from tests.unit.test_agents_episode import EOS, STRICT_TEMPLATE

ROW = {"prompt": "What is 17 * 23?", "answer": "391"}
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'


class ScriptedClient:
    """Replies with preset texts as per-character ids; records every prompt it was sent."""

    def __init__(self, tokenizer: Any, replies: list[str], versions: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.versions = list(versions or [0] * len(replies))
        self.prompts: list[list[int]] = []
        self.sent: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        self.prompts.append(list(prompt_ids))
        ids = [self.tokenizer.convert_tokens_to_ids(c) for c in self.replies.pop(0).replace(" ", "Ġ")]
        ids = (ids + [EOS])[: sampling.max_new_tokens]
        self.sent.append(ids)
        finish = "stop" if ids[-1] in sampling.stop_token_ids else "length"
        version = self.versions.pop(0)
        return GenerationResult(
            request_id=f"r{len(self.prompts)}",
            prompt_ids=tuple(prompt_ids),
            token_ids=ids,
            logprobs=[-0.1] * len(ids),
            versions=[version] * len(ids),
            finish_reason=finish,
        )


def contains_answer(text: str, row: dict[str, Any]) -> float:
    return float(row["answer"] in text)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("bpe")


def context(tok: Any, **options: Any) -> WorkflowContext:
    options.setdefault("sampling", SamplingParams(max_new_tokens=256, stop_token_ids=(EOS,)))
    return WorkflowContext(tokenizer=tok, reward_fn=contains_answer, **options)


def assert_model_ids_kept(episode: Episode, client: ScriptedClient) -> None:
    """Each model turn holds exactly the ids sent, and each prompt extends the previous sequence."""
    assert [list(t.token_ids) for t in episode.model_turns] == client.sent
    for prompt, turn in zip(client.prompts, episode.model_turns, strict=True):
        start = episode.turns.index(turn)
        assert prompt == [t for earlier in episode.turns[:start] for t in earlier.token_ids]


# --- single_turn --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_single_turn_is_one_prompt_one_completion_scored_by_the_reward_function(tok: Any) -> None:
    """Two turns; mask 1 exactly on the completion; its reward is the episode reward."""
    client = ScriptedClient(tok, ["It is 391."], versions=[4])
    episode = await single_turn(client, ROW, context(tok, group_index=2))
    assert [t.role for t in episode.turns] == ["prompt", "model"]
    assert episode.loss_mask == [0] * len(episode.prompt_ids) + [1] * len(client.sent[0])
    assert (episode.reward, episode.head_version, episode.tail_version) == (1.0, 4, 4)
    assert (episode.group_index, episode.stop_reason) == (2, "answer")
    assert_model_ids_kept(episode, client)


@pytest.mark.asyncio
async def test_a_failing_reward_function_scores_zero_and_is_recorded(tok: Any) -> None:
    """A reward function that raises gives reward 0 and its error in info['reward_errors']."""

    def broken(text: str, row: dict[str, Any]) -> float:
        raise RuntimeError("grader offline")

    episode = await single_turn(
        ScriptedClient(tok, ["391"]), ROW, WorkflowContext(tokenizer=tok, reward_fn=broken)
    )
    assert episode.reward == 0.0
    assert episode.info["reward_errors"] == ["RuntimeError: grader offline"]


# --- multi_turn ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_multi_turn_retries_after_feedback_and_discounts_the_later_right_answer(tok: Any) -> None:
    """Wrong, feedback, right: three model-or-environment turns, rewards [0, 1], reward gamma**1."""
    client = ScriptedClient(tok, ["It is 381.", "Sorry, 391."], versions=[0, 1])
    episode = await multi_turn(
        client, ROW, context(tok, max_turns=4, gamma=0.5, feedback="Wrong, try again.")
    )
    assert [t.role for t in episode.turns] == ["prompt", "model", "environment", "model"]
    assert "Wrong, try again." in episode.turns[2].text
    assert episode.turn_rewards == [0.0, 1.0] and episode.reward == 0.5
    assert (episode.stop_reason, episode.head_version, episode.tail_version) == ("correct", 0, 1)
    assert all((v == -1) == (m == 0) for v, m in zip(episode.versions, episode.loss_mask, strict=True))
    assert sum(episode.loss_mask) == sum(len(ids) for ids in client.sent)
    assert_model_ids_kept(episode, client)


@pytest.mark.asyncio
async def test_multi_turn_stops_at_max_turns_when_never_right(tok: Any) -> None:
    """Always wrong: exactly max_turns model turns, reward 0, stop reason max_turns."""
    client = ScriptedClient(tok, ["1", "2", "3", "never asked"])
    episode = await multi_turn(client, ROW, context(tok, max_turns=3))
    assert len(episode.model_turns) == 3 and len(client.prompts) == 3
    assert (episode.reward, episode.stop_reason, episode.gamma) == (0.0, "max_turns", 0.9)


@pytest.mark.asyncio
async def test_multi_turn_stops_before_a_turn_that_could_overflow_the_context(tok: Any) -> None:
    """With max_context_tokens nearly used up, no further turn is sampled."""
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=(EOS,))
    prompt_tokens = len(ChatSession(tok, row_messages(ROW)))
    ctx = context(tok, max_turns=3, sampling=sampling, max_context_tokens=prompt_tokens + 16)
    episode = await multi_turn(ScriptedClient(tok, ["1", "2", "3"]), ROW, ctx)
    assert episode.stop_reason == "context" and len(episode.model_turns) == 1


# --- tool_use -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_tool_use_runs_the_call_feeds_back_the_result_and_scores_the_final_answer(tok: Any) -> None:
    """Call, tool result (mask 0), final answer: reward on the answer, one tool call counted."""
    client = ScriptedClient(tok, [f"Computing. {CALC}", "The answer is 391."])
    episode = await tool_use(client, ROW, context(tok, tools=(Calculator(),)))
    assert [t.role for t in episode.turns] == ["prompt", "model", "tool", "model"]
    assert "<|im_start|>tool\n391<|im_end|>" in episode.turns[2].text
    assert '"name": "calculator"' in episode.turns[0].text
    assert episode.turn_rewards == [0.0, 1.0] and episode.reward == 1.0
    assert (episode.stop_reason, episode.info["tool_calls"], episode.info["tool_errors"]) == ("answer", 1, 0)
    assert_model_ids_kept(episode, client)


@pytest.mark.asyncio
async def test_tool_use_feeds_a_malformed_call_back_as_an_error_and_goes_on(tok: Any) -> None:
    """An unknown tool becomes an error tool message; the model then answers and is scored."""
    bad = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    client = ScriptedClient(tok, [bad, "391"])
    episode = await tool_use(client, ROW, context(tok, tools=(Calculator(),)))
    assert "error: tool call 1: unknown tool 'search'" in episode.turns[2].text
    assert (episode.reward, episode.info["tool_errors"]) == (1.0, 1)


@pytest.mark.asyncio
async def test_tool_use_stops_at_max_turns_without_a_final_answer(tok: Any) -> None:
    """Calling tools every turn ends after max_turns with reward 0; the last turn's calls do not run."""
    client = ScriptedClient(tok, [CALC, CALC, CALC])
    episode = await tool_use(client, ROW, context(tok, tools=(Calculator(),), max_turns=2))
    assert [t.role for t in episode.turns] == ["prompt", "model", "tool", "model"]
    assert (episode.reward, episode.stop_reason, episode.info["tool_calls"]) == (0.0, "max_turns", 1)


@pytest.mark.asyncio
async def test_tool_use_with_a_template_without_tool_role_sends_results_as_user_messages() -> None:
    """The tool result arrives as a prefixed user message and the loop works the same."""
    strict = build_tokenizer("bpe")
    strict.chat_template = STRICT_TEMPLATE
    client = ScriptedClient(strict, [CALC, "391"])
    episode = await tool_use(client, ROW, context(strict, tools=(Calculator(),)))
    prefix = TOOL_RESULT_PREFIX.format(name="calculator")
    assert f"<|im_start|>user\n{prefix}391<|im_end|>" in episode.turns[2].text
    assert episode.turns[2].role == "tool" and episode.reward == 1.0


class EchoEngine(InferenceEngine):
    """An engine at the edge: completes any prompt with the ids of '391' and EOS, at version 2."""

    engine_id = "echo"
    version = 2

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def load_weights(self, version: int, location: Any) -> float:
        raise NotImplementedError

    async def health(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "version": self.version, "status": "ok"}

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        ids = [*self.answer, EOS]
        return [
            GenerationResult(
                request_id=r.request_id,
                prompt_ids=r.prompt_ids,
                token_ids=ids,
                logprobs=[-0.2] * len(ids),
                versions=[2] * len(ids),
                finish_reason="stop",
            )
            for r in requests
        ]


@pytest.mark.asyncio
async def test_engine_client_serves_a_workflow_and_an_async_reward_function(tok: Any) -> None:
    """EngineClient turns one call into one engine request; async reward functions are awaited."""

    async def async_reward(text: str, row: dict[str, Any]) -> float:
        return 0.5 if row["answer"] in text else 0.0

    engine = EchoEngine()
    engine.answer = tok("391", add_special_tokens=False)["input_ids"]
    episode = await single_turn(
        EngineClient(engine), ROW, WorkflowContext(tokenizer=tok, reward_fn=async_reward)
    )
    assert (episode.reward, episode.head_version) == (0.5, 2)
    assert isinstance(EngineClient(engine), InferenceClient)


# --- context and loading ------------------------------------------------------------------------


def test_context_defaults_stop_at_eos_and_invalid_values_name_the_field(tok: Any) -> None:
    """Default sampling stops at the tokenizer's EOS; bad values raise ValueError naming the field."""
    assert WorkflowContext(tokenizer=tok).sampling_params.stop_token_ids == (EOS,)
    for bad, field in (
        ({"max_turns": 0}, "max_turns"),
        ({"gamma": 1.5}, "gamma"),
        ({"tool_timeout_s": 0}, "tool_timeout_s"),
        ({"tools": (Calculator(), Calculator())}, "tool names must be unique"),
        ({"reward_fn": "exact_match"}, "reward_fn must be callable"),
    ):
        with pytest.raises(ValueError, match=field):
            WorkflowContext(tokenizer=tok, **bad)


@pytest.mark.asyncio
async def test_builtin_workflows_need_a_reward_function_and_tool_use_needs_tools(tok: Any) -> None:
    """Missing pieces are ValueErrors that say what to set."""
    with pytest.raises(ValueError, match="needs ctx.reward_fn"):
        await single_turn(ScriptedClient(tok, ["x"]), ROW, WorkflowContext(tokenizer=tok))
    with pytest.raises(ValueError, match="needs ctx.tools"):
        await tool_use(ScriptedClient(tok, ["x"]), ROW, context(tok))


async def echo_workflow(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> Episode:
    """A user workflow: single_turn under another name."""
    return await single_turn(client, row, ctx)


def not_async(client: InferenceClient, row: dict[str, Any], ctx: WorkflowContext) -> None:
    return None


@pytest.mark.asyncio
async def test_resolve_workflow_finds_builtins_and_dotted_paths(tok: Any) -> None:
    """Built-in names and 'package.module:function' resolve to runnable workflows."""
    assert all(resolve_workflow(name) is fn for name, fn in BUILTIN_WORKFLOWS.items())
    workflow = resolve_workflow("tests.unit.test_agents_workflows:echo_workflow")
    episode = await workflow(ScriptedClient(tok, ["391"]), ROW, context(tok))
    assert episode.reward == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("single-turn", "unknown workflow 'single-turn'; did you mean 'single_turn'?"),
        ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
        ("tests.unit.test_agents_workflows:missing", "has no attribute 'missing'"),
        ("tests.unit.test_agents_workflows:not_async", "not an async function; define it as 'async def"),
    ],
)
def test_resolve_workflow_errors_name_the_spec_and_the_fix(spec: str, message: str) -> None:
    """Typos, missing modules or attributes and sync functions raise WorkflowSpecError."""
    with pytest.raises(WorkflowSpecError, match=message.replace("?", "\\?").replace("(", "\\(")):
        resolve_workflow(spec)
