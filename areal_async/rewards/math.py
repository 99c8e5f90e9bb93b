r"""GSM8K-style math reward: 1.0 when the completion's final answer equals ``row["answer"]``.

Extraction, first that applies (``extract_answer``):

1. the last ``\boxed{...}`` (nested braces balanced; also ``\fbox``, ``\boxed 5``),
2. the text after the last ``#### ``,
3. the number right after the last "answer is" / "answer:",
4. the last number in the text.

Comparison (``gsm8k_reward``):

- When both sides are plain numbers after normalisation (thousands commas, ``$``,
  ``\text{..}``, units or words after the number, ``%``, trailing ``.0``, ``a/b`` and
  ``\frac{a}{b}``, ``x = N``), they compare exactly as fractions. This is what
  math-verify would conclude, at a fraction of the cost and with no way to hang.
- Anything else (``\sqrt{324}``, ``6 \times 3``) goes to math-verify
  (``parse`` + ``verify``) under a per-call deadline of ``timeout_s``: in the main
  thread through math-verify's own ``parsing_timeout`` / ``timeout_seconds``
  (signal based; an outer ``SIGALRM`` timer is preserved), elsewhere in a helper
  thread that is abandoned at the deadline. Inputs known to make sympy run for
  minutes (towers of powers, huge factorials, very long expressions) are refused
  before math-verify sees them. Anything undecided scores 0.0.

Hard guarantee against a hang belongs to the caller: ``RewardPool`` kills a worker
that overruns its timeout. The deadline here keeps that from being the common path.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, TypeVar

import structlog

log = structlog.get_logger()

T = TypeVar("T")

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# A minus sign counts only where it cannot be a binary operator ("5-3" is not -3).
_SIGNED = rf"(?:(?<![\w)\]}}])-)?(?:{_NUM})"
_FRAC_LATEX = r"-?\\frac\{\s*-?[\d.,]+\s*\}\{\s*-?[\d.,]+\s*\}"
_NUMBER_LIKE = rf"{_FRAC_LATEX}|{_SIGNED}(?:\s*/\s*(?:{_NUM}))?"

_LAST_NUMBER = re.compile(_NUMBER_LIKE)
_LEADING_NUMBER = re.compile(rf"\s*({_NUMBER_LIKE})")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_STRICT_NUMBER = re.compile(
    rf"(?P<number>{_FRAC_LATEX}|{_SIGNED}(?:\s*/\s*-?(?:{_NUM}))?)"
    r"\s*(?:%|percent\b)?"
    r"(?P<rest>[A-Za-z\s/.,;:!?'\"()°²³-]*)"
)
_MAX_MATH_VERIFY_CHARS = 200
# Shapes that make sympy evaluate for minutes: a power with a 4+ digit exponent, power
# towers, factorials of big numbers or of expressions, products and sums.
_PATHOLOGICAL = re.compile(
    r"\^\s*\{?\s*\(?\s*\d{4,}|\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\d{4,}\s*!|[)}]\s*!|\\prod|\\sum"
)

_REMOVALS = (
    ("{,}", ","),
    ("\\left", ""),
    ("\\right", ""),
    ("\\$", ""),
    ("$", ""),
    ("\\%", "%"),
    ("\\,", ""),
    ("\\!", ""),
    ("\\;", " "),
    ("\\ ", " "),
    ("~", " "),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\circ", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("**", ""),
    ("\u2212", "-"),
    ("\u00a0", " "),
    ("\u202f", " "),
)


def gsm8k_reward(completion: str, row: Mapping[str, Any], *, timeout_s: float = 5.0) -> float:
    """1.0 when the final answer of ``completion`` equals ``row["answer"]``, else 0.0."""
    if "answer" not in row:
        raise ValueError(f"the gsm8k reward needs row['answer'] (row keys: {sorted(row)})")
    gold = str(row["answer"])
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    gold_number, predicted_number = to_number(gold), to_number(predicted)
    if gold_number is not None and predicted_number is not None:
        return float(gold_number == predicted_number)
    return float(math_verify_equal(gold, predicted, timeout_s=timeout_s) is True)


def extract_answer(text: str) -> str | None:
    """The final-answer segment of a completion, in the module's priority order; None if it has none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marker = text.rfind("####")
    if marker >= 0:
        line = text[marker + 4 :].strip().split("\n", 1)[0]
        cleaned = clean_latex(line)
        leading = _LEADING_NUMBER.match(cleaned)
        if leading:
            return leading.group(1)
        anywhere = _LAST_NUMBER.search(cleaned)
        if anywhere:
            return anywhere.group(0)
    for match in reversed(list(_ANSWER_IS.finditer(text))):
        line = text[match.end() :].split("\n", 1)[0]
        leading = _LEADING_NUMBER.match(clean_latex(line))
        if leading:
            return leading.group(1)
    numbers = _LAST_NUMBER.findall(clean_latex(text))
    return numbers[-1] if numbers else None


def clean_latex(text: str) -> str:
    r"""Drop the LaTeX and markdown that wraps numbers: ``$``, ``\text{}``, ``\left``, ``**``, ``\%``."""
    text = _TEXT_MACRO.sub(r" \1 ", text)
    for old, new in _REMOVALS:
        text = text.replace(old, new)
    return text.strip()


def to_number(answer: str) -> Fraction | None:
    """The exact value of an answer that is a plain number (with units, ``$``, ``%``); else None.

    Strict on purpose: ``2^3`` or ``18 + 2`` are not plain numbers (they go to math-verify),
    whereas ``$1,000.00``, ``18 apples``, ``50%``, ``\\frac{3}{4}`` and ``x = 7`` are.
    """
    text = clean_latex(answer)
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    match = _STRICT_NUMBER.fullmatch(text.strip())
    if match is None or any(ch.isdigit() for ch in match.group("rest")):
        return None
    return _fraction(match.group("number"))


def math_verify_equal(gold: str, predicted: str, *, timeout_s: float = 5.0) -> bool | None:
    """math-verify's verdict on ``predicted == gold`` within ``timeout_s``; None when it cannot decide."""
    if len(predicted) > _MAX_MATH_VERIFY_CHARS or _PATHOLOGICAL.search(predicted):
        return None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM"):
        return _math_verify_with_alarms(gold, predicted, timeout_s)
    finished, verdict = call_with_deadline(lambda: _math_verify(gold, predicted, None, None), timeout_s)
    if not finished:
        log.warning("math-verify timed out", timeout_s=timeout_s, answer=predicted[:80])
        return None
    return verdict


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> tuple[bool, T | None]:
    """Run ``fn`` in a daemon thread; ``(True, result)``, or ``(False, None)`` past ``timeout_s``.

    A thread cannot be killed: past the deadline it is abandoned and runs to completion
    in the background. Use it only for work that normally finishes; exceptions propagate.
    """
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # re-raised in the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=target, name="reward-deadline", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return False, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return True, value


def _math_verify_with_alarms(gold: str, predicted: str, timeout_s: float) -> bool | None:
    """math-verify with its own signal timeouts, budgeted so the whole call stays near ``timeout_s``."""
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    try:
        return _math_verify(gold, predicted, timeout_s, started)
    finally:
        if outer_delay > 0:  # math-verify's alarm(0) cancelled an enclosing timer: re-arm what is left of it
            remaining = max(outer_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def _math_verify(gold: str, predicted: str, timeout_s: float | None, started: float | None) -> bool | None:
    from math_verify import parse, verify  # sympy import takes ~1 s; pay it only when needed

    def budget() -> int | None:
        # math-verify's timeouts are whole seconds of signal.alarm; None disables them (off the main thread)
        if timeout_s is None or started is None:
            return None
        return max(1, math.ceil(timeout_s - (time.monotonic() - started)))

    gold_parsed = parse(_as_latex(gold), parsing_timeout=budget())
    if not gold_parsed:
        return None
    predicted_parsed = parse(_as_latex(predicted), parsing_timeout=budget())
    if not predicted_parsed:
        return None
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=budget()))


def _as_latex(answer: str) -> str:
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


def _last_boxed(text: str) -> str | None:
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    closing = _matching_braces(text)
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            end = closing.get(start)
            content = text[start + 1 : end].strip() if end is not None else ""
            if content:
                return content
        else:
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return token.group(0)
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` that is closed -> index of its ``}``, in one pass (degenerate output is long)."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def _fraction(number: str) -> Fraction | None:
    number = number.replace(",", "").replace(" ", "")
    try:
        if number.lstrip("-").startswith("\\frac"):
            sign = -1 if number.startswith("-") else 1
            numerator, denominator = re.findall(r"\{([^{}]*)\}", number)[:2]
            return sign * Fraction(numerator) / Fraction(denominator)
        if "/" in number:
            numerator, denominator = number.split("/", 1)
            return Fraction(numerator) / Fraction(denominator)
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that timeouts are off; off the main thread we enforce our own deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())
