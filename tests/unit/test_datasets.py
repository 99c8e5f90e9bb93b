"""Datasets: sources, splits, the checkpointable cursor, and prompt rendering."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_async.data import (
    GSM8K_INSTRUCTION,
    DatasetCursor,
    DatasetError,
    load_dataset,
    parse_gsm8k_answer,
    render_prompt,
)
from areal_async.data.synthetic import is_eval_pair

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K = FIXTURES / "gsm8k"


def write_jsonl(path: Path, lines: list[object | str]) -> Path:
    """Write objects as JSON lines; strings are written verbatim (blank or broken lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# --- gsm8k -------------------------------------------------------------------------------------


def test_gsm8k_rows_carry_the_question_with_a_boxed_instruction_and_the_number_after_hashes() -> None:
    """A released GSM8K line becomes prompt (question + \\boxed instruction), answer, solution."""
    rows = load_dataset("gsm8k", path=GSM8K / "train.jsonl", seed=0)
    assert [row["answer"] for row in rows] == ["36", "14400", "-5"]
    first = rows[0]
    assert first["prompt"].startswith("A baker makes 24 muffins")
    assert first["prompt"].endswith(GSM8K_INSTRUCTION) and "\\boxed{}" in GSM8K_INSTRUCTION
    assert first["solution"].endswith("#### 36") and "<<24/2=12>>" in first["solution"]
    assert first["question"].startswith("A baker")


def test_gsm8k_eval_split_is_the_test_file_beside_the_train_file() -> None:
    """Asking a train.jsonl path for the eval split reads test.jsonl next to it, never train again."""
    from_file = load_dataset("gsm8k", path=GSM8K / "train.jsonl", split="eval", seed=0)
    from_folder = load_dataset("gsm8k", path=GSM8K, split="test", seed=0)
    assert [r["answer"] for r in from_file] == [r["answer"] for r in from_folder] == ["21", "5"]


def test_gsm8k_num_rows_and_instruction_options_apply() -> None:
    """``num_rows`` keeps the first rows; ``instruction=""`` leaves the bare question."""
    rows = load_dataset("gsm8k", path=GSM8K, seed=0, num_rows=2, instruction="")
    assert len(rows) == 2
    assert rows[0]["prompt"] == rows[0]["question"].strip()


def test_gsm8k_answer_drops_thousands_separators_and_keeps_the_sign() -> None:
    """The final answer is the text after the last ####, without commas."""
    assert parse_gsm8k_answer("a\nb\n#### 1,234,567") == "1234567"
    assert parse_gsm8k_answer("#### -3.5\n") == "-3.5"
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no final answer here")


def test_gsm8k_line_without_final_answer_names_file_and_line(tmp_path: Path) -> None:
    """A released-format line whose solution lacks '#### N' is reported with its file and line."""
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": "q1", "answer": "1 + 1 = 2\n#### 2"}, "", {"question": "q2", "answer": "forgot it"}],
    )
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:3: .*####"):
        load_dataset("gsm8k", path=path, seed=0)


def test_gsm8k_line_missing_question_names_the_field(tmp_path: Path) -> None:
    """A line without 'question' says which field is missing and where."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"problem": "q", "answer": "#### 1"}])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:1: missing field 'question'"):
        load_dataset("gsm8k", path=path, seed=0)


def test_gsm8k_hub_layout_folder_without_datasets_library_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that only the ``datasets`` library can read asks for it (or for the jsonl files)."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    (tmp_path / "main").mkdir()
    with pytest.raises(DatasetError, match="needs the 'datasets' package"):
        load_dataset("gsm8k", path=tmp_path, seed=0)


def _released_records(split: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines() if line]


def test_gsm8k_from_a_datasets_save_to_disk_folder_matches_the_jsonl_rows(tmp_path: Path) -> None:
    """A DatasetDict saved with ``save_to_disk`` (train/test) gives the same rows as the released
    files, per split; ``eval`` finds ``test``; a single saved Dataset is its own split."""
    datasets = pytest.importorskip("datasets")
    splits = {name: datasets.Dataset.from_list(_released_records(name)) for name in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    for split, released in (("train", "train"), ("eval", "test")):
        expected = load_dataset("gsm8k", path=GSM8K, split=released, seed=0)
        assert load_dataset("gsm8k", path=tmp_path / "dict", split=split, seed=0) == expected
    splits["test"].save_to_disk(str(tmp_path / "single"))
    single = load_dataset("gsm8k", path=tmp_path / "single", split="train", seed=0)
    assert single == load_dataset("gsm8k", path=GSM8K, split="test", seed=0)


def test_gsm8k_from_a_local_copy_of_the_hub_repo_reads_its_parquet_files(tmp_path: Path) -> None:
    """The hub repo openai/gsm8k keeps ``main/{train,test}-00000-of-00001.parquet``; a local copy of
    that layout loads through ``datasets`` without any download, and a missing split is named."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "main").mkdir()
    for split in ("train", "test"):
        table = datasets.Dataset.from_list(_released_records(split))
        table.to_parquet(str(tmp_path / "main" / f"{split}-00000-of-00001.parquet"))
    for split in ("train", "test"):
        rows = load_dataset("gsm8k", path=tmp_path, split=split, seed=0)
        assert rows == load_dataset("gsm8k", path=GSM8K, split=split, seed=0)
        assert all(row["answer"] and GSM8K_INSTRUCTION in row["prompt"] for row in rows)
    with pytest.raises(DatasetError, match=r"no split 'holdout' \(has \['test', 'train'\]\)"):
        load_dataset("gsm8k", path=tmp_path, split="holdout", seed=0)


def test_gsm8k_without_a_path_says_what_to_pass() -> None:
    """gsm8k has no built-in copy: a missing path is an error that names the accepted forms."""
    with pytest.raises(DatasetError, match="needs a path"):
        load_dataset("gsm8k", seed=0)


# --- generic jsonl -----------------------------------------------------------------------------


def test_jsonl_rows_keep_prompt_messages_answer_and_metadata(tmp_path: Path) -> None:
    """Prompt rows and messages rows load as-is, metadata columns included."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "1+1=", "answer": 2, "level": 1},
            {"messages": messages, "answer": "4", "tags": ["easy"], "meta": {"src": "x"}},
        ],
    )
    rows = load_dataset("jsonl", path=path, seed=0)
    assert rows == [
        {"prompt": "1+1=", "answer": 2, "level": 1},
        {"messages": messages, "answer": "4", "tags": ["easy"], "meta": {"src": "x"}},
    ]


def test_jsonl_key_options_rename_columns_to_the_standard_names(tmp_path: Path) -> None:
    """``prompt_key`` / ``answer_key`` read files that name their columns differently."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "q?", "target": "7", "id": 3}])
    rows = load_dataset("jsonl", path=path, seed=0, prompt_key="question", answer_key="target")
    assert rows == [{"prompt": "q?", "answer": "7", "id": 3}]


def test_jsonl_missing_answer_names_file_line_and_field(tmp_path: Path) -> None:
    """The error for a row without 'answer' carries the file, the 1-based line (blank lines count) and the field."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, "", {"prompt": "b"}])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:3: missing field 'answer'"):
        load_dataset("jsonl", path=path, seed=0)


def test_jsonl_missing_prompt_and_messages_names_file_line_and_field(tmp_path: Path) -> None:
    """A row with neither 'prompt' nor 'messages' says so, with the columns it does have."""
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "a", "answer": "1"}])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:1: missing field 'prompt'.*'text'"):
        load_dataset("jsonl", path=path, seed=0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"messages": [{"role": "user"}], "answer": "1"}), r"messages\[0\] must be an object"),
        (json.dumps({"messages": [], "answer": "1"}), "non-empty list"),
        (json.dumps({"prompt": 5, "answer": "1"}), "'prompt' must be a string"),
    ],
)
def test_jsonl_malformed_lines_are_reported_with_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    """Broken JSON, non-objects and malformed messages all name the file and line."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ok", "answer": "1"}, line])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:2: .*{message}"):
        load_dataset("jsonl", path=path, seed=0)


def test_jsonl_eval_split_without_a_held_out_file_is_an_error_not_a_copy_of_train(tmp_path: Path) -> None:
    """A lone file cannot serve as its own eval set; the error says how to fix the run."""
    path = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DatasetError, match="eval_size: 0"):
        load_dataset("jsonl", path=path, split="eval", seed=0)


def test_jsonl_folder_serves_each_split_from_its_file(tmp_path: Path) -> None:
    """A folder path reads <split>.jsonl; eval finds validation.jsonl too."""
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "t", "answer": "1"}])
    write_jsonl(tmp_path / "validation.jsonl", [{"prompt": "v", "answer": "2"}])
    assert load_dataset("jsonl", path=tmp_path, seed=0)[0]["prompt"] == "t"
    assert load_dataset("jsonl", path=tmp_path, split="eval", seed=0)[0]["prompt"] == "v"
    with pytest.raises(DatasetError, match=r"no nope\.jsonl.*train\.jsonl"):
        load_dataset("jsonl", path=tmp_path, split="nope", seed=0)


def test_missing_file_is_named_in_the_error(tmp_path: Path) -> None:
    """A path that does not exist is named, not left to a bare FileNotFoundError."""
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset("jsonl", path=tmp_path / "absent.jsonl", seed=0)


# --- registry ----------------------------------------------------------------------------------


def test_unknown_dataset_kind_suggests_the_closest_one() -> None:
    """A misspelt kind fails with a "did you mean" hint and the list of kinds."""
    with pytest.raises(
        DatasetError, match=r"unknown dataset kind 'gsm9k'; did you mean 'gsm8k'\?.*arithmetic"
    ):
        load_dataset("gsm9k", seed=0)


def test_unknown_dataset_option_suggests_the_closest_one() -> None:
    """A misspelt option fails at load time with a hint, not deep inside a loader."""
    with pytest.raises(DatasetError, match=r"unknown option 'hii'; did you mean 'hi'\?"):
        load_dataset("arithmetic", seed=0, hii=5)


def test_synthetic_datasets_refuse_a_path() -> None:
    """A path given to a generated dataset is a config mistake, reported as such."""
    with pytest.raises(DatasetError, match="takes no path"):
        load_dataset("arithmetic", path="data.jsonl", seed=0)


@pytest.mark.parametrize(
    ("kind", "path"),
    [("arithmetic", None), ("mode_select", None), ("gsm8k", GSM8K), ("jsonl", FIXTURES / "prompts.jsonl")],
)
def test_every_source_yields_rows_that_travel_in_msgpack(kind: str, path: Path | None) -> None:
    """Rows of every source survive a msgpack round trip unchanged (they ride in PromptTask events)."""
    rows = load_dataset(kind, path=path, seed=0)
    assert rows and all(("prompt" in r or "messages" in r) and "answer" in r for r in rows)
    assert msgpack.unpackb(msgpack.packb(rows)) == rows


# --- synthetic arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("arithmetic", {}),
        ("arithmetic", {"lo": 0, "hi": 30, "op": "*"}),
        ("mode_select", {}),
        ("mode_select", {"op": "-", "eval_fraction": 0.3}),
    ],
)
def test_arithmetic_held_out_split_never_overlaps_train(kind: str, options: dict[str, object]) -> None:
    """No eval problem appears in training, whatever the seeds of the two splits."""
    eval_problems = {
        r["prompt"] for seed in (0, 1) for r in load_dataset(kind, split="eval", seed=seed, **options)
    }
    train_problems = {r["prompt"] for seed in (0, 7) for r in load_dataset(kind, seed=seed, **options)}
    assert eval_problems and train_problems
    assert not eval_problems & train_problems


def test_arithmetic_split_membership_does_not_depend_on_the_operand_range() -> None:
    """A pair held out in one range setting is held out in every other, so ranges cannot leak eval data."""
    narrow = load_dataset("arithmetic", split="eval", seed=0, lo=10, hi=30)
    wide_train = {(r["a"], r["b"]) for r in load_dataset("arithmetic", seed=0, lo=5, hi=60)}
    assert not {(r["a"], r["b"]) for r in narrow} & wide_train
    assert all(is_eval_pair(r["a"], r["b"], "+", eval_fraction=0.1) for r in narrow)


def test_arithmetic_rows_are_correct_two_digit_sums_in_range() -> None:
    """Default rows ask ``What is a + b?`` with 2-digit operands and the right answer."""
    rows = load_dataset("arithmetic", seed=3, num_rows=200)
    assert len(rows) == 200
    for row in rows:
        assert 10 <= row["a"] <= 99 and 10 <= row["b"] <= 99
        assert row["prompt"] == f"What is {row['a']} + {row['b']}?"
        assert row["answer"] == str(row["a"] + row["b"])


def test_arithmetic_answer_only_option_adds_the_instruction() -> None:
    """``answer_only`` asks for just the number."""
    row = load_dataset("arithmetic", seed=0, num_rows=1, answer_only=True, lo=1, hi=9)[0]
    assert row["prompt"] == f"What is {row['a']} + {row['b']}? Answer with just the number."


def test_mode_select_prompts_are_tiny_single_digit_sums() -> None:
    """mode_select rows look like ``3+4=`` with operands 0..9."""
    rows = load_dataset("mode_select", seed=0)
    assert all(r["prompt"] == f"{r['a']}+{r['b']}=" and 0 <= r["a"] <= 9 and 0 <= r["b"] <= 9 for r in rows)
    assert len(rows) + len(load_dataset("mode_select", split="eval", seed=0)) == 100


def test_arithmetic_is_deterministic_for_a_seed_and_varies_across_seeds() -> None:
    """The same seed gives the same rows in the same order; another seed another order."""
    assert load_dataset("arithmetic", seed=5, num_rows=50) == load_dataset("arithmetic", seed=5, num_rows=50)
    assert load_dataset("arithmetic", seed=5, num_rows=50) != load_dataset("arithmetic", seed=6, num_rows=50)


def test_arithmetic_more_rows_than_problems_repeats_every_problem_evenly() -> None:
    """Asking for 2.5x the split's size repeats each problem 2 or 3 times."""
    pool = load_dataset("mode_select", seed=0)
    rows = load_dataset("mode_select", seed=0, num_rows=len(pool) * 5 // 2)
    counts = {p: sum(r["prompt"] == p for r in rows) for p in {r["prompt"] for r in pool}}
    assert set(counts.values()) <= {2, 3}


# --- cursor ------------------------------------------------------------------------------------

ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]


def drain(cursor: DatasetCursor) -> list[tuple[int, int]]:
    """(epoch, index) of everything the cursor still hands out."""
    return [(epoch, index) for epoch, index, _ in cursor]


def test_cursor_order_is_a_function_of_the_seed() -> None:
    """Two cursors with one seed agree; another seed gives another order."""
    a, b, c = (DatasetCursor(ROWS, seed=s, epochs=2) for s in (1, 1, 2))
    assert drain(a) == drain(b) != drain(c)


def test_cursor_visits_every_row_once_per_epoch_and_reshuffles_each_epoch() -> None:
    """Each epoch is a permutation of all rows, and epoch e uses seed + e (so epochs differ)."""
    cursor = DatasetCursor(ROWS, seed=3, epochs=3)
    handed = drain(cursor)
    per_epoch = [[i for e, i in handed if e == epoch] for epoch in range(3)]
    assert all(sorted(order) == list(range(10)) for order in per_epoch)
    assert per_epoch[0] != per_epoch[1]
    assert per_epoch[1] == DatasetCursor(ROWS, seed=4, epochs=1).order(0)


def test_cursor_returns_the_row_at_its_index() -> None:
    """``next()`` gives (epoch, index, rows[index])."""
    epoch, index, row = DatasetCursor(ROWS, seed=0).next()
    assert epoch == 0 and row is ROWS[index]


def test_cursor_is_exhausted_after_the_configured_epochs() -> None:
    """After ``epochs`` passes ``exhausted`` is set and ``next()`` raises StopIteration."""
    cursor = DatasetCursor(ROWS, seed=0, epochs=2)
    assert len(drain(cursor)) == 20
    assert cursor.exhausted and cursor.position == (2, 0)
    with pytest.raises(StopIteration):
        cursor.next()


def test_cursor_without_an_epoch_limit_never_runs_out() -> None:
    """``epochs=None`` keeps going past any number of epochs."""
    cursor = DatasetCursor(ROWS, seed=0, epochs=None)
    for _ in range(55):
        cursor.next()
    assert not cursor.exhausted and cursor.position == (5, 5)


def test_cursor_without_shuffle_keeps_file_order() -> None:
    """``shuffle=False`` hands rows out in their original order every epoch."""
    assert [i for _, i in drain(DatasetCursor(ROWS, seed=9, epochs=2, shuffle=False))] == list(range(10)) * 2


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_rows=st.integers(1, 12),
    epochs=st.integers(1, 3),
    data=st.data(),
)
def test_cursor_restored_from_a_checkpoint_continues_the_exact_order(
    seed: int, num_rows: int, epochs: int, data: st.DataObject
) -> None:
    """Saving after any number of rows and restoring into a fresh cursor yields the same remaining order."""
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(num_rows)]
    reference = drain(DatasetCursor(rows, seed=seed, epochs=epochs))
    consumed = data.draw(st.integers(0, len(reference)))
    cursor = DatasetCursor(rows, seed=seed, epochs=epochs)
    for _ in range(consumed):
        cursor.next()
    state = msgpack.unpackb(msgpack.packb(cursor.state_dict()))
    restored = DatasetCursor(rows, seed=seed, epochs=epochs)
    restored.load_state_dict(state)
    assert drain(restored) == reference[consumed:]


def test_cursor_refuses_a_checkpoint_of_another_seed_or_dataset_size() -> None:
    """Restoring over a different order would silently repeat or skip rows, so it is an error."""
    state = DatasetCursor(ROWS, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 over 10 rows"):
        DatasetCursor(ROWS, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="10 rows"):
        DatasetCursor(ROWS[:5], seed=1).load_state_dict(state)


def test_cursor_rejects_an_empty_dataset_and_nonpositive_epochs() -> None:
    """Construction errors say what is wrong."""
    with pytest.raises(ValueError, match="at least one row"):
        DatasetCursor([], seed=0)
    with pytest.raises(ValueError, match="epochs"):
        DatasetCursor(ROWS, seed=0, epochs=0)


# --- render_prompt -----------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def char_tokenizer() -> Any:
    """A character-level fast tokenizer built locally (no download), without a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-=?.,:!\n"))
    vocab = {token: i for i, token in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("<\\|im_(?:start|end)\\|>|."), "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )


@pytest.fixture
def chat_tokenizer(char_tokenizer: Any) -> Iterator[Any]:
    """The character tokenizer with a ChatML-style chat template."""
    char_tokenizer.chat_template = CHAT_TEMPLATE
    yield char_tokenizer
    char_tokenizer.chat_template = None


def ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_render_prompt_wraps_a_prompt_row_in_the_chat_template(chat_tokenizer: Any) -> None:
    """A prompt row becomes one user turn followed by the assistant generation prompt."""
    got = render_prompt(chat_tokenizer, {"prompt": "3+4=", "answer": "7"})
    expected = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert got == ids(chat_tokenizer, expected)
    assert all(isinstance(i, int) for i in got)


def test_render_prompt_prepends_the_system_prompt_once(chat_tokenizer: Any) -> None:
    """``system_prompt`` leads the conversation unless the row already opens with a system message."""
    got = render_prompt(chat_tokenizer, {"prompt": "hi", "answer": ""}, system_prompt="Be brief.")
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert got == ids(chat_tokenizer, expected)
    row = {
        "messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}],
        "answer": "",
    }
    got = render_prompt(chat_tokenizer, row, system_prompt="Be brief.")
    assert got == ids(chat_tokenizer, expected.replace("Be brief.", "Mine."))


def test_render_prompt_uses_plain_text_when_asked_or_without_a_template(
    chat_tokenizer: Any, char_tokenizer: Any
) -> None:
    """``use_chat_template=False``, or a tokenizer without one, encodes exactly the prompt text."""
    row = {"prompt": "3+4=", "answer": "7"}
    plain = char_tokenizer("3+4=")["input_ids"]
    assert render_prompt(chat_tokenizer, row, use_chat_template=False) == plain
    chat_tokenizer.chat_template = None
    assert render_prompt(char_tokenizer, row) == plain


def test_render_prompt_joins_messages_as_plain_text_without_a_template(char_tokenizer: Any) -> None:
    """Without a chat template, message contents are joined by blank lines."""
    row = {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "answer": "",
    }
    assert render_prompt(char_tokenizer, row, system_prompt="s") == char_tokenizer("s\n\na\n\nb")["input_ids"]
