"""Agent tools: the calculator, the python sandbox, running tools safely, and the tool-call format."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from areal_async.agents import (
    Calculator,
    PythonTool,
    Tool,
    ToolError,
    invoke_tool,
    parse_tool_calls,
    render_tool_prompt,
    run_tool_calls,
    tool_message,
)
from areal_async.agents.tools import evaluate_arithmetic

TOOLS = (Calculator(), PythonTool(timeout_s=5.0))


async def run_python(code: str, **options: Any) -> tuple[bool, str, float]:
    tool = PythonTool(**{"timeout_s": 5.0, **options})
    start = time.perf_counter()
    outcome = await invoke_tool(tool, {"code": code}, timeout_s=30.0)
    return outcome.ok, outcome.text, time.perf_counter() - start


# --- calculator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", "14"),
        ("(17 + 25) * 3 / 2", "63"),
        ("7 / 2", "3.5"),
        ("-3 ** 2", "-9"),
        ("-(-4)", "4"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("17 // 5 + 17 % 5", "5"),
        ("1.5e3 - 0.25", "1499.75"),
        ("3 ** 200", str(3**200)),
    ],
)
@pytest.mark.asyncio
async def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    """Numbers, the seven operators, unary minus and parentheses give Python's values."""
    assert await Calculator().call({"expression": expression}) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "names are not allowed \\('x'\\)"),
        ("abs(-1)", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "List is not allowed"),
        ("2 ** 5000", "exponent 5000 is larger"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger"),
        ("(2 ** 1000) ** 5", "more than 4096 bits"),
        ("10.0 ** 1000", "too large"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than 500"),
    ],
)
def test_calculator_refuses_everything_but_bounded_arithmetic(expression: str, message: str) -> None:
    """Names, calls, attributes, non-numbers, huge powers and bad syntax raise ToolError, never run."""
    with pytest.raises(ToolError, match=message):
        evaluate_arithmetic(expression)


# --- python sandbox -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_python_tool_returns_what_the_program_prints() -> None:
    """stdout and stderr both come back; the program runs in a fresh directory removed afterwards."""
    ok, text, _ = await run_python(
        "import os, sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\nprint(os.getcwd())"
    )
    assert ok
    answer, warning, workdir = text.splitlines()
    assert (answer, warning) == ("42", "warn")
    assert "areal-python-" in workdir and not await anyio.Path(workdir).exists()


@pytest.mark.asyncio
async def test_python_tool_kills_an_infinite_loop_and_its_process_group_at_the_deadline() -> None:
    """A program that never ends is killed at timeout_s (well within twice it) and leaves no process."""
    ok, text, seconds = await run_python(
        "import os\nprint(os.getpid(), flush=True)\nwhile True: pass", timeout_s=1.0
    )
    assert not ok and "timed out after 1.0 s" in text
    assert seconds < 2.0
    with pytest.raises(ProcessLookupError):
        os.kill(int(text.split()[1]), 0)


@pytest.mark.asyncio
async def test_python_tool_cpu_limit_stops_a_busy_program_before_the_wall_deadline() -> None:
    """An explicit cpu_s below timeout_s ends a busy loop with SIGXCPU, and the model is told why."""
    ok, text, seconds = await run_python("while True: pass", timeout_s=20.0, cpu_s=1)
    assert not ok and "CPU time limit reached" in text
    assert seconds < 10.0


@pytest.mark.asyncio
async def test_a_cancelled_python_call_leaves_no_process() -> None:
    """When the caller's deadline ends the call first (invoke_tool), the program is killed too."""
    tool = PythonTool(timeout_s=60.0)
    code = "import os\nopen('pid', 'w').write(str(os.getpid()))\nwhile True: pass"
    outcome = await invoke_tool(tool, {"code": code}, timeout_s=0.5)
    assert not outcome.ok and "did not finish within 0.5 s" in outcome.text
    alive = [
        p
        for p in os.listdir("/proc")
        if p.isdigit() and _cmdline(p).startswith(f"{tool.python}\0-I\0-B") and _parent(p) == os.getpid()
    ]
    assert alive == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _parent(pid: str) -> int:
    """The parent pid of ``pid`` (-1 once it is gone): the programs this process started, not those
    of other processes running tools on the same machine."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


@pytest.mark.asyncio
async def test_python_tool_memory_bomb_fails_cleanly() -> None:
    """Allocating past memory_mb raises MemoryError in the program; the call reports it and returns."""
    ok, text, _ = await run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert not ok
    assert "MemoryError" in text and "allocated" not in text and "[exit code 1]" in text


@pytest.mark.asyncio
async def test_python_tool_refuses_network_connections() -> None:
    """A connect to a listening local socket is refused inside the program and never arrives."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        )
        ok, text, _ = await run_python(code)
        assert not ok and "sandbox: socket." in text and "connected" not in text
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.asyncio
async def test_python_tool_refuses_processes_and_writes_outside_its_directory(tmp_path: Path) -> None:
    """subprocess, os.system and a write outside the working directory fail; writes inside work."""
    target = tmp_path / "escaped.txt"
    for code in (
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
    ):
        ok, text, _ = await run_python(code)
        assert not ok and "sandbox:" in text, code
    assert not target.exists()
    ok, text, _ = await run_python("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())")
    assert ok and text.strip() == "kept"


@pytest.mark.asyncio
async def test_python_tool_truncates_flooding_output_and_stops_the_program() -> None:
    """Output past max_output_bytes is cut there and ends the call with an error result."""
    ok, text, _ = await run_python("while True:\n    print('x' * 100)", max_output_bytes=1000)
    assert not ok
    assert text.count("x") <= 1000 and "output passed 1000 bytes" in text


@pytest.mark.asyncio
async def test_python_tool_reports_syntax_errors_and_exit_codes() -> None:
    """A syntax error shows the model's line; a non-zero exit is named."""
    ok, text, _ = await run_python("def (")
    assert not ok and "SyntaxError" in text and 'File "main.py", line 1' in text
    ok, text, _ = await run_python("import sys\nprint('bye')\nsys.exit(3)")
    assert not ok and text.endswith("bye\n\n[exit code 3]")


# --- running any tool ---------------------------------------------------------------------------


class Hangs(Tool):
    name = "hangs"
    description = "never returns"
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    async def call(self, arguments: dict[str, Any]) -> str:
        await anyio.sleep(3600)
        return "never"


class Crashes(Tool):
    name = "crashes"
    description = "raises"
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    async def call(self, arguments: dict[str, Any]) -> str:
        raise KeyError("boom")


@pytest.mark.asyncio
async def test_invoke_tool_turns_hangs_and_crashes_into_error_results() -> None:
    """A tool past its deadline or raising returns ok=False with a readable error; nothing propagates."""
    hung = await invoke_tool(Hangs(), {}, timeout_s=0.2)
    assert not hung.ok and "did not finish within 0.2 s" in hung.text
    crashed = await invoke_tool(Crashes(), {}, timeout_s=1.0)
    assert not crashed.ok and "KeyError" in crashed.text and "boom" in crashed.text


# --- tool-call format ---------------------------------------------------------------------------


def test_parse_finds_every_call_in_a_turn() -> None:
    """Two well-formed calls come back in order with their arguments (a JSON-string form included)."""
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
        '</tool_call>\nand <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "17 * 23"}, ""),
        ("python", {"code": "print(1)"}, ""),
    ]
    assert parse_tool_calls("The answer is 391.", TOOLS) == []


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"</tool_call>', "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', 'needs a JSON object with a "name"'),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "missing argument 'expression'"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>',
            "must be string, got integer",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 1}}</tool_call>',
            "unknown argument 'x'",
        ),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "no closing </tool_call>"),
    ],
)
def test_malformed_calls_become_error_messages_not_exceptions(block: str, message: str) -> None:
    """Bad JSON, unknown tools, bad arguments and unclosed blocks parse to one call with an error."""
    [call] = parse_tool_calls(f"text {block}", TOOLS)
    assert message in call.error


@pytest.mark.asyncio
async def test_run_tool_calls_answers_each_call_in_order_with_errors_for_malformed_ones() -> None:
    """Valid calls run; a malformed one's outcome is its error; tool messages carry the results."""
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    )
    outcomes = await run_tool_calls(parse_tool_calls(text, TOOLS), TOOLS, timeout_s=5.0)
    assert [(o.ok, o.text) for o in outcomes] == [
        (True, "391"),
        (False, "error: tool call 2: unknown tool 'nope' (available: calculator, python)"),
        (False, "error: calculator: division by zero"),
    ]
    assert tool_message(outcomes[0]) == {"role": "tool", "name": "calculator", "content": "391"}


def test_tool_prompt_lists_each_schema_and_the_call_format() -> None:
    """The system text names every tool with its parameters and shows the <tool_call> format."""
    prompt = render_tool_prompt(TOOLS)
    assert '"name": "calculator"' in prompt and '"name": "python"' in prompt and '"expression"' in prompt
    assert '<tool_call>\n{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>' in prompt
