"""Sharded checkpoints of the Megatron backend: every rank writes its own slices, any layout reads them.

`save(engine, path)` writes the engine's weights and AdamW moments with
`torch.distributed.checkpoint` (DCP) into the directory `path`: each tensor-parallel slice as a
`DTensor` sharded over the rank's tensor-parallel group, under the whole model's megatron-core
name, so no rank ever holds a full tensor and a checkpoint's size per rank falls with the model
parallelism. The two halves of a gated MLP weight (`linear_fc1`: gate and up, each split over the
ranks) are stored as two tensors, `<name>.gate` and `<name>.up`, because their slices are not one
contiguous block. Replicated tensors (norms, and every tensor at tensor_parallel 1) are plain
tensors; the copies on data-parallel ranks and the tied embedding's copy on the last pipeline stage
are written once (DCP keeps one of identical items). Keys: `model.<name>` and
`optimizer.<name>.exp_avg` / `.exp_avg_sq` (only for parameters that have stepped). It returns the
small replicated state (backend, AdamW's step count and hyperparameters, the lr schedule, the
policy version) for the caller to store beside it.

`load(engine, path, state)` reads those tensors into an engine of any tensor-parallel, pipeline or
data-parallel size (DCP reads each rank's slices of the stored ones) and restores the optimizer,
schedule and version. Both are collective over the trainer's ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from areal_async.training.megatron import layout as megatron_layout
from areal_async.training.megatron.pipeline import StageNames


class ShardedState(Protocol):
    """What a checkpoint reads and restores of an engine (`MegatronTrainEngine` satisfies it)."""

    named: dict[str, nn.Parameter]
    """This rank's parameters by megatron-core name (the stage's own names)."""
    names: StageNames
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    version: int
    tp_size: int
    tp_group: Any
    device: torch.device


MOMENTS = ("exp_avg", "exp_avg_sq")


def _pieces(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, int | None]]:
    """(suffix, part, split dim) of this rank's `tensor` of the megatron-named `name`."""
    if megatron_layout.tp_gated(name):
        gate, up = tensor.chunk(2)
        return [(".gate", gate, 0), (".up", up, 0)]
    return [("", tensor, megatron_layout.tp_dim(name))]


class _Layout:
    """This rank's view of the checkpoint: which keys it writes or reads, and how they are sharded."""

    def __init__(self, engine: ShardedState) -> None:
        self.engine = engine
        self.mesh = None
        if engine.tp_size > 1:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(engine.tp_group, engine.device.type)
        self.whole = {n: engine.names.whole(n) for n in engine.named}

    def entries(self, prefix: str, tensors: dict[str, torch.Tensor], suffix: str = "") -> dict[str, Any]:
        """DCP entries for per-parameter `tensors` (this stage's names): DTensors for split slices."""
        from torch.distributed.tensor import DTensor, Shard

        out: dict[str, Any] = {}
        for name, tensor in tensors.items():
            whole = self.whole[name]
            for part, piece, dim in _pieces(whole, tensor.detach()):
                key = f"{prefix}{whole}{part}{suffix}"
                if dim is None or self.mesh is None:
                    out[key] = piece.contiguous()
                else:
                    out[key] = DTensor.from_local(
                        piece.contiguous(), self.mesh, [Shard(dim)], run_check=False
                    )
        return out

    def unpack(self, prefix: str, entries: dict[str, Any], suffix: str = "") -> dict[str, torch.Tensor]:
        """This rank's local tensors from `entries` (as `entries()` made them, filled by a load)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name in self.engine.named:
            whole = self.whole[name]
            parts = []
            for part, _, _ in _pieces(whole, self.engine.named[name]):
                value = entries.get(f"{prefix}{whole}{part}{suffix}")
                if value is None:
                    break
                parts.append(value.to_local() if isinstance(value, DTensor) else value)
            else:
                out[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out


def save(engine: ShardedState, path: Path) -> dict[str, Any]:
    """Write the sharded weights and moments under `path`; return the replicated state. Collective."""
    layout = _Layout(engine)
    state = engine.optimizer.state
    entries = layout.entries("model.", engine.named)
    for key in MOMENTS:
        stepped = {n: state[p][key] for n, p in engine.named.items() if p in state}
        entries |= layout.entries("optimizer.", stepped, f".{key}")
    dcp.save(entries, checkpoint_id=str(path))
    steps = [s["step"] for s in state.values() if "step" in s]  # one count: every parameter steps
    groups = [
        {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.state_dict()["param_groups"]
    ]
    return {
        "backend": "megatron",
        "format": "sharded",
        "optimizer": {"step": steps[0].cpu() if steps else None, "param_groups": groups},
        "scheduler": engine.scheduler.state_dict(),
        "version": engine.version,
        "lora": None,
    }


def load(engine: ShardedState, path: Path, state: Mapping[str, Any]) -> None:
    """Restore what `save` wrote (at any parallel layout) and its replicated `state`. Collective."""
    if state.get("backend") != "megatron":
        raise ValueError(
            f"the checkpoint was written by trainer.backend={state.get('backend', 'fsdp2')}, this run uses "
            "megatron; resume with the checkpoint's backend, or start a new run"
        )
    if state.get("format") != "sharded" or not path.is_dir():
        raise ValueError(
            f"{path.parent} is not a sharded Megatron checkpoint (no {path.name}/ directory of slices): it was "
            "written by an earlier areal-async with full tensors; resume it with that version, or start a new run"
        )
    layout = _Layout(engine)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    targets = layout.entries("model.", {n: torch.empty_like(p) for n, p in engine.named.items()})
    for key in MOMENTS:
        zeros = {n: torch.zeros_like(p) for n, p in engine.named.items()}
        moments = layout.entries("optimizer.", zeros, f".{key}")
        targets |= {k: v for k, v in moments.items() if k in stored}  # parameters that had stepped
    dcp.load(targets, checkpoint_id=str(path))
    weights = layout.unpack("model.", targets)
    with torch.no_grad():
        for name, param in engine.named.items():
            param.copy_(weights[name])
    moments = {key: layout.unpack("optimizer.", targets, f".{key}") for key in MOMENTS}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    step = state["optimizer"]["step"]
    for i, name in enumerate(engine.named):
        if name in moments["exp_avg"] and step is not None:
            opt_state[i] = {"step": step.clone(), **{k: moments[k][name] for k in MOMENTS}}
    groups = [dict(g, params=list(range(len(engine.params)))) for g in state["optimizer"]["param_groups"]]
    engine.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.version = int(state["version"])
