"""SFT rows: rendered as the agent path renders an episode, trained only on the model's tokens, and
every bad row named by its line (or skipped and counted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from areal_async.agents import Calculator, WorkflowContext, tool_use
from areal_async.agents.client import ChatTemplateError
from areal_async.data.prompt import render_prompt
from areal_async.data.sft import BAD_ROW_KINDS, BadRow, RenderOptions, load_examples, render_row
from areal_async.engines.base import GenerationResult, SamplingParams
from areal_async.errors import ConfigError
from areal_async.run_file import build_config
from tests.helpers.models import CHATML_TEMPLATE, build_tokenizer

QUESTION = "What is 17 * 23?"
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "17 * 23"}'},
}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
ANSWER = "17 * 23 = 391."
TOOL_ROW = {
    "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "391"},
        {"role": "assistant", "content": ANSWER},
    ]
}
TOOLS = RenderOptions(tools=(Calculator(),))


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("bpe", texts=[QUESTION, CALL_TEXT, ANSWER, "calculator expression"])


class CanonicalModel:
    """Writes each scripted reply as the tokenizer encodes it, then EOS: the tokens SFT trains."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer, self.replies = tokenizer, list(replies)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id]
        n = len(ids)
        return GenerationResult(
            request_id="r", prompt_ids=tuple(prompt_ids), token_ids=ids, logprobs=[0.0] * n, versions=[0] * n,
            finish_reason="stop",
        )  # fmt: skip


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_a_tool_row_renders_the_tokens_the_tool_use_workflow_records(tok: Any) -> None:
    """The tool_use workflow's episode, for a model that writes the row's assistant turns, has the
    very tokens and loss mask SFT renders for the row: SFT and RL see the same sequence."""
    example = render_row(tok, TOOL_ROW, TOOLS)
    context = WorkflowContext(
        tokenizer=tok,
        reward_fn=lambda text, row: 1.0,
        tools=(Calculator(),),
        sampling=SamplingParams(max_new_tokens=256, stop_token_ids=(tok.eos_token_id,)),
    )
    model = CanonicalModel(tok, [CALL_TEXT, ANSWER])
    episode = anyio.run(tool_use, model, {"prompt": QUESTION, "answer": "391"}, context)

    assert episode.prompt_ids == example.prompt_ids
    assert episode.token_ids == example.prompt_ids + example.completion_ids
    assert episode.loss_mask[len(example.prompt_ids) :] == [int(m) for m in example.loss_mask]


def test_the_loss_mask_covers_each_assistant_turn_and_its_end_of_turn_token_only(tok: Any) -> None:
    """True exactly on each assistant turn's text and the EOS after it; the tool result, the
    template's turn headers and the newline after EOS are context."""
    example = render_row(tok, TOOL_ROW, TOOLS)
    ids = example.completion_ids
    turns = [ids[a:b] for a, b in spans(example.loss_mask)]
    assert [tok.decode(t) for t in turns] == [CALL_TEXT + "<|im_end|>", ANSWER + "<|im_end|>"]
    untrained = [i for i, m in zip(ids, example.loss_mask, strict=True) if not m]
    assert tok.decode(untrained) == "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
    assert example.completion_ids[0] == tok(CALL_TEXT, add_special_tokens=False)["input_ids"][0]


def test_a_prompt_completion_row_trains_the_completion_and_eos_after_the_dataset_prompt(tok: Any) -> None:
    """The prompt is what the single-turn path renders for a dataset prompt; every completion token
    and the EOS after it are trained."""
    options = RenderOptions(system_prompt="Be brief.")
    example = render_row(tok, {"prompt": QUESTION, "completion": "391"}, options)
    assert example.prompt_ids == render_prompt(tok, {"prompt": QUESTION}, system_prompt="Be brief.")
    assert example.completion_ids == [*tok("391", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert all(example.loss_mask)


def test_a_conversation_opens_with_the_system_prompt_and_drops_messages_after_the_last_answer(
    tok: Any,
) -> None:
    """``model.system_prompt`` is prepended as the rollout prepends it; a trailing user message
    trains nothing and is left out."""
    row = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "391"}]}
    trailing = {"messages": [*row["messages"], {"role": "user", "content": "thanks"}]}
    options = RenderOptions(system_prompt="Be brief.")
    assert render_row(tok, trailing, options) == render_row(tok, row, options)
    assert render_row(tok, row, options).prompt_ids == render_prompt(
        tok, {"prompt": QUESTION}, system_prompt="Be brief."
    )


BAD_ROWS = {
    "json": '{"messages": [',
    "format": json.dumps({"messages": [{"role": "narrator", "content": "x"}]}),
    "no_assistant": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    "tool_call": json.dumps(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                },
            ]
        }
    ),
    "too_long": json.dumps({"prompt": "hi", "completion": "x" * 2000}),
}
GOOD = json.dumps({"prompt": "hi", "completion": "ok"})


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_a_bad_row_is_an_error_naming_its_line_and_what_is_wrong(tok: Any, tmp_path: Path, kind: str) -> None:
    """Each kind of bad row stops loading with ``<file>:<line>:`` and the problem."""
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{GOOD}\n\n{BAD_ROWS[kind]}\n")
    with pytest.raises(BadRow) as caught:
        load_examples(path, tok, TOOLS, max_tokens=1000)
    assert caught.value.kind == kind
    assert str(caught.value).startswith(f"{path}:3: ")
    assert "on_bad_row: skip" in str(caught.value)


def test_a_template_that_cannot_grow_turn_by_turn_is_a_bad_row(tmp_path: Path) -> None:
    """A chat template that renders earlier turns differently once a message follows cannot give
    the agent's tokens: the row is refused as ``template``, naming its line."""
    tok = build_tokenizer("char")
    tok.chat_template = "{{ messages | length }}" + CHATML_TEMPLATE
    path = tmp_path / "rows.jsonl"
    row = {"messages": [*TOOL_ROW["messages"][:1], {"role": "assistant", "content": "a"}] * 2}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(BadRow, match=rf"^{path}:1: the chat template cannot render") as caught:
        load_examples(path, tok)
    assert caught.value.kind == "template"
    assert isinstance(caught.value.__cause__.__cause__, ChatTemplateError)


def test_on_bad_row_skip_leaves_bad_rows_out_and_counts_them_by_kind(tok: Any, tmp_path: Path) -> None:
    """Skipped rows are counted per kind and never trained; the good rows keep their line numbers."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([GOOD, *BAD_ROWS.values(), json.dumps(TOOL_ROW)]) + "\n")
    examples, skipped = load_examples(path, tok, TOOLS, max_tokens=1000, on_bad_row="skip")
    assert [e.line for e in examples] == [1, len(BAD_ROWS) + 2]
    assert skipped == dict.fromkeys(BAD_ROWS, 1)
    assert set(skipped) <= set(BAD_ROW_KINDS)


def test_the_sft_section_names_the_key_the_value_and_the_fix() -> None:
    """Unknown keys, missing data and contradictory held-out settings are ConfigErrors."""
    assert build_config({"sft": {"data": "rows.jsonl"}}).sft_out == Path("runs/demo/sft/model")
    cases = {
        "sft.data is required": {"epochs": 2},
        "did you mean 'batch_size'": {"data": "x", "batch_sise": 2},
        "eval_fraction must be in": {"data": "x", "eval_fraction": 1.0},
        "both name the held-out rows": {"data": "x", "eval_fraction": 0.1, "eval_data": "y"},
        "'error', 'skip'": {"data": "x", "on_bad_row": "ignore"},
    }
    for message, section in cases.items():
        with pytest.raises(ConfigError, match=message):
            build_config({"sft": section})
