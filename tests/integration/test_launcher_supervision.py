"""``areal-async run`` and the CLI on failure: exit codes and one-line errors, never a traceback.

Real processes (``python -m workers ...``) with a real nats-server; no model is loaded: the
runs start only light roles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.jobs import REPO


def run_file(tmp_path: Path, **sections: object) -> Path:
    """A run file whose model (an empty directory) is never loaded (only light roles are started)."""
    (tmp_path / "no-model").mkdir(exist_ok=True)
    cfg = {
        "name": "cli",
        "dir": str(tmp_path / "cli"),
        "model": {"path": str(tmp_path / "no-model")},
        **sections,
    }
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_a_role_that_exhausts_its_restarts_ends_the_run_with_exit_1(tmp_path: Path) -> None:
    """A reward worker that cannot import its reward function fails at every start: after
    MAX_RESTARTS restarts the run stops with exit 1 (not 130: nobody interrupted it) while
    another role is still up, says which role failed, and still writes its summary."""
    config = run_file(tmp_path, reward={"fn": "no_such_module_anywhere:fn", "num_workers": 1})
    result = subprocess.run(
        [sys.executable, "-m", "workers", "run", str(config), "--roles", "reward,weight-sync", "--no-live"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    assert "warning: reward exited with 1; restart 3/3" in result.stderr
    assert "error: reward failed 4 times (exit 1); stopping the run" in result.stderr
    assert (tmp_path / "cli" / "summary.txt").is_file()


@pytest.mark.parametrize(
    ("argv", "env", "code", "message"),
    [
        pytest.param(["workers", "inspect", "--url", "{dead_url}", "--run", "cli"], {}, 1,
                     "error: BusConnectError: could not connect to NATS at nats://127.0.0.1:", id="inspect a dead URL"),
        pytest.param(["workers", "inspect", "--config", "{config}"], {}, 2,
                     "error: ConfigError: bus.url is 'embedded' and neither", id="inspect a run never started"),
        pytest.param(["workers", "run", "{config}", "--no-live"], {"NATS_SERVER_BIN": "/nonexistent/nats-server"}, 1,
                     "error: EmbeddedServerError: NATS_SERVER_BIN=", id="run without a nats-server binary"),
        pytest.param(["workers", "run", "{config}", "--no-live", "--set", "model.path=Nobody/Absent-0.5B"], {}, 2,
                     "error: ConfigError: model.path 'Nobody/Absent-0.5B' is neither on disk here nor in the "
                     "Hugging Face cache; download it", id="run a model that is not here"),
        pytest.param(["workers.cli", "--role", "reward", "--config", "{config}", "--set", "bus.nope=1"], {}, 2,
                     "error: ConfigError: ", id="a worker with a bad override"),
        pytest.param(["workers.cli", "--role", "reward", "--config", "{config}", "--set", "bus.url={dead_url}"], {}, 1,
                     '"event": "bus unavailable"', id="a worker without a server (its JSON log line)"),
    ],
)  # fmt: skip
def test_a_cli_failure_is_one_line_on_stderr(
    tmp_path: Path, dead_url: str, argv: list[str], env: dict[str, str], code: int, message: str
) -> None:
    """Bus, configuration and server failures of ``areal-async`` (``python -m workers``) and
    ``areal-worker`` (``python -m workers.cli``) end with one line saying what failed and a
    non-zero exit, never a traceback."""
    module, *args = (a.format(config=run_file(tmp_path), dead_url=dead_url) for a in argv)
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert message in last and sum(line.startswith("error:") for line in result.stderr.splitlines()) <= 1
