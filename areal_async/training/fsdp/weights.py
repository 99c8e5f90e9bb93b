"""Weights out of the FSDP2 training engine, its checkpoints, and LoRA versions.

`FSDPWeights` holds the methods of `FSDPTrainEngine` (training/fsdp/engine.py) that move whole weights in
and out; the engine sets up the state they use (`model`, `optimizer`, `scheduler`, `config`,
`model_path`, `rank`, `distributed`, `version`, `lora`).

Weights out. `save_hf(dir)` writes a Hugging Face directory (config.json,
model.safetensors, tokenizer files of `model_path`) atomically and returns the manifest
`[{name, shape, dtype, sha256}]` (sha256 of each tensor's raw little-endian bytes, as
stored in the file) on every rank.

Checkpoints. `save_sharded(dir)` has every rank write its own shards of the model and optimizer
state with torch.distributed.checkpoint (nothing is gathered, so no rank holds the whole model)
and returns the small replicated rest (scheduler, `version`, `lora`); `load_sharded` reads them
back at any world size. `state_dict()` / `load_state_dict()` carry the same as full (unsharded)
state dicts on rank 0; `load_sharded` still reads such checkpoints of earlier versions.

LoRA. With `lora` (areal_async/lora.py) peft adapters wrap the target modules, the rest is
frozen in the training dtype and only the adapters have optimizer state. A version is then the
adapters alone: `snapshot_hf` returns them and `write_hf`/`save_hf` write an adapter directory;
`merged_hf` gives the full weights with the adapters merged in; checkpoints carry only the
adapters of the model (the base is `model_path`) and refuse to load into a different `lora`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from areal_async import lora as lora_lib
from areal_async.training.hf_writer import HFWriter

log = structlog.get_logger(__name__)

_MODEL_PREFIX = "hf."


class FSDPWeights(HFWriter):
    """Whole-weight methods of `FSDPTrainEngine`; every one is collective unless it says otherwise."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rank: int
    version: int

    def snapshot_hf(
        self, *, dtype: torch.dtype | None = None, on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """One version's weights on rank 0 (None on other ranks): HF-named copies of the full
        weights, or with `lora` the adapters alone, named as in an adapter directory. Collective.

        The copies do not alias the live parameters, so `write_hf` may run in another thread
        while the next step trains. They are on the CPU, or with `on_device` on the training
        device (a device-to-device copy, so the step does not wait for a host copy).
        """
        tensors = self._full_state(dtype=dtype, on_device=on_device, adapters_only=self.lora is not None)
        if tensors is None or self.lora is None:
            return tensors
        return lora_lib.adapter_tensors(tensors)

    def merged_hf(self, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """HF-named full weights on rank 0 (None elsewhere) with any adapters merged in. Collective."""
        tensors = self._full_state(dtype=None, on_device=False, adapters_only=False)
        if tensors is not None and self.lora is not None:
            tensors = lora_lib.merged_state(tensors, self.lora.scale)
        if tensors is not None and dtype is not None:
            tensors = {name: t.to(dtype) for name, t in tensors.items()}
        return tensors

    def _full_state(
        self, *, dtype: torch.dtype | None, on_device: bool, adapters_only: bool
    ) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=not on_device, ignore_frozen_params=adapters_only
        )
        state = get_model_state_dict(self.model, options=options)
        if self.rank != 0:
            return None
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        tensors: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            name = key.removeprefix(_MODEL_PREFIX)
            if tied and name == "lm_head.weight":
                continue
            tensor = value.detach().to(dtype) if dtype is not None else value.detach()
            tensors[name] = tensor.contiguous().clone()
        return tensors

    def state_dict(self) -> dict[str, Any]:
        """Full model/optimizer state (CPU), scheduler state and version. Collective.

        Rank 0 gets the full tensors; other ranks get empty model/optimizer dicts. Unsharded,
        tensors may alias live parameters: serialise before the next step.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        trained = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return {
            "model": get_model_state_dict(self.model, options=trained if self.lora else options),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "lora": dataclasses.asdict(self.lora) if self.lora else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output. Collective: every rank passes the full state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._check_resumable(state)
        options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    def save_sharded(self, path: Path) -> dict[str, Any]:
        """Write this rank's shards of the model and optimizer state under `path`
        (torch.distributed.checkpoint, nothing gathered); returns the replicated state (scheduler,
        version, `lora`) for the caller to store. Collective."""
        import torch.distributed.checkpoint as dcp

        model, optimizer = self._sharded_state()
        with _one_process_is_intended():
            dcp.save(
                {"model": model, "optimizer": optimizer},
                checkpoint_id=str(path),
                no_dist=not self.distributed,
            )
        return {
            "backend": "fsdp2",
            "format": "sharded",
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "lora": dataclasses.asdict(self.lora) if self.lora else None,
        }

    def load_sharded(self, path: Path, state: Mapping[str, Any]) -> None:
        """Restore `save_sharded`'s checkpoint at any world size (DCP reads each rank's part of
        the stored shards), or a full `state_dict()` checkpoint of an earlier version. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if state.get("format") != "sharded":
            self.load_state_dict(state)
            return
        self._check_resumable(state)
        model, optimizer = self._sharded_state()
        loaded = {"model": model, "optimizer": optimizer}
        with _one_process_is_intended():
            dcp.load(loaded, checkpoint_id=str(path), no_dist=not self.distributed)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optimizer"],
            options=StateDictOptions(strict=self.lora is None),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    def _sharded_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's model and optimizer state dicts (DTensor shards; with LoRA only the adapters)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=self.lora is not None)
        return get_state_dict(self.model, self.optimizer, options=options)

    def _check_resumable(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint of the other backend or of another `trainer.lora`, by name."""
        if state.get("backend", "fsdp2") != "fsdp2":
            raise ValueError(
                f"the checkpoint was written by trainer.backend={state['backend']}, this run uses fsdp2; "
                "resume with the checkpoint's backend, or start a new run"
            )
        saved = state.get("lora")
        ours = dataclasses.asdict(self.lora) if self.lora else None
        if saved != ours:
            raise ValueError(
                f"the checkpoint was trained with trainer.lora {saved}, this run has {ours}; resume with "
                "the checkpoint's trainer.lora, or start a new run"
            )


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process without a process group (it is so meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
