"""Fixtures of the end-to-end tests: tiny models on disk, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import build_tiny_model


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


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model warm-started on mode_select in the chat format that agent workflows render."""
    import torch

    from tests.e2e.tiny_task import warm_start_mode_select

    torch.set_num_threads(2)
    # Chat prompts are ~4x longer than raw ones; 900 steps of 64 reach the two-mode fit (loss ~0.33,
    # greedy first-try accuracy ~40%) in about 2 CPU-minutes. 300 steps left it near 5%.
    return warm_start_mode_select(
        tmp_path_factory.mktemp("tiny-chat") / "model", chat=True, steps=900, batch_size=64
    )
