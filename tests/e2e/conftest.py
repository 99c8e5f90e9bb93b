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
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, tiny_sft_model: Path) -> Path:
    """`tiny_sft_model` warm-started further on mode_select in the chat format that agent workflows render."""
    import torch

    from tests.e2e.tiny_task import warm_start_mode_select

    torch.set_num_threads(2)
    # From the raw-format fit, 300 steps of 64 chat prompts (~4x longer) reach the two-mode fit (loss
    # ~0.35, greedy first-try accuracy ~40%) in a third of the 900 steps it takes from random init.
    return warm_start_mode_select(
        tmp_path_factory.mktemp("tiny-chat") / "model",
        chat=True,
        steps=300,
        batch_size=64,
        init=tiny_sft_model,
    )
