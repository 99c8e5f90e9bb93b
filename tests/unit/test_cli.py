"""Command-line behaviour that needs no bus: help, fast start, clear usage errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("entry", ["worker_main", "main"])
def test_help_imports_no_torch(entry: str) -> None:
    """--help of both commands prints usage and never imports torch or transformers."""
    code = (
        "import sys\n"
        "from workers import cli\n"
        "try:\n"
        f"    cli.{entry}(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'nats', 'numpy') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
    assert "HEAVY ['torch'" not in out.stdout and "HEAVY []" in out.stdout, out.stdout


@pytest.mark.parametrize(("preset", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_worker_s_openmp_threads_sleep_when_waiting_unless_the_user_chose(
    preset: str | None, expected: str
) -> None:
    """Both entry points set OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (so a worker and
    the processes it starts inherit it); a value the user set is kept."""
    setup = (
        "os.environ.pop('OMP_WAIT_POLICY', None)"
        if preset is None
        else f"os.environ['OMP_WAIT_POLICY'] = {preset!r}"
    )
    for entry in ("worker_main(['--role', 'nope', '--config', 'x.yaml'])", "main(['--help'])"):
        code = (
            f"import os, sys\n{setup}\n"
            "from workers import cli\n"
            "try:\n"
            f"    cli.{entry}\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('POLICY', os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
        )
        out = _run(code)
        assert f"POLICY {expected} False" in out.stdout, (entry, out.stdout, out.stderr)


def test_worker_with_bad_config_exits_2_with_message(tmp_path) -> None:
    """A config error is one line on stderr and exit code 2, not a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  batchsize: 3\n")
    out = _run(
        f"from workers import cli; raise SystemExit(cli.worker_main(['--role','trainer','--config',{str(bad)!r}]))"
    )
    assert out.returncode == 2
    assert "did you mean 'batch_size'?" in out.stderr
    assert "Traceback" not in out.stderr


def test_sft_without_an_sft_section_exits_2_naming_the_fix(tmp_path) -> None:
    """``areal-async sft`` on a run file without ``sft`` says what to add: one line on stderr, exit 2."""
    plain = tmp_path / "plain.yaml"
    plain.write_text("trainer:\n  batch_size: 2\n")
    out = _run(f"from workers import cli; raise SystemExit(cli.main(['sft', {str(plain)!r}]))")
    assert out.returncode == 2
    assert "ConfigError: the run file has no sft section" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_role_is_a_usage_error() -> None:
    """--role must be one of the five roles."""
    out = _run("from workers import cli; cli.worker_main(['--role','critic','--config','x.yaml'])")
    assert out.returncode == 2
    assert "invalid choice: 'critic'" in out.stderr


def test_stop_signal_during_teardown_keeps_the_workers_exit_code() -> None:
    """After a worker stopped, a SIGTERM while the interpreter tears down exits with the worker's code."""
    import signal

    script = (
        "import sys, time\n"
        "from workers.runtime import _exit_on_stop_signal\n"
        "_exit_on_stop_signal(3)\n"
        "print('armed', flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "armed"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 3
