"""Benchmark moving one policy version from the trainer to an engine, per transport.

Random bf16 weights of a Qwen2 shape (``--shapes``: 0.5B, 1.5B; random values move exactly as
trained ones do) go from a trainer process to an engine process that holds preallocated
parameters of the same shapes on its GPU, as the local engine does. Per version, measured from
the moment the trainer has its snapshot to the moment the engine's parameters hold the new
values (the ``weights.published`` -> ``weights.loaded`` path, without the bus's ~1 ms):

- ``disk`` / ``tmpfs``: the trainer writes the version (``write_weights_dir``: safetensors + manifest, fsynced, renamed)
  under ``--disk-dir`` or ``/dev/shm``; the engine reads it and copies it into its parameters.
- ``cuda_ipc``: the trainer packs the version into one buffer on its GPU, digests and exports it
  (``WeightSender.prepare``); the engine maps it, checks the digest and copies
  (``WeightReceiver.receive`` + copy). Also reported: ``prepare_s``, the part on the trainer's
  step path.

    python -m benchmarks.bench_weights                 # CUDA: 0.5B and 1.5B, three versions each
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks import harness

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (tied embeddings)
    "0.5B": (896, 4864, 24, 14, 2, 151936),
    "1.5B": (1536, 8960, 28, 12, 2, 151936),
}
METRICS: dict[str, harness.Direction] = {"published_to_loaded_s": "lower", "prepare_s": "lower"}


def qwen2_weights(shape: str, device: str) -> dict[str, torch.Tensor]:
    """bf16 tensors of the Qwen2 ``shape``, HF names, random values."""
    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    d = h // heads
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": rand(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.q_proj.bias": rand(heads * d),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.k_proj.bias": rand(kv * d),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.bias": rand(kv * d),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    return out


def _engine(shape: str, inbox: Any, outbox: Any) -> None:
    """The engine process: parameters on its GPU; loads what each message names, reports when done."""
    from areal_async.weights_file import read_safetensors_dir
    from workers.weight_transfer import WeightReceiver

    params = {k: torch.empty_like(v) for k, v in qwen2_weights(shape, "cuda").items()}
    torch.cuda.synchronize()
    cfg = SimpleNamespace(weight_sync=SimpleNamespace(transfer_timeout_s=60.0))
    receiver = WeightReceiver(cfg, "cuda:0", "engine")  # type: ignore[arg-type]
    outbox.put("ready")
    while (msg := inbox.get()) is not None:
        kind, payload = msg
        state = receiver.receive(payload) if kind == "cuda_ipc" else read_safetensors_dir(Path(payload))
        for name, tensor in state.items():
            params[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        del state
        outbox.put(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--transports", nargs="+", default=["disk", "tmpfs", "cuda_ipc"])
    parser.add_argument("--versions", type=int, default=3, help="versions per case (median reported)")
    parser.add_argument("--disk-dir", default=None, help="directory on a real disk (default: a temp dir)")
    harness.add_output_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_weights needs CUDA (the engine's parameters live on a GPU)")
    from areal_async.weights_file import write_weights_dir
    from bus.events import WeightsLoad
    from workers.weight_transfer import WeightSender

    ctx = mp.get_context("spawn")
    rows = []
    for shape in args.shapes:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=_engine, args=(shape, inbox, outbox))
        engine.start()
        assert outbox.get(timeout=300) == "ready"
        for transport in args.transports:
            totals, prepares, nbytes = [], [], 0
            root = Path(tempfile.mkdtemp(dir="/dev/shm" if transport == "tmpfs" else args.disk_dir or None))
            cfg = SimpleNamespace(
                weight_sync=SimpleNamespace(
                    transport=transport, bucket_mb=512, transfer_timeout_s=60.0, host="127.0.0.1"
                )
            )
            sender = WeightSender(cfg, "cuda:0") if transport == "cuda_ipc" else None  # type: ignore[arg-type]
            for v in range(args.versions):
                snapshot = qwen2_weights(shape, "cuda")
                nbytes = sum(t.numel() * t.element_size() for t in snapshot.values())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if sender is not None:
                    sender.prepare(v, snapshot)
                    torch.cuda.synchronize()
                    prepares.append(time.perf_counter() - t0)
                    inbox.put(("cuda_ipc", WeightsLoad(policy_version=v, path="", transfer=sender.offer(v))))
                else:
                    path = root / f"v{v}"
                    write_weights_dir(path, snapshot)  # what the trainer's writer does
                    prepares.append(0.0)
                    inbox.put((transport, str(path)))
                done = outbox.get(timeout=300)
                totals.append(done - t0)
                del snapshot
            shutil.rmtree(root, ignore_errors=True)
            row = {
                "case": f"{shape} {transport}",
                "shape": shape,
                "transport": transport,
                "gb": round(nbytes / 1e9, 3),
                "published_to_loaded_s": round(statistics.median(totals), 4),
                "prepare_s": round(statistics.median(prepares), 4),
                "all_s": [round(t, 4) for t in totals],
            }
            rows.append(row)
            print(row, flush=True)
        inbox.put(None)
        engine.join(60)
    harness.print_table(rows, ["case", "gb", "published_to_loaded_s", "prepare_s"])
    result = harness.make_result(
        "weights",
        args,
        rows,
        METRICS,
        device="cuda",
        note="Random bf16 weights of the Qwen2 shapes; one trainer and one engine process on one GPU. "
        "disk/tmpfs include the fsynced write; cuda_ipc includes pack, digest, export, map, digest, copy.",
    )
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
