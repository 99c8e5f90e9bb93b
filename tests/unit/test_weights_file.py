"""The one-pass safetensors writer: any safetensors reader gets the tensors back bit for bit."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from areal_async.weights_file import tensor_sha256, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.arange(-4, 7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        # a transposed view: written in row-major order of the view, like save_file does
        "view": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def test_round_trip_through_safetensors_readers(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    manifest = write_safetensors(path, tensors, metadata={"format": "pt"})

    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}

    assert [m["name"] for m in manifest] == list(tensors)
    for entry in manifest:
        tensor = tensors[entry["name"]]
        assert entry["shape"] == list(tensor.shape)
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert entry["sha256"] == tensor_sha256(loaded[entry["name"]])


def test_header_is_aligned_and_data_is_contiguous(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, _tensors())
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] == len(raw) - 8 - length


def test_sha256_changes_with_one_bit(tmp_path):
    tensors = {"w": torch.zeros(64)}
    before = write_safetensors(tmp_path / "a.safetensors", tensors)[0]["sha256"]
    tensors["w"][13] = 1e-30
    after = write_safetensors(tmp_path / "b.safetensors", tensors)[0]["sha256"]
    assert before != after


def test_unsupported_dtype_names_tensor_and_fix(tmp_path):
    with pytest.raises(ValueError, match=r"'z'.*complex64.*cast it"):
        write_safetensors(tmp_path / "c.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
