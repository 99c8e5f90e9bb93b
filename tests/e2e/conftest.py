"""Fixtures of the end-to-end tests: tiny models on disk, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_async.models import build_tiny_model


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
    return warm_start_mode_select(tmp_path_factory.mktemp("tiny-sft") / "model")
