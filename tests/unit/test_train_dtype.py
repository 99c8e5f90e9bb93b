"""trainer.dtype: ``auto`` picks bfloat16 only where bf16 matmuls are native; a slow bf16 warns."""

from __future__ import annotations

import pytest
import structlog
import torch

from areal_async.config import TrainerConfig
from areal_async.training import setup as train_setup


@pytest.mark.parametrize("fast", [True, False])
def test_auto_is_bfloat16_only_where_bf16_is_native(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(train_setup, "fast_bf16", lambda device: fast)
    assert train_setup.resolve_train_dtype("auto", torch.device("cpu")) == ("bfloat16" if fast else "float32")
    assert train_setup.resolve_train_dtype("float32", torch.device("cpu")) == "float32"


def test_explicit_bfloat16_is_kept_but_warns_where_it_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_setup, "fast_bf16", lambda device: False)
    with structlog.testing.capture_logs() as logs:
        assert train_setup.resolve_train_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "trainer.dtype: auto" in warnings[0]["fix"]
    monkeypatch.setattr(train_setup, "fast_bf16", lambda device: True)
    with structlog.testing.capture_logs() as logs:
        assert train_setup.resolve_train_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert not logs


def test_cpu_bf16_probe_matches_what_torch_reports() -> None:
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert train_setup.fast_bf16(torch.device("cpu")) is bool(native)


def test_unknown_dtype_names_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match="trainer.dtype must be 'auto', 'float32' or 'bfloat16', got 'fp8'"):
        TrainerConfig(dtype="fp8")  # type: ignore[arg-type]
