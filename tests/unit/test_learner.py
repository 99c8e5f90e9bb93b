"""The learner: its engines are built from the run file's trainer section; weight snapshots are
written whole, then freed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_async.config import OptimizerConfig
from areal_async.run_file import load_config
from areal_async.training.fsdp.engine import FSDPTrainEngine
from areal_async.training.learner import Learner
from tests.helpers.fsdp_helpers import write_tiny_llama


def test_write_weights_writes_the_snapshot_then_empties_it(tmp_path: Path) -> None:
    """The file holds the snapshot's values, and the snapshot dict is empty afterwards, so its copies
    (as large as the model) are freed even while the caller still holds the dict."""
    model = write_tiny_llama(tmp_path / "model", vocab=64)
    cfg = load_config(None, [f"dir={tmp_path / 'run'}", "trainer.dtype=float32"])
    learner = Learner(cfg, str(model))
    tensors = learner.snapshot_weights()
    expected = {name: t.clone() for name, t in tensors.items()}
    manifest = learner.write_weights(tmp_path / "v0", tensors)
    assert tensors == {}
    written = load_file(tmp_path / "v0" / "model.safetensors")
    assert [m["name"] for m in manifest] == list(expected)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], t) for name, t in expected.items())


def test_every_engine_trains_with_the_run_file_s_optimizer(tmp_path: Path) -> None:
    """The learner's engine takes AdamW and its schedule from trainer.optimizer, and an engine built
    without a trainer section gets a run file's defaults, not defaults of its own. The reference
    model (kl_coef > 0) is built from the same section."""
    model = write_tiny_llama(tmp_path / "model", vocab=64)
    cfg = load_config(
        None,
        [
            f"dir={tmp_path / 'run'}",
            "trainer.dtype=float32",
            "trainer.optimizer.betas=[0.8, 0.95]",
            "trainer.optimizer.eps=0.000001",
            "trainer.optimizer.weight_decay=0.01",
            "trainer.optimizer.lr_schedule=cosine",
            "trainer.optimizer.min_lr_ratio=0.2",
            "trainer.loss.kl_coef=0.1",
        ],
    )
    learner = Learner(cfg, str(model))
    adamw = learner.engine.optimizer.defaults
    assert (adamw["betas"], adamw["eps"], adamw["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.01)
    floor = learner.engine.scheduler.lr_lambdas[0](cfg.trainer.total_steps)  # type: ignore[attr-defined]
    assert floor == pytest.approx(0.2)
    assert learner.ref is not None and learner.ref.lora is None

    defaults = OptimizerConfig()
    adamw = FSDPTrainEngine(model).optimizer.defaults
    assert (adamw["lr"], adamw["betas"], adamw["eps"]) == (defaults.lr, tuple(defaults.betas), defaults.eps)
