"""Word problems for the calculator: right expressions, a held-out split no option can leak, and
option errors that say what to change."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_async.data import DatasetError, check_row, load_dataset
from areal_async.data.word_problems import OPS, TEMPLATES, is_eval_operands

COMPUTE = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def pairs(rows: list[dict[str, Any]]) -> set[frozenset[int]]:
    return {frozenset((r["a"], r["b"])) for r in rows}


@settings(max_examples=25, deadline=None)
@given(
    train_seed=st.integers(0, 10_000),
    eval_seed=st.integers(0, 10_000),
    lo=st.integers(1, 200),
    width=st.integers(9, 300),
    ops=st.lists(st.sampled_from(OPS), min_size=1, unique=True),
)
def test_no_held_out_operand_pair_is_in_training_for_any_seed_range_or_operations(
    train_seed: int, eval_seed: int, lo: int, width: int, ops: list[str]
) -> None:
    """Training rows never use a held-out pair of numbers, in either order or with any operation,
    whatever the seeds, range and operations of the two splits."""
    options = {"lo": lo, "hi": lo + width, "ops": ops, "num_rows": 200}
    train = load_dataset("word_problems", seed=train_seed, **options)
    held_out = load_dataset("word_problems", split="eval", seed=eval_seed, **options)
    assert all(not is_eval_operands(r["a"], r["b"], eval_fraction=0.1) for r in train)
    assert all(is_eval_operands(r["a"], r["b"], eval_fraction=0.1) for r in held_out)
    assert not pairs(train) & pairs(held_out)


def test_the_demo_runs_held_out_prompts_share_no_operand_pair_with_many_training_seeds() -> None:
    """The split as the run uses it: no held-out pair appears among 20 seeds of training rows."""
    held_out = load_dataset("word_problems", split="eval", seed=0)
    train = [r for seed in range(20) for r in load_dataset("word_problems", seed=seed)]
    assert len(held_out) == 1000 and len(train) == 20_000
    assert not pairs(train) & pairs(held_out)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_each_row_asks_for_its_expression_among_a_distractor() -> None:
    """The prompt holds the two operands and the distractor (three distinct numbers in range),
    the answer is ``a op b`` with the story's operation, and subtraction never goes negative."""
    rows = load_dataset("word_problems", seed=3, num_rows=400, lo=10, hi=999)
    by_name = {t.name: t for t in TEMPLATES}
    for row in rows:
        check_row(row, where="word_problems")
        a, b, c, op = row["a"], row["b"], row["distractor"], row["op"]
        assert by_name[row["template"]].op == op
        assert row["answer"] == str(COMPUTE[op](a, b))
        assert sorted(int(n) for n in re.findall(r"\d+", row["prompt"])) == sorted((a, b, c))
        assert len({a, b, c}) == 3 and all(10 <= n <= 999 for n in (a, b, c))
        assert op != "-" or a > b
    assert {r["template"] for r in rows} == set(by_name)
    assert msgpack.unpackb(msgpack.packb(rows)) == rows


def test_the_operand_order_in_the_story_is_not_always_the_expression_order() -> None:
    """The distractor comes first in some stories, so "the first two numbers" is not the rule."""
    rows = load_dataset("word_problems", seed=0, num_rows=200)
    firsts = [int(re.search(r"\d+", r["prompt"]).group()) for r in rows]
    assert any(first == r["distractor"] for first, r in zip(firsts, rows, strict=True))
    assert any(first == r["a"] for first, r in zip(firsts, rows, strict=True))


def test_ops_picks_the_stories() -> None:
    """``ops`` keeps only the stories of those operations."""
    rows = load_dataset("word_problems", seed=0, num_rows=100, ops=["*"])
    assert {r["op"] for r in rows} == {"*"}
    assert {r["template"] for r in rows} == {t.name for t in TEMPLATES if t.op == "*"}


def test_rows_are_deterministic_for_a_seed_and_vary_across_seeds() -> None:
    """The same seed gives the same rows; another seed other ones."""
    same = load_dataset("word_problems", seed=5, num_rows=50)
    assert same == load_dataset("word_problems", seed=5, num_rows=50)
    assert same != load_dataset("word_problems", seed=6, num_rows=50)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ops": ["/"]}, r"option ops: got \['/'\]; use a non-empty list of \+, -, \*"),
        ({"ops": "+"}, r"option ops: got '\+'; use a non-empty list"),
        ({"ops": []}, r"option ops: got \[\]"),
        ({"lo": 5, "hi": 10}, r"options lo/hi: got lo=5, hi=10; use lo >= 1 and hi >= lo \+ 9"),
        ({"lo": 0}, r"options lo/hi: got lo=0"),
        ({"eval_fraction": 1.5}, r"option eval_fraction: got 1.5; use a value in \(0, 1\)"),
        ({"num_rows": 0}, r"option num_rows: got 0; use a count >= 1"),
        ({"lo": 10, "hi": 19, "eval_fraction": 1e-9}, r"no eval operand pair found in lo..hi = 10..19"),
    ],
)
def test_bad_options_name_the_option_its_value_and_the_fix(options: dict[str, Any], message: str) -> None:
    """A bad option fails at load time with the option, the value given and what to use instead."""
    with pytest.raises(DatasetError, match=message):
        load_dataset("word_problems", split="eval", seed=0, **options)


def test_a_path_an_unknown_split_or_option_is_refused() -> None:
    """The generic checks apply: no path, train/eval splits only, a hint for a misspelt option."""
    with pytest.raises(DatasetError, match="takes no path"):
        load_dataset("word_problems", path="rows.jsonl", seed=0)
    with pytest.raises(DatasetError, match="unknown split 'dev'"):
        load_dataset("word_problems", split="dev", seed=0)
    with pytest.raises(DatasetError, match=r"unknown option 'op'; did you mean 'ops'\?"):
        load_dataset("word_problems", seed=0, op="+")
