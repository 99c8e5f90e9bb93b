"""Tools an agent can call: the interface, a safe way to run one, and the ``calculator``.

A tool is a ``Tool`` subclass with a ``name``, a ``description``, a JSON-schema ``parameters``
object and ``async def call(arguments: dict) -> str``. ``call`` returns the text the model sees,
or raises ``ToolError(message)`` for a failure the model should read (bad input, a crash of the
code it ran). Tools must not block the event loop: CPU or blocking work goes through
``anyio.to_thread`` or a subprocess.

``invoke_tool(tool, arguments, timeout_s=)`` is how workflows run a tool: it never raises (except
cancellation). A ToolError, any other exception, or a call still running at ``timeout_s`` ends
the call with ``ToolOutcome(ok=False, text="error: ...")``.

Built-ins:

- ``Calculator`` (``calculator``): arithmetic on int and float literals with ``+ - * / // % **``,
  unary minus/plus and parentheses, evaluated by walking the ``ast`` (never ``eval``). Names,
  calls, attributes and every other syntax are refused; exponents above ``MAX_EXPONENT`` and
  integers above ``MAX_INT_BITS`` bits are refused before they are computed. Integral float
  results print as integers (``10/2`` gives ``5``).
- ``PythonTool`` (``python``, in ``sandbox.py``): runs code in a sandboxed subprocess.
"""

from __future__ import annotations

import abc
import ast
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import structlog

log = structlog.get_logger(__name__)

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1024
MAX_INT_BITS = 4096
_MAX_DEPTH = 64


class ToolError(Exception):
    """A tool call failed in a way the model should be told about; the message is what it reads."""


class Tool(abc.ABC):
    """An action the model can take. Subclasses set the three class attributes and ``call``."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]
    """JSON schema of the arguments object (``{"type": "object", "properties": ..., "required": ...}``)."""

    @abc.abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool on validated ``arguments``; return the result text or raise ToolError."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema that chat templates take through ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def string_arguments(**descriptions: str) -> dict[str, Any]:
    """The parameters schema of a tool whose arguments are all required strings, one per keyword."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": text} for name, text in descriptions.items()},
        "required": list(descriptions),
        "additionalProperties": False,
    }


@dataclass(frozen=True, kw_only=True)
class ToolOutcome:
    """What one tool call gave back: the text for the model and whether the call succeeded."""

    name: str
    text: str
    ok: bool
    seconds: float = 0.0


async def invoke_tool(tool: Tool, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
    """Run ``tool.call(arguments)`` with a deadline; every failure becomes an ``ok=False`` outcome."""
    start = time.perf_counter()
    try:
        with anyio.fail_after(timeout_s):
            text = await tool.call(arguments)
        if not isinstance(text, str):
            raise TypeError(f"call() returned {type(text).__name__}, expected str")
        ok = True
    except ToolError as exc:
        text, ok = f"error: {exc}", False
    except TimeoutError:
        text, ok = f"error: tool {tool.name!r} did not finish within {timeout_s} s and was stopped", False
    except Exception as exc:  # a bug in the tool must not end the episode
        log.warning("tool raised", tool=tool.name, error=f"{type(exc).__name__}: {exc}")
        text, ok = f"error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}", False
    return ToolOutcome(name=tool.name, text=text, ok=ok, seconds=time.perf_counter() - start)


# ---- calculator ------------------------------------------------------------------------------


class Calculator(Tool):
    """Arithmetic on numbers (see the module docstring for what is accepted)."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses, "
        "e.g. '(17 + 25) * 3 / 2'. Returns the value."
    )
    parameters = string_arguments(expression="The expression to evaluate.")

    async def call(self, arguments: dict[str, Any]) -> str:
        return format_number(evaluate_arithmetic(arguments["expression"]))


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED: dict[type[ast.AST], str] = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attributes are not allowed",
    ast.Subscript: "indexing is not allowed",
    ast.Lambda: "lambdas are not allowed",
}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of ``expression``; ToolError (naming the problem) for anything but arithmetic."""
    if not isinstance(expression, str):
        raise ToolError(f"calculator: expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"calculator: {expression!r} is not an arithmetic expression ({exc.msg})") from None
    try:
        value = _evaluate(tree.body, 0)
    except ZeroDivisionError:
        raise ToolError("calculator: division by zero") from None
    except OverflowError:
        raise ToolError("calculator: the result is too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("calculator: the result is not a finite number")
    return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _evaluate(node: ast.AST, depth: int) -> int | float:
    if depth > _MAX_DEPTH:
        raise ToolError("calculator: the expression is nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"calculator: only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        _check_size(node.op, left, right)
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ToolError("calculator: the result is not a real number")
        return value
    for kind, reason in _REFUSED.items():
        if isinstance(node, kind):
            name = f" ({node.id!r})" if isinstance(node, ast.Name) else ""
            raise ToolError(f"calculator: {reason}{name}; use numbers, + - * / // % ** and parentheses")
    raise ToolError(
        f"calculator: {type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses"
    )


def _check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse an operation whose result would be huge, before computing it."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise ToolError(f"calculator: exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
            raise ToolError(f"calculator: the result would have more than {MAX_INT_BITS} bits")
    elif isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise ToolError(f"calculator: the result would have more than {MAX_INT_BITS} bits")
