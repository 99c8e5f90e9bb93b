"""The ``python`` tool: run model-written code in a sandboxed subprocess.

Each call runs ``python -I -B -u`` (unbuffered, so stdout and stderr interleave in write order)
in a new session (its own process group) with a fresh temporary working directory that is removed
afterwards, stdin from /dev/null and a minimal environment (``PATH``, ``HOME`` and ``TMPDIR``
pointing at the working directory, one BLAS thread). Before the code runs, the child

- sets resource limits: ``RLIMIT_CPU`` (``cpu_s``, by default one second past ``timeout_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_FSIZE``
  (``max_file_mb``), ``RLIMIT_NPROC`` 0 (no new processes or threads) and ``RLIMIT_CORE`` 0;
- installs an audit hook that refuses: every ``socket.*`` event (no network, no DNS); starting
  processes (``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``,
  ``os.fork``, ``pty``); sending signals; raising its own limits; walking the heap (``gc.get_*``);
  opening a file for writing, and creating, removing, renaming or changing a file, outside its
  working directory (symlinks resolved). Importing ``ctypes`` or ``_posixsubprocess`` raises
  ImportError, so libraries that treat them as optional (numpy) still import.

The parent kills the whole process group at ``timeout_s`` wall time, and as soon as stdout plus
stderr pass ``max_output_bytes`` (the output is kept up to that size). A call that times out,
floods its output, exits non-zero or dies by a signal raises ``ToolError`` with the output so far
and the reason, so the model sees what went wrong; ``invoke_tool`` turns it into an error result.

This keeps a model's mistakes (infinite loops, memory bombs, stray writes, network calls) from
harming the worker. Audit hooks are not a security boundary against code written to escape
them: run agent workers that execute untrusted code inside a container or VM as well. Under
root, ``RLIMIT_NPROC`` does not apply; pass ``user="nobody"`` to run the code as another user.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

from areal_async.agents.tools import Tool, ToolError, string_arguments

_CHUNK = 65536

# Runs in the child as `python -I -B -u -c _BOOTSTRAP workdir cpu_s memory_bytes fsize_bytes`.
# The hook keeps its settings in default arguments: replacing them is an audited event it refuses.
_BOOTSTRAP = r"""
import os, resource, sys, traceback

def _setup(workdir, cpu_s, memory_bytes, fsize_bytes):
    for which, soft, hard in (
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_FSIZE, fsize_bytes, fsize_bytes),
        (resource.RLIMIT_NPROC, 0, 0),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        _, current = resource.getrlimit(which)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(which, (soft, hard))

    refused = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
               "os.fork", "os.forkpty", "pty.", "os.kill", "os.killpg", "signal.pthread_kill",
               "ctypes.", "resource.setrlimit", "resource.prlimit", "os.startfile", "gc.get_")
    path_args = (("os.remove", (0,)), ("os.rmdir", (0,)), ("os.mkdir", (0,)), ("os.chmod", (0,)),
                 ("os.chown", (0,)), ("os.truncate", (0,)), ("os.utime", (0,)), ("os.rename", (0, 1)),
                 ("os.link", (1,)), ("os.symlink", (1,)), ("os.mkfifo", (0,)), ("os.mknod", (0,)),
                 ("os.chflags", (0,)), ("os.lchmod", (0,)), ("os.lchown", (0,)))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def hook(event, args, _root=os.path.realpath(workdir), _refused=refused, _paths=path_args,
             _write_flags=write_flags, _join=os.path.join, _real=os.path.realpath, _cwd=os.getcwd,
             _fsdecode=os.fsdecode, _self=None):
        def outside(path):
            if isinstance(path, int):
                return False
            full = _real(_join(_cwd(), _fsdecode(path)))
            return full != _root and not full.startswith(_root + "/")

        if event.startswith(_refused):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "ctypes"):
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        if event == "object.__setattr__" and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
            if args[0] is _self:
                raise PermissionError(f"sandbox: changing the sandbox is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if mode else bool(flags & _write_flags)
            if writing and outside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
            return
        for name, positions in _paths:
            if event == name:
                for i in positions:
                    if i < len(args) and args[i] is not None and outside(args[i]):
                        raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory")

    hook.__defaults__ = hook.__defaults__[:-1] + (hook,)
    sys.addaudithook(hook)

def _main():
    workdir = sys.argv[1]
    with open(os.path.join(workdir, "main.py"), encoding="utf-8") as f:
        source = f.read()
    _setup(workdir, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except SyntaxError as exc:
        traceback.print_exception(type(exc), exc, None)
        sys.exit(1)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)

_main()
"""


class PythonTool(Tool):
    """Run a Python program in a sandboxed subprocess; its stdout and stderr are the result."""

    name = "python"
    description = (
        "Run a Python 3 program and return what it prints (stdout and stderr). Each call starts "
        "fresh: no state is kept between calls, there is no network, and files may only be "
        "written in the current directory. Print the values you need."
    )
    parameters = string_arguments(code="The complete program to run.")

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        cpu_s: int | None = None,
        memory_mb: int = 512,
        max_output_bytes: int = 4096,
        max_file_mb: int = 16,
        python: str = sys.executable,
        user: str | int | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"python tool: timeout_s must be > 0, got {timeout_s!r}")
        if memory_mb < 64:
            raise ValueError(
                f"python tool: memory_mb must be >= 64 (the interpreter needs it), got {memory_mb}"
            )
        if max_output_bytes < 1 or max_file_mb < 1:
            raise ValueError("python tool: max_output_bytes and max_file_mb must be >= 1")
        self.timeout_s = timeout_s
        # The CPU limit is a backstop behind the wall-clock deadline: a single-threaded program
        # uses at most timeout_s of CPU before the parent kills it, so one second more never races.
        self.cpu_s = cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_file_mb = max_file_mb
        self.python = python
        self.user = user

    async def call(self, arguments: dict[str, Any]) -> str:
        code = arguments["code"]
        if not isinstance(code, str):
            raise ToolError(f"python: code must be a string, got {type(code).__name__}")
        workdir = await anyio.to_thread.run_sync(self._prepare, code)
        try:
            return await self._run(Path(workdir.name))
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(workdir.cleanup)

    def _prepare(self, code: str) -> tempfile.TemporaryDirectory[str]:
        """A fresh working directory holding the program as main.py."""
        # TemporaryDirectory's cleanup also removes files the program made read-only.
        workdir = tempfile.TemporaryDirectory(prefix="areal-python-", ignore_cleanup_errors=True)
        Path(workdir.name, "main.py").write_text(code, encoding="utf-8")
        if self.user is not None:
            shutil.chown(workdir.name, user=self.user)
        return workdir

    async def _run(self, workdir: Path) -> str:
        command = [self.python, "-I", "-B", "-u", "-c", _BOOTSTRAP, str(workdir), str(self.cpu_s)]
        command += [str(self.memory_mb << 20), str(self.max_file_mb << 20)]
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,
            user=self.user,
        )
        output = bytearray()
        flooded = False
        try:
            with anyio.move_on_after(self.timeout_s) as deadline:
                assert process.stdout is not None
                async for chunk in process.stdout:
                    output += chunk
                    if len(output) > self.max_output_bytes:
                        flooded = True
                        break
                if not flooded:
                    await process.wait()
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    _kill_group(process.pid)
                await process.wait()
                await process.aclose()
        text = output[: self.max_output_bytes].decode("utf-8", errors="replace")
        if flooded:
            raise ToolError(f"{text}\n[output passed {self.max_output_bytes} bytes; the program was stopped]")
        if deadline.cancelled_caught:
            raise ToolError(f"{text}\n[timed out after {self.timeout_s} s; the program was killed]")
        if process.returncode:
            raise ToolError(f"{text}\n[{_exit_reason(process.returncode)}]")
        return text or "(no output)"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _exit_reason(returncode: int) -> str:
    if returncode > 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    if -returncode == signal.SIGXCPU:
        return f"killed by {name}: CPU time limit reached"
    return f"killed by signal {name}"
