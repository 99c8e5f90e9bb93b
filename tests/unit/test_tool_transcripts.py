"""Calculator transcripts for the tool demo's warm start: prompts as the RL run renders them, calls
on the expression the problem needs, the calculator's own results, answers the reward scores 1, no
held-out problem, and rows SFT renders. Each test runs for the products run file and the
word-problem one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from areal_async.agents import Calculator
from areal_async.agents.tools import evaluate_arithmetic
from areal_async.data import load_dataset
from areal_async.data.sft import RenderOptions, load_examples
from areal_async.data.tool_transcripts import main, tool_transcripts
from areal_async.rewards.registry import call_reward, resolve_reward
from areal_async.run_file import load_config
from tests.helpers.models import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
PRODUCTS = REPO / "configs" / "agent_tool_cpu.yaml"
WORDS = REPO / "configs" / "agent_tool_words_cpu.yaml"


@pytest.fixture(scope="module", params=[PRODUCTS, WORDS], ids=["products", "words"])
def config_path(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.fixture(scope="module")
def cfg(config_path: Path) -> Any:
    return load_config(config_path)


COUNT, SEED = 300, 1


@pytest.fixture(scope="module")
def rows(cfg: Any) -> list[dict[str, Any]]:
    return tool_transcripts(COUNT, seed=SEED, kind=cfg.dataset.kind, options=cfg.dataset.options)


@pytest.fixture(scope="module")
def problems(cfg: Any) -> list[dict[str, Any]]:
    """The dataset rows the transcripts are drawn from: the run's dataset, training split."""
    ds = cfg.dataset
    return load_dataset(ds.kind, split="train", seed=SEED, num_rows=COUNT, **ds.options)


def test_each_transcript_is_one_call_its_result_and_the_answer(rows: list[dict[str, Any]]) -> None:
    """user, assistant with one calculator call, the tool message answering it, the final answer."""
    for row in rows:
        _, call, tool, answer = row["messages"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        [tool_call] = call["tool_calls"]
        assert tool_call["function"]["name"] == "calculator"
        assert tool["tool_call_id"] == tool_call["id"]
        assert answer["content"] == tool["content"]


def expression(row: dict[str, Any]) -> str:
    return json.loads(row["messages"][1]["tool_calls"][0]["function"]["arguments"])["expression"]


def test_prompts_are_the_rl_runs_dataset_prompts(
    rows: list[dict[str, Any]], problems: list[dict[str, Any]]
) -> None:
    """The user message is the prompt the run's dataset renders for the problem (the RL episode's
    opening), and the call computes that problem's operands with its operation."""
    for row, problem in zip(rows, problems, strict=True):
        assert row["messages"][0]["content"] == problem["prompt"]
        assert expression(row) == f"{problem['a']} {problem['op']} {problem['b']}"


def test_every_call_evaluates_to_the_answer_without_the_distractor(
    rows: list[dict[str, Any]], problems: list[dict[str, Any]]
) -> None:
    """The call's expression is worth the problem's answer; a word problem's call uses its two
    operands and never the distractor (the expression is built, not copied from the prompt)."""
    for row, problem in zip(rows, problems, strict=True):
        assert str(evaluate_arithmetic(expression(row))) == problem["answer"] == row["answer"]
        if "distractor" in problem:
            assert expression(row) not in problem["prompt"]
            assert str(problem["distractor"]) not in expression(row).split()


def test_every_tool_result_is_the_calculators_output(rows: list[dict[str, Any]]) -> None:
    """The tool message holds exactly what the calculator tool returns for the call."""

    async def outputs() -> list[str]:
        calculator = Calculator()
        return [
            await calculator.call(json.loads(row["messages"][1]["tool_calls"][0]["function"]["arguments"]))
            for row in rows
        ]

    assert [row["messages"][2]["content"] for row in rows] == anyio.run(outputs)


def test_every_final_answer_scores_one_with_the_runs_reward(
    cfg: Any, rows: list[dict[str, Any]], problems: list[dict[str, Any]]
) -> None:
    """The run's reward function (reward.fn) gives 1 to each final answer against its dataset row."""
    reward = resolve_reward(cfg.reward.fn)
    for row, problem in zip(rows, problems, strict=True):
        assert call_reward(reward, row["messages"][-1]["content"], problem) == 1.0


def test_no_transcript_holds_a_held_out_problem(cfg: Any, rows: list[dict[str, Any]]) -> None:
    """Neither the run's eval prompts nor any other problem of the eval split is in the warm start,
    whatever the seed."""
    ds = cfg.dataset
    held_out = [r["prompt"] for r in load_dataset(ds.kind, split="eval", seed=ds.seed, **ds.options)]
    evaluated = set(held_out[: ds.eval_size])  # what the controller evaluates
    assert len(evaluated) == ds.eval_size
    prompts = {r["messages"][0]["content"] for r in rows}
    more = tool_transcripts(3000, seed=7, kind=ds.kind, options=ds.options)
    prompts |= {r["messages"][0]["content"] for r in more}
    assert len(prompts) > 3000
    assert not prompts & set(held_out)


def test_no_word_problem_transcript_computes_a_held_out_pair_of_numbers() -> None:
    """For word problems the guarantee is stronger than distinct prompts: no transcript's call uses
    a pair of numbers that a held-out problem asks about, in either order, for any seed."""
    ds = load_config(WORDS).dataset
    held_out = {
        frozenset((r["a"], r["b"])) for r in load_dataset(ds.kind, split="eval", seed=ds.seed, **ds.options)
    }
    called = {
        frozenset(int(n) for n in expression(row).split()[::2])
        for seed in (1, 7, 11)
        for row in tool_transcripts(1000, seed=seed, kind=ds.kind, options=ds.options)
    }
    assert len(called) > 2500
    assert not called & held_out


def test_the_written_rows_render_through_sft_without_bad_rows(
    config_path: Path, cfg: Any, rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The command's file loads as SFT examples with the run's system prompt and tools: no row is
    bad, and each trains the call turn and the answer turn."""
    out = tmp_path / "rows.jsonl"
    assert main(["--config", str(config_path), "--out", str(out), "--count", "40", "--seed", "1"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == rows[:40]
    texts = [cfg.model.system_prompt, *(json.dumps(r) for r in written)]
    tok = build_tokenizer("bpe", texts=texts)
    options = RenderOptions(tools=(Calculator(),), system_prompt=cfg.model.system_prompt)
    examples, skipped = load_examples(out, tok, options, on_bad_row="skip")
    assert len(examples) == 40 and not skipped
    for example in examples:
        trained = [t for t, m in zip(example.completion_ids, example.loss_mask, strict=True) if m]
        text = tok.decode(trained)
        assert text.count("<tool_call>") == 1 and text.endswith("<|im_end|>")
