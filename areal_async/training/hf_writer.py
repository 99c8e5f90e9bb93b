"""Writing a trainer's weights as a Hugging Face directory, shared by both backends.

`HFWriter` gives a backend `save_hf` (gather with `snapshot_hf`, write on rank 0, manifest on every
rank), `write_hf` (a full HF directory: config in the weights' dtype, model.safetensors and the
tokenizer files of `model_path`; or with `lora` a PEFT adapter directory) and `save_merged_hf` (a
full HF directory also under `lora`, the adapters merged in), all atomic. The backend provides
`snapshot_hf`, `merged_hf` and the attributes below.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from areal_async import lora as lora_lib
from areal_async.lora import LoraConfig
from areal_async.weights_file import write_weights_dir

log = structlog.get_logger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class HFWriter:
    """`save_hf` and `write_hf` of both trainer backends; the backend provides `snapshot_hf`."""

    config: Any
    model_path: Path
    distributed: bool
    lora: LoraConfig | None

    def snapshot_hf(
        self, *, dtype: torch.dtype | None = None, on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError

    def merged_hf(self, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError

    def save_hf(
        self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
    ) -> list[dict[str, Any]]:
        """Write a Hugging Face checkpoint to `path` atomically; return its manifest on every rank.

        Weights are float32 (the master weights) unless `dtype` is given. Collective: all
        ranks gather the full state dict, rank 0 writes `path.tmp` and renames it to `path`.
        Equivalent to `snapshot_hf` followed by `write_hf` on rank 0.
        """
        tensors = self.snapshot_hf(dtype=dtype)
        return self._from_rank_0(self.write_hf(path, tensors) if tensors is not None else [])

    def save_merged_hf(
        self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
    ) -> list[dict[str, Any]]:
        """Write a full HF model directory to `path` atomically, with any LoRA adapters merged into
        the base weights (a model `model.path` loads as is); its manifest on every rank. Collective."""
        tensors = self.merged_hf(dtype=dtype)
        return self._from_rank_0(self._write_model_dir(Path(path), tensors) if tensors is not None else [])

    def _from_rank_0(self, manifest: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rank 0's manifest on every rank (collective when distributed)."""
        if not self.distributed:
            return manifest
        box: list[Any] = [manifest]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def write_hf(
        self, path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]
    ) -> list[dict[str, Any]]:
        """Write `tensors` (from `snapshot_hf`) as an HF directory at `path`, atomically, or with
        `lora` as an adapter directory. Rank 0 only.

        Returns the manifest `[{name, shape, dtype, sha256}]`. No collectives, no shared state:
        safe in a background thread.
        """
        if self.lora is None:
            return self._write_model_dir(Path(path), tensors)
        start = time.perf_counter()
        manifest = lora_lib.write_adapter_dir(path, tensors, self.lora, base_model=str(self.model_path))
        log.info(
            "adapter saved",
            path=str(path),
            tensors=len(manifest),
            seconds=round(time.perf_counter() - start, 3),
        )
        return manifest

    def _write_model_dir(self, path: Path, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """A full HF directory: config in the weights' dtype, model.safetensors, the tokenizer files."""
        start = time.perf_counter()

        def add_files(tmp: Path) -> None:
            config = copy.deepcopy(self.config)
            config.dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
            config.save_pretrained(tmp)
            for name in TOKENIZER_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy2(self.model_path / name, tmp / name)

        manifest = write_weights_dir(path, tensors, add_files)
        log.info(
            "weights saved",
            path=str(path),
            tensors=len(manifest),
            seconds=round(time.perf_counter() - start, 3),
        )
        return manifest
