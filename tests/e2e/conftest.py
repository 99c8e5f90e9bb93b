"""Fixtures of the end-to-end tests: tiny models on disk, built once per session.

Under pytest-xdist the warm starts are built once for all workers (``_built_once``): the first
worker to need one builds it while the others wait on its lock, then read the same directory.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.models import build_tiny_model


@contextmanager
def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """``name`` under the session's temporary root, shared by every xdist worker, held under an
    exclusive lock while the caller builds into it (or finds it built)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp sits in the session's
        root = root.parent
    shared = root / name
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield shared


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init char-level Llama (fast; for plumbing tests that do not need learning)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, heads=4)


@pytest.fixture(scope="session")
def tiny_sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model warm-started on mode_select (two answer modes; greedy accuracy near 50%)."""
    import torch

    from tests.e2e.tiny_task import warm_start_mode_select

    torch.set_num_threads(2)
    with _built_once(tmp_path_factory, "tiny-sft") as shared:
        return warm_start_mode_select(shared / "model")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, tiny_sft_model: Path) -> Path:
    """`tiny_sft_model` warm-started further on mode_select in the chat format that agent workflows render."""
    import torch

    from tests.e2e.tiny_task import warm_start_mode_select

    torch.set_num_threads(2)
    # From the raw-format fit, 300 steps of 64 chat prompts (~4x longer) reach the two-mode fit (loss
    # ~0.35, greedy first-try accuracy ~40%) in a third of the 900 steps it takes from random init.
    with _built_once(tmp_path_factory, "tiny-chat") as shared:
        return warm_start_mode_select(
            shared / "model", chat=True, steps=300, batch_size=64, init=tiny_sft_model
        )
