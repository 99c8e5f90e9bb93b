"""Safetensors weights on disk: write a file and its manifest in one pass, read a checkpoint directory.

`safetensors.torch.save_file` serialises every tensor into one in-memory buffer before it
writes, so a 538 MB policy costs a full extra copy. The trainer writes a new policy after
every step, in the background, on the cores the next step computes on; here each tensor's
bytes go straight from the tensor to the file and to sha256, and nothing is copied.

The file is standard safetensors: an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` padded with spaces to a multiple
of 8 bytes, then the tensors' bytes back to back in header order. Any safetensors reader
(`safe_open`, `load_file`, vLLM, SGLang) reads it.

`read_safetensors_dir` loads every tensor of a Hugging Face checkpoint directory (one file or
shards) onto the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from areal_async.files import fsync_tree, replace_dir

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is already contiguous on CPU."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes in row-major order (how safetensors stores it)."""
    return hashlib.sha256(_raw(tensor)).hexdigest()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Write `tensors` to the safetensors file `path` (not fsynced) and return the manifest.

    The manifest is `[{name, shape, dtype, sha256}]` in the order the tensors were given,
    sha256 over each tensor's raw little-endian bytes.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
                f"cast it to one of {', '.join(str(d) for d in _DTYPES)}"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    manifest = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, tensor in tensors.items():
            raw = _raw(tensor)
            f.write(raw)
            manifest.append(
                {
                    "name": name,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                }
            )
    return manifest


def write_weights_dir(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    add_files: Callable[[Path], None] | None = None,
    *,
    filename: str = "model.safetensors",
) -> list[dict[str, Any]]:
    """One version's directory, atomically: the tensors in ``filename``, whatever ``add_files(tmp)`` puts
    beside it (config, tokenizer), and ``manifest.json``, written into ``<path>.tmp``, fsynced and
    renamed to ``path``; readers see the whole directory or none. Returns the manifest."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = write_safetensors(tmp / filename, tensors, metadata={"format": "pt"})
    if add_files is not None:
        add_files(tmp)
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    fsync_tree(tmp)
    replace_dir(tmp, path)
    return manifest


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors checkpoint directory (single file or sharded), on CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return load_file(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {path}; expected a Hugging Face checkpoint directory"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state
