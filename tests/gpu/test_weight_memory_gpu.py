"""In-memory weight transfer on GPUs: CUDA IPC between two processes on one GPU, NCCL across two."""

from __future__ import annotations

import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from bus.events import WeightsLoad
from workers.weight_memory import WeightReceiver, WeightSender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(1000, 64, generator=g, device=device).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g, device=device).to(
            torch.bfloat16
        ),
        "model.norm.weight": torch.randn(63, generator=g, device=device),  # odd size: a ragged tail
    }


def _cfg(transport: str) -> SimpleNamespace:
    return SimpleNamespace(
        weight_sync=SimpleNamespace(
            transport=transport, bucket_mb=1, transfer_timeout_s=30.0, host="127.0.0.1"
        )
    )


def _engine(device: str, loads: list[WeightsLoad], results: Path) -> None:
    try:
        receiver = WeightReceiver(_cfg(loads[0].transfer.transport), device, "gen-1")  # type: ignore[arg-type]
        lines = []
        for load in loads:
            try:
                got = receiver.receive(load)
            except Exception as exc:
                lines.append(f"v{load.policy_version} refused: {type(exc).__name__}")
                continue
            want = _weights(device, seed=load.policy_version)
            same = all(torch.equal(got[k], want[k]) and got[k].device.type == "cuda" for k in want)
            lines.append(f"v{load.policy_version} equal={same}")
            del got
        (results / "engine").write_text("\n".join(lines))
    except Exception:
        (results / "engine").write_text("error: " + traceback.format_exc())


def test_cuda_ipc_moves_versions_between_processes_checked_and_frees_them(tmp_path: Path) -> None:
    """Three versions mapped by another process arrive bit-exact; one whose bytes changed after the
    digest was announced is refused; once the engine is done and the sender drops the versions,
    the trainer's GPU memory is back where it started (nothing left in CUDA IPC limbo)."""
    torch.cuda.synchronize()
    sender = WeightSender(_cfg("cuda_ipc"), "cuda:0")  # type: ignore[arg-type]
    loads = []
    for v in (1, 2, 3):
        sender.prepare(v, _weights("cuda", seed=v))
        loads.append(WeightsLoad(policy_version=v, path="", transfer=sender.offer(v)))
        if v == 2:  # corrupt version 2 after its offer went out
            sender.prepared[2].buffers[0][5] ^= 1
    torch.cuda.synchronize()
    child = mp.get_context("spawn").Process(target=_engine, args=("cuda:0", loads, tmp_path))
    child.start()
    child.join(120)
    assert (tmp_path / "engine").read_text().splitlines() == [
        "v1 equal=True",
        "v2 refused: TransferError",
        "v3 equal=True",
    ]
    baseline = torch.cuda.memory_allocated()
    sender.prepared.clear()
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < baseline, "the dropped versions were not freed"


def _nccl_engine(loads: list[WeightsLoad], results: Path) -> None:
    torch.cuda.set_device(1)
    _engine("cuda:1", loads, results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_reaches_an_engine_on_another_gpu(tmp_path: Path) -> None:
    sender = WeightSender(_cfg("nccl"), "cuda:0")  # type: ignore[arg-type]
    sender.prepare(1, _weights("cuda", seed=1))
    load = WeightsLoad(policy_version=1, path="", transfer=sender.offer(1), group="g", members=["gen-1"])
    child = mp.get_context("spawn").Process(target=_nccl_engine, args=([load], tmp_path))
    child.start()
    sender._broadcast("g", 2, sender.prepared[1].buffers)
    child.join(120)
    assert (tmp_path / "engine").read_text() == "v1 equal=True"
