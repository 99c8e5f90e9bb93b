"""Rewards: GSM8K answer extraction and comparison, arithmetic rewards, the registry, the process pool."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio

from areal_async.rewards import (
    RewardOutcome,
    RewardPool,
    RewardSpecError,
    arithmetic_last_number,
    arithmetic_strict,
    call_reward,
    exact_match,
    extract_answer,
    gsm8k_reward,
    resolve_reward,
)
from areal_async.rewards.math import call_with_deadline, to_number

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_completions.jsonl"
CASES = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
SCRIPTED = "tests.helpers.reward_fns:scripted_reward"
POOL_TIMEOUT_S = 1.0

pool_test = pytest.mark.asyncio(loop_scope="module")


# --- gsm8k -------------------------------------------------------------------------------------


def test_the_completion_fixture_covers_every_answer_format() -> None:
    """The hand-written fixture has 40+ cases, right and wrong, in every format the reward handles."""
    assert len(CASES) >= 40
    assert {c["reward"] for c in CASES} == {0.0, 1.0}
    text = "\n".join(c["completion"] for c in CASES)
    for marker in ("\\boxed{", "####", "answer is", "\\frac", ",000", "$", "%", "18.0", "-5", "hours"):
        assert marker in text, marker


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_gsm8k_reward_scores_each_fixture_completion_as_expected(case: dict[str, Any]) -> None:
    """Each hand-written completion gets its expected reward against its gold answer."""
    assert gsm8k_reward(case["completion"], {"answer": case["answer"]}) == case["reward"]


def test_answer_extraction_prefers_boxed_then_hashes_then_answer_is_then_last_number() -> None:
    """The first applicable rule wins, whatever numbers come after it."""
    assert extract_answer("#### 3\nThe answer is 4. \\boxed{5} and 6") == "5"
    assert extract_answer("The answer is 4.\n#### 3\nthen 6") == "3"
    assert extract_answer("The answer is 4. Then 6") == "4"
    assert extract_answer("Then 6 and 7.") == "7"
    assert extract_answer("\\boxed{\\frac{a}{\\sqrt{b}}}") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("nothing numeric") is None


def test_number_normalisation_accepts_units_and_rejects_expressions() -> None:
    """Plain numbers with $, commas, units or % normalise; expressions are left for math-verify."""
    assert to_number("$1,234.50") == to_number("1234.5")
    assert to_number("18 apples") == 18
    assert to_number("50\\%") == 50
    assert to_number("x = -7") == -7
    assert to_number("\\frac{3}{4}") == to_number("0.75")
    for expression in ("2^3", "18 + 2", "\\sqrt{324}", "3 apples and 4 pears"):
        assert to_number(expression) is None, expression


def test_gsm8k_reward_uses_math_verify_off_the_main_thread() -> None:
    """Called from a worker thread (no signals there), latex answers are still verified correctly."""
    results: list[float] = []
    worker = threading.Thread(
        target=lambda: results.extend(
            gsm8k_reward(text, {"answer": "18"}) for text in ("\\boxed{6 \\times 3}", "\\boxed{\\sqrt{325}}")
        )
    )
    worker.start()
    worker.join(30)
    assert results == [1.0, 0.0]


def test_gsm8k_reward_returns_zero_promptly_for_answers_that_make_sympy_hang() -> None:
    """Power towers and huge factorials score 0 instead of running for minutes."""
    started = time.monotonic()
    for answer in ("9^{9^{9^{9}}}", "99999999!", "(10^{10})!", "2^{2^{40}}"):
        assert gsm8k_reward(f"\\boxed{{{answer}}}", {"answer": "18"}, timeout_s=1.0) == 0.0
    assert time.monotonic() - started < 10


def test_gsm8k_reward_keeps_an_enclosing_alarm_timer_armed() -> None:
    """math-verify's own alarm must not cancel a SIGALRM timer the caller set (e.g. pytest-timeout)."""
    old_handler = signal.signal(signal.SIGALRM, lambda *_: None)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert gsm8k_reward("\\boxed{\\sqrt{324}}", {"answer": "18"}) == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90 < remaining <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old_handler)


def test_call_with_deadline_gives_up_on_a_slow_call_and_passes_results_and_errors_through() -> None:
    """The thread-based deadline used off the main thread returns, raises or times out."""
    assert call_with_deadline(lambda: 41 + 1, 1.0) == (True, 42)
    assert call_with_deadline(lambda: time.sleep(5), 0.1) == (False, None)
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 1.0)


def test_gsm8k_reward_without_an_answer_in_the_row_raises_a_clear_error() -> None:
    """A row missing 'answer' is a dataset bug; the error names the key (the pool records it)."""
    with pytest.raises(ValueError, match="row\\['answer'\\]"):
        gsm8k_reward("\\boxed{1}", {"prompt": "x"})


# --- arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("42", 1.0),
        ("The sum is 42.", 1.0),
        ("40 + 2 = 42", 1.0),
        ("42.0", 1.0),
        ("I think 41, no wait, 42", 1.0),
        ("42 is wrong, it is 43", 0.0),
        ("50-8", 0.0),
        ("", 0.0),
        ("forty-two", 0.0),
    ],
)
def test_arithmetic_last_number_compares_the_last_number_in_the_reply(
    completion: str, expected: float
) -> None:
    """The last number decides; a minus between digits is an operator, not a sign."""
    assert arithmetic_last_number(completion, {"answer": "42"}) == expected


def test_arithmetic_last_number_reads_negative_answers() -> None:
    """A leading minus sign belongs to the number."""
    assert arithmetic_last_number("3 - 8 = -5", {"answer": "-5"}) == 1.0
    assert arithmetic_last_number("It is \u22125", {"answer": -5}) == 1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("7", 1.0),
        (" 7\n", 1.0),
        ("7</s>", 1.0),
        ("7<|im_end|>\n", 1.0),
        ("7.", 0.0),
        ("07", 0.0),
        ("The answer is 7", 0.0),
        ("3+4=7", 0.0),
    ],
)
def test_arithmetic_strict_accepts_only_the_bare_number(completion: str, expected: float) -> None:
    """Whitespace and EOS markers are trimmed; anything else around the number fails."""
    assert arithmetic_strict(completion, {"answer": 7}) == expected


def test_exact_match_compares_trimmed_text() -> None:
    """exact_match ignores surrounding whitespace and EOS markers, nothing else."""
    assert exact_match("  Paris<|endoftext|>", {"answer": "Paris "}) == 1.0
    assert exact_match("paris", {"answer": "Paris"}) == 0.0


# --- registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gsm8k", "arithmetic", "arithmetic_strict", "exact_match"])
def test_builtin_rewards_resolve_by_name(name: str) -> None:
    """Every built-in name resolves to a function that scores a right answer 1.0."""
    assert call_reward(resolve_reward(name), "\\boxed{7}" if name == "gsm8k" else "7", {"answer": "7"}) == 1.0


def test_custom_rewards_resolve_by_import_path_sync_and_async() -> None:
    """``package.module:function`` imports sync and async functions; call_reward runs both."""
    assert call_reward(resolve_reward("tests.helpers.reward_fns:length_reward"), "abc", {}) == 3.0
    assert call_reward(resolve_reward("tests.helpers.reward_fns:async_reward"), "7", {"answer": 7}) == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gsm9k", r"unknown reward 'gsm9k'; did you mean 'gsm8k'\?"),
        ("no_such_thing", "a custom reward is 'package.module:function'"),
        ("tests.unit.no_such_module:fn", "cannot import module 'tests.unit.no_such_module'"),
        ("tests.helpers.reward_fns:missing", "has no attribute 'missing'"),
        ("tests.helpers.reward_fns:NOT_A_FUNCTION", "is not callable"),
    ],
)
def test_bad_reward_specs_say_what_is_wrong(spec: str, message: str) -> None:
    """Unknown names, unimportable modules, missing attributes and non-callables are RewardSpecErrors."""
    with pytest.raises(RewardSpecError, match=message):
        resolve_reward(spec)


@pytest.mark.parametrize(
    ("result", "error"), [("1.0", TypeError), (None, TypeError), (float("inf"), ValueError)]
)
def test_a_reward_that_is_not_a_finite_number_is_an_error(result: object, error: type[Exception]) -> None:
    """Strings, None and non-finite values are rejected rather than coerced."""
    with pytest.raises(error):
        call_reward(lambda completion, row: result, "x", {})


# --- pool --------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[RewardPool]:
    """One scripted-reward pool (2 workers, 1 s timeout) shared by the pool tests: spawning costs ~0.5 s."""
    async with RewardPool(SCRIPTED, num_workers=2, timeout_s=POOL_TIMEOUT_S) as shared:
        yield shared


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a reaped child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pool_test
async def test_pool_scores_completions_in_input_order(pool: RewardPool) -> None:
    """Outcomes line up with the completions and carry no error on success."""
    outcomes = await pool.score(["7", "8", " 7 ", "x"], {"answer": 7})
    assert [o.reward for o in outcomes] == [1.0, 0.0, 1.0, 0.0]
    assert all(o.error is None and o.seconds >= 0 for o in outcomes)
    assert await pool.score([], {"answer": 7}) == []


@pool_test
async def test_pool_records_an_exception_as_reward_zero_with_the_error(pool: RewardPool) -> None:
    """A raising function gives 0.0 with the exception type, message and location; others are unaffected."""
    raised, fine = await pool.score(["raise", "7"], {"answer": "7"})
    assert raised.reward == 0.0
    assert raised.error is not None and raised.error.startswith("ValueError: scripted failure")
    assert "reward_fns.py" in raised.error
    assert fine == RewardOutcome(reward=1.0, error=None, seconds=fine.seconds)


@pool_test
async def test_pool_records_non_numeric_results_as_errors(pool: RewardPool) -> None:
    """NaN and string results become 0.0 with an explanation."""
    nan, text = await pool.score(["nan", "text"], {"answer": "7"})
    assert (nan.reward, text.reward) == (0.0, 0.0)
    assert "finite" in (nan.error or "") and "str" in (text.error or "")


@pool_test
async def test_pool_times_out_a_hung_call_replaces_its_worker_and_keeps_other_calls(pool: RewardPool) -> None:
    """A call that never returns yields 0 + error within the timeout; calls on the other worker still
    complete, and the hung process is killed and replaced by a new one."""
    before = set(pool.worker_pids)
    started = time.monotonic()
    outcomes = await pool.score(["hang", "7", "8", "7", "raise"], {"answer": "7"})
    elapsed = time.monotonic() - started
    hung = outcomes[0]
    assert hung.reward == 0.0 and hung.error is not None and "timed out" in hung.error
    assert POOL_TIMEOUT_S <= hung.seconds < POOL_TIMEOUT_S + 2 and elapsed < POOL_TIMEOUT_S + 2
    assert [o.reward for o in outcomes[1:]] == [1.0, 0.0, 1.0, 0.0] and outcomes[4].error
    hung_pid = next(pid for pid in before if str(pid) in hung.error)
    assert hung_pid not in pool.worker_pids

    pids = await pool.score(["pid"] * 4, {"answer": "7"})
    serving = {int(o.reward) for o in pids}
    assert len(serving) == 2 and hung_pid not in serving and serving - before
    assert set(pool.worker_pids) == serving


@pool_test
async def test_pool_replaces_a_worker_whose_process_dies(pool: RewardPool) -> None:
    """A function that kills its own process gives 0 + the exit code; the pool keeps scoring."""
    died, *rest = await pool.score(["exit", "7", "7"], {"answer": "7"})
    assert died.reward == 0.0 and "exit code 3" in (died.error or "")
    assert [o.reward for o in rest] == [1.0, 1.0]
    assert [o.reward for o in await pool.score(["7"] * 3, {"answer": "7"})] == [1.0] * 3
    assert len(pool.worker_pids) == 2


@pool_test
async def test_pool_survives_a_caller_that_cancels_mid_call(pool: RewardPool) -> None:
    """Cancelling ``score`` while calls run leaves a working pool (the busy worker is replaced)."""
    with anyio.move_on_after(0.2):
        await pool.score(["hang", "hang"], {"answer": "7"})
    outcomes = await pool.score(["7", "8"], {"answer": "7"})
    assert [o.reward for o in outcomes] == [1.0, 0.0]


@pool_test
async def test_async_reward_functions_run_in_the_pool_and_leave_no_process_behind() -> None:
    """``async def`` rewards run via asyncio.run in the worker; after aclose every worker is gone."""
    async with RewardPool(
        "tests.helpers.reward_fns:async_reward", num_workers=1, timeout_s=5.0
    ) as async_pool:
        pids = async_pool.worker_pids
        right, failed = await async_pool.score(["7", "raise"], {"answer": 7})
    assert right.reward == 1.0 and right.error is None
    assert failed.reward == 0.0 and "RuntimeError: async failure" in (failed.error or "")
    assert pids and not any(pid_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        await async_pool.score(["7"], {"answer": 7})


@pool_test
async def test_gsm8k_builtin_scores_in_worker_processes() -> None:
    """The gsm8k reward (math-verify with its signal timeouts) works inside pool workers."""
    async with RewardPool("gsm8k", num_workers=1, timeout_s=30.0) as gsm8k_pool:
        outcomes = await gsm8k_pool.score(
            ["\\boxed{\\sqrt{324}}", "#### 1,000", "The answer is 17."], {"answer": "18"}
        )
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0]
    assert all(o.error is None for o in outcomes)


@pool_test
async def test_pool_start_reports_a_reward_that_does_not_import_and_leaves_no_process() -> None:
    """A spec that fails in the worker raises RewardSpecError from start, with nothing left running."""
    bad = RewardPool("tests.helpers.reward_fns:NOT_A_FUNCTION", num_workers=1)
    with pytest.raises(RewardSpecError, match="not callable"):
        await bad.start()
    assert bad.worker_pids == []
    await bad.aclose()


def test_pool_rejects_an_unknown_builtin_before_starting_processes() -> None:
    """A misspelt built-in fails in the constructor, with a hint."""
    with pytest.raises(RewardSpecError, match="did you mean 'arithmetic'"):
        RewardPool("arithmetc")
