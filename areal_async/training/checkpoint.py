"""Checkpoints for lossless resume: model, optimizer, scheduler, RNG, policy version, caller state.

Layout under the run directory `root`:

    checkpoints/
      latest            "step_<N>", replaced atomically after the step directory is committed
      step_<N>/
        engine.pt       the engine's replicated state (schedule, optimizer hyperparameters, policy
                        version), beside
        engine/         its sharded weights and optimizer state (torch.distributed.checkpoint: every
                        rank writes its own shards; both backends). An engine without
                        `save_sharded` stores everything, unsharded, in engine.pt.
        rng.pt          python / numpy / torch (and CUDA) RNG state of every rank
        extra.json      the caller's `extra` (dataset position, ids of trained tasks, ...)
        meta.json       step, policy_version, world_size, saved_at

Commit protocol: rank 0 writes everything (every rank its shards of `engine/`) into
`checkpoints/.tmp-step_<N>/`, fsyncs it,
renames it to `step_<N>/` (one atomic rename), then rewrites `latest`. A crash before the
rename leaves the previous checkpoint as latest (the orphaned temp directory is removed by
the next save); a crash between the rename and the pointer leaves the previous checkpoint
as latest too, and the newer directory is merely unused. Only the last `keep` step
directories are kept, never the one `latest` names.

`save_checkpoint` and `load_checkpoint` are collective (every rank of the trainer calls
them); `find_latest` is a plain file lookup and this module imports torch only inside
the functions that need it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from areal_async.files import fsync_tree, replace_dir, write_text_atomic

if TYPE_CHECKING:
    from areal_async.training.base import TrainEngine

log = structlog.get_logger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step number of a `step_<N>` checkpoint directory."""
    match = _STEP_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step_12)")
    return int(match.group(1))


def _step_dirs(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(dirs, key=checkpoint_step)


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The committed checkpoint `latest` names, else the highest `step_<N>`, else None."""
    ckpt_dir = Path(root) / CHECKPOINT_DIR
    pointer = ckpt_dir / LATEST_FILE
    if pointer.is_file():
        target = ckpt_dir / pointer.read_text().strip()
        if _STEP_RE.match(target.name) and target.is_dir():
            return target
        log.warning("latest pointer names no checkpoint, scanning", pointer=str(pointer), target=str(target))
    dirs = _step_dirs(ckpt_dir)
    return dirs[-1] if dirs else None


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    engine: TrainEngine,
    extra: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Commit a checkpoint of `engine`, every rank's RNG and `extra` (JSON) as `step_<step>`. Collective.

    Returns the committed directory. Keeps the newest `keep` checkpoints.
    """
    import torch
    import torch.distributed as dist

    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    start = time.perf_counter()
    rank, world_size = _rank_world()
    extra_json = json.dumps(extra)  # fail early, on every rank, if extra is not JSON
    ckpt_dir = Path(root) / CHECKPOINT_DIR
    final = ckpt_dir / f"step_{step}"
    tmp = ckpt_dir / f".tmp-step_{step}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if hasattr(engine, "save_sharded"):
        _barrier()  # the directory exists before any rank writes its shards
        state = engine.save_sharded(tmp / "engine")
    else:
        state = engine.state_dict()
    rng_states: list[Any] = [_rng_state()]
    if world_size > 1:
        rng_states = [None] * world_size
        dist.all_gather_object(rng_states, _rng_state())
    if rank == 0:
        torch.save(state, tmp / "engine.pt")
        torch.save(rng_states, tmp / "rng.pt")
        (tmp / "extra.json").write_text(extra_json)
        meta = {
            "step": step,
            "policy_version": engine.version,
            "world_size": world_size,
            "saved_at": time.time(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        fsync_tree(tmp)
        replace_dir(tmp, final)
        write_text_atomic(ckpt_dir / LATEST_FILE, final.name + "\n")
        for old in _step_dirs(ckpt_dir)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        log.info(
            "checkpoint saved",
            path=str(final),
            step=step,
            policy_version=engine.version,
            seconds=round(time.perf_counter() - start, 3),
        )
    del state
    _barrier()
    return final


def load_checkpoint(
    root: str | os.PathLike[str], *, engine: TrainEngine, path: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Restore engine state, RNG and policy version from `path` (default: `find_latest(root)`); return `extra`.

    Collective. A rank whose index the checkpoint lacks (world size changed) takes rank 0's RNG.
    """
    import torch

    start = time.perf_counter()
    ckpt = Path(path) if path is not None else find_latest(root)
    if ckpt is None:
        raise FileNotFoundError(
            f"no checkpoint under {Path(root) / CHECKPOINT_DIR}; start fresh or fix the run dir"
        )
    rank, _ = _rank_world()
    state = torch.load(ckpt / "engine.pt", map_location="cpu", mmap=True, weights_only=True)
    if hasattr(engine, "load_sharded"):
        engine.load_sharded(ckpt / "engine", state)
    else:
        engine.load_state_dict(state)
    del state
    rng_states = torch.load(ckpt / "rng.pt", weights_only=False)
    _set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
    extra = json.loads((ckpt / "extra.json").read_text())
    _barrier()
    log.info(
        "checkpoint loaded",
        path=str(ckpt),
        policy_version=engine.version,
        seconds=round(time.perf_counter() - start, 3),
    )
    return extra
