"""The learner's weight snapshots: written whole, then freed."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from areal_async.run_file import load_config
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
