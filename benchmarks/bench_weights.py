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
- ``lora``: a LoRA run's version: the trainer writes rank-``--lora-rank`` adapters of every linear
  module (an adapter directory, ``areal_async/lora.py``) to ``/dev/shm``. On CUDA the engine reads it
  and merges ``W + scale * B @ A`` from its base weights into its parameters (``read_s`` /
  ``apply_s`` split the engine's part). On the CPU the engine is a real ``LocalEngine`` over a
  random-init model of the shape: ``load_weights`` returns once the version is served (through
  low-rank hooks, ``engines/local/lora_serving.py``), and ``merge_s`` is the time from then until
  the merged weights replace the hooks.

- ``bus``: the version goes through a weights bucket of a local nats-server (``workers/weight_bus.py``)
  on a real training trajectory, not random weights: the random-init model of the shape, trained in
  float32 by AdamW at each of ``--lrs`` (``--versions`` steps on random tokens), every version
  snapshotted in each of ``--dtypes``. Version 0 is an anchor, the following ones deltas. Reported
  per (dtype, lr): bytes stored per version (``anchor_mb``, ``delta_mb``, ``delta_pct`` of the
  version), ``write_s`` (the trainer's encode + digest + put, before ``weights.published``),
  ``published_to_loaded_s`` (the engine's fetch, decode, digest check and copy into its
  parameters), the encoder's and decoder's CPU seconds per delta (``encode_cpu_s``,
  ``decode_cpu_s``) and ``join_s``, a fresh reader's rebuild of the last version from the
  anchor and every delta after it. Writer and reader share one process and take turns.
  ``last_step`` compares the codec's delta of the last step with XOR and the plain difference
  (byte planes, zstd) and with changed indices + values, in % of the version.

  With ``--run-dir DIR`` the trajectory is instead a finished run's saved versions: the longest
  stretch of consecutive ``DIR/weights/v<N>`` directories (a run keeps ``weight_sync.keep_versions``
  of them, 2 by default, so raise it for the run; checkpoints are sharded optimizer state, not
  read), the first an anchor, each next one a delta, in each of ``--dtypes``.

``--device cpu`` runs the engine on one thread (the generation worker's one core in the CPU
configs) for ``disk``, ``tmpfs`` and ``lora``; ``135M`` is the SmolLM2-135M body (Qwen2 biases).

    python -m benchmarks.bench_weights                 # CUDA: 0.5B and 1.5B, three versions each
    python -m benchmarks.bench_weights --device cpu --shapes 135M --transports lora tmpfs --versions 5
    python -m benchmarks.bench_weights --device cpu --shapes 135M --transports bus --versions 3
    python -m benchmarks.bench_weights --device cpu --transports bus --run-dir runs/demo --dtypes bfloat16
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

import anyio.from_thread
import numpy as np
import torch
import torch.multiprocessing as mp

from benchmarks import harness

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (tied embeddings)
    "135M": (576, 1536, 30, 9, 3, 49152),
    "0.5B": (896, 4864, 24, 14, 2, 151936),
    "1.5B": (1536, 8960, 28, 12, 2, 151936),
}
METRICS: dict[str, harness.Direction] = {
    "published_to_loaded_s": "lower",
    "prepare_s": "lower",
    "read_s": "lower",
    "apply_s": "lower",
    "merge_s": "lower",
    "write_s": "lower",
    "anchor_mb": "lower",
    "delta_mb": "lower",
    "delta_pct": "lower",
    "encode_cpu_s": "lower",
    "decode_cpu_s": "lower",
    "join_s": "lower",
}


def qwen2_sizes(shape: str) -> dict[str, tuple[int, ...]]:
    """HF name -> size of every tensor of the Qwen2 ``shape``."""
    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    d = h // heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.q_proj.bias": (heads * d,),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.k_proj.bias": (kv * d,),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.bias": (kv * d,),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return out


def qwen2_weights(shape: str, device: str) -> dict[str, torch.Tensor]:
    """bf16 tensors of the Qwen2 ``shape``, HF names, random values."""
    g = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
        for name, size in qwen2_sizes(shape).items()
    }


def lora_adapters(shape: str, rank: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 adapters (peft names) of every linear module of ``shape``."""
    from areal_async.lora import DEFAULT_TARGETS, PEFT_PREFIX

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, size in qwen2_sizes(shape).items():
        if name.endswith(".weight") and name.split(".")[-2] in DEFAULT_TARGETS:
            rows, cols = size
            module = PEFT_PREFIX + name.removesuffix(".weight")
            for part, part_size in (("A", (rank, cols)), ("B", (rows, rank))):
                t = torch.randn(*part_size, generator=g, device=device, dtype=torch.float32) / rank
                out[f"{module}.lora_{part}.weight"] = t.to(torch.bfloat16)
    return out


def _engine(shape: str, device: str, inbox: Any, outbox: Any) -> None:
    """The engine process: on CUDA preallocated parameters, on the CPU a `LocalEngine` (`_cpu_engine`);
    loads what each message names, reports when done (and how long it read and applied)."""
    from areal_async import lora
    from areal_async.weights_file import read_safetensors_dir
    from workers.weight_memory import WeightReceiver

    if device == "cpu":
        torch.set_num_threads(1)  # the generation worker's one core
        with anyio.from_thread.start_blocking_portal() as portal:
            _cpu_engine(shape, portal, inbox, outbox)
        return
    params = {k: torch.empty_like(v) for k, v in qwen2_weights(shape, device).items()}
    base = {k: v.clone() for k, v in params.items()}  # what adapters apply to
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    cfg = SimpleNamespace(weight_sync=SimpleNamespace(transfer_timeout_s=60.0))
    receiver = WeightReceiver(cfg, "cuda:0", "engine") if device == "cuda" else None  # type: ignore[arg-type]
    outbox.put("ready")
    while (msg := inbox.get()) is not None:
        kind, payload = msg
        t0 = time.perf_counter()
        if kind == "cuda_ipc":
            assert receiver is not None
            state = receiver.receive(payload)
        elif kind == "lora":
            adapter = lora.read_adapter_dir(payload)
            read_s = time.perf_counter() - t0
            state = lora.merge(base, adapter.tensors, adapter.scale)
        else:
            state = read_safetensors_dir(Path(payload))
        for name, tensor in state.items():
            params[name].copy_(tensor, non_blocking=True)
        sync()
        del state
        done = time.perf_counter()
        # Only the adapter path splits cleanly: full weights are read lazily (mmap) during the copy.
        timings = {"read_s": read_s, "apply_s": done - t0 - read_s} if kind == "lora" else {}
        outbox.put((done, timings))


def _cpu_engine(shape: str, portal: Any, inbox: Any, outbox: Any) -> None:
    """The CPU engine process: a `LocalEngine` over a random-init model of `shape` (bf16, one
    thread) loads what each message names; reports when `load_weights` returned and, for adapters,
    how long the merge took after that."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_async.engines.local.engine import LocalEngine

    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=True,
    )  # fmt: skip
    engine = LocalEngine(Qwen2ForCausalLM(config).to(torch.bfloat16), dtype="bfloat16", max_batch_size=1)
    portal.call(engine.start)
    outbox.put("ready")
    while (msg := inbox.get()) is not None:
        kind, payload = msg
        portal.call(engine.load_weights, 0, payload)
        done = time.perf_counter()
        timings = {}
        if kind == "lora":
            engine._lora.wait_landed()
            timings["merge_s"] = time.perf_counter() - done
        outbox.put((done, timings))
    portal.call(engine.aclose)


def training_trajectory(shape: str, lr: float, steps: int, dtypes: list[str]) -> Any:
    """Yields ``{dtype: snapshot}`` for the random-init model of ``shape`` and after each of
    ``steps`` AdamW steps at ``lr`` (next-token loss on random token batches), trained in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, vocab, (2, 64))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            yield {
                d: {k: v.to(getattr(torch, d)).clone() for k, v in model.state_dict().items()} for d in dtypes
            }


def codec_alternatives(new: np.ndarray, base: np.ndarray, word_bytes: int) -> dict[str, float]:
    """One step's delta in the codec's encoding and in the ones it was chosen against, in % of
    the version (zstd level 1 each): XOR and plain difference of the bit patterns in byte planes,
    changed indices + values; and the share of words the step changed."""
    import zstandard

    from areal_async import weight_codec as codec

    unsigned = np.dtype(f"<u{word_bytes}")
    words, base_words = new.view(unsigned), base.view(unsigned)

    def planes(x: np.ndarray) -> bytes:
        return x.view(np.uint8).reshape(-1, word_bytes).T.tobytes()

    def size(data: bytes) -> int:
        return len(zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL).compress(data))

    changed = np.flatnonzero(words != base_words)
    pct = 100 / new.size
    return {
        "changed_words_pct": round(100 * changed.size / words.size, 2),
        "zigzag_planes_pct": round(pct * len(codec.encode_delta(new, base, word_bytes)), 2),
        "xor_planes_pct": round(pct * size(planes(words ^ base_words)), 2),
        "difference_planes_pct": round(pct * size(planes(words - base_words)), 2),
        "indices_values_pct": round(
            pct * (size(changed.astype(np.uint32).tobytes()) + size(words[changed].tobytes())), 2
        ),
    }


def saved_versions(run_dir: Path) -> list[Path]:
    """A run dir's longest stretch of consecutive saved versions (``weights/v<N>``), oldest first.
    A run keeps ``weight_sync.keep_versions`` of them (2 by default): raise it for a run to measure."""
    root = run_dir / "weights"
    found = sorted(
        int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit() and any(p.glob("*.safetensors"))
    )
    best: list[int] = []
    current: list[int] = []
    for v in found:
        current = [*current, v] if current and current[-1] == v - 1 else [v]
        best = max(best, current, key=len)
    if len(best) < 2:
        raise SystemExit(
            f"{root} holds no two consecutive versions (found {found}); run with "
            "--set weight_sync.keep_versions=N (N > the steps) to keep them"
        )
    return [root / f"v{v}" for v in best]


def saved_trajectory(dirs: list[Path], dtypes: list[str]) -> Any:
    """Yields ``{dtype: snapshot}`` for each saved version in ``dirs`` (as the trainer wrote it)."""
    from safetensors.torch import load_file

    for path in dirs:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(file)))
        yield {d: {k: v.to(getattr(torch, d)) for k, v in state.items()} for d in dtypes}


async def _bus_case(
    case: dict[str, Any], trajectory: Any, last: int, args: argparse.Namespace, url: str
) -> list[dict[str, Any]]:
    """One trajectory (``{dtype: snapshot}`` per version, ``last`` + 1 of them) through a weights
    bucket per dtype; the rows of the module docstring, each with ``case``'s fields (its name a
    template of ``{dtype}``)."""
    from areal_async.config import RunConfig, WeightSyncConfig
    from bus import ConnectOptions, connect
    from workers.weight_bus import BusWeightReader, BusWeightWriter, flatten

    sides = {}
    for dtype in args.dtypes:
        run = f"bench{dtype}{len(sides)}{int(time.time())}"
        cfg = RunConfig(name=run, weight_sync=WeightSyncConfig(transport="bus", anchor_every=last + 1))
        writer_bus = await connect(ConnectOptions(url=url, name="trainer"), run)
        reader_bus = await connect(ConnectOptions(url=url, name="generation"), run)
        await writer_bus.provision(weights_bucket=True)
        sides[dtype] = (cfg, BusWeightWriter(cfg, writer_bus), BusWeightReader(cfg, reader_bus), [])
    params: dict[str, dict[str, torch.Tensor]] = {}
    alternatives: dict[str, dict[str, float]] = {}
    for version, snapshots in enumerate(trajectory):
        for dtype, snapshot in snapshots.items():
            cfg, writer, reader, seen = sides[dtype]
            if dtype not in params:  # the engine's parameters
                params[dtype] = {k: torch.empty_like(v) for k, v in snapshot.items()}
            if version == last and writer.held is not None:  # the last step, untimed
                flat, _, word_bytes = flatten(snapshot)
                alternatives[dtype] = codec_alternatives(flat, writer.held.flat, word_bytes)
            cpu, t0 = time.process_time(), time.perf_counter()
            written = await writer.write(version, snapshot)
            encode_cpu, t1 = time.process_time() - cpu, time.perf_counter()
            cpu = time.process_time()
            tensors, digest = await reader.fetch(version)
            for name, tensor in tensors.items():
                params[dtype][name].copy_(tensor)
            decode_cpu, t2 = time.process_time() - cpu, time.perf_counter()
            assert digest == written["digest"], "the engine rebuilt another version"
            seen.append({**written, "write_s": t1 - t0, "loaded_s": t2 - t1, "encode_cpu": encode_cpu,
                         "decode_cpu": decode_cpu})  # fmt: skip
    rows = []
    for dtype, (cfg, writer, _, seen) in sides.items():
        t0 = time.perf_counter()
        _, digest = await BusWeightReader(cfg, writer.bus).fetch(last)
        join_s = time.perf_counter() - t0
        assert digest == seen[-1]["digest"]
        anchor, deltas = seen[0], seen[1:]
        med = {key: statistics.median(d[key] for d in deltas) for key in deltas[0] if key != "digest"}
        rows.append(
            {
                **case,
                "case": case["case"].format(dtype=dtype),
                "transport": "bus",
                "dtype": dtype,
                "gb": round(anchor["bytes"] / 1e9, 3),
                "anchor_mb": round(anchor["anchor_bytes"] / 1e6, 2),
                "delta_mb": round(med["delta_bytes"] / 1e6, 2),
                "delta_pct": round(100 * med["delta_bytes"] / anchor["bytes"], 2),
                "write_s": round(med["write_s"], 4),
                "published_to_loaded_s": round(med["loaded_s"], 4),
                "encode_cpu_s": round(med["encode_cpu"], 4),
                "decode_cpu_s": round(med["decode_cpu"], 4),
                "anchor_write_s": round(anchor["write_s"], 4),
                "anchor_loaded_s": round(anchor["loaded_s"], 4),
                "join_s": round(join_s, 4),
                "all_delta_pct": [round(100 * d["delta_bytes"] / anchor["bytes"], 2) for d in deltas],
                "last_step": alternatives.get(dtype, {}),
            }
        )
        print(rows[-1], flush=True)
        await writer.bus.close()
    return rows


def bus_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``bus`` rows: a local nats-server (8 MiB max_payload, as the embedded one) per call."""
    from bus import EmbeddedServer

    rows = []
    with tempfile.TemporaryDirectory() as store, EmbeddedServer(store, max_payload=8 * 2**20) as server:
        if args.run_dir is not None:
            dirs = saved_versions(Path(args.run_dir))
            versions = f"v{dirs[0].name[1:]}-v{dirs[-1].name[1:]}"
            case = {"case": f"{Path(args.run_dir).name} {versions} bus {{dtype}}", "run_dir": args.run_dir}
            trajectory = saved_trajectory(dirs, args.dtypes)
            return anyio.run(_bus_case, case, trajectory, len(dirs) - 1, args, str(server.url))
        for shape in args.shapes:
            for lr in args.lrs:
                case = {"case": f"{shape} bus {{dtype}} lr={lr:g}", "shape": shape, "lr": lr}
                trajectory = training_trajectory(shape, lr, args.versions, args.dtypes)
                rows += anyio.run(_bus_case, case, trajectory, args.versions, args, str(server.url))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--transports", nargs="+", default=["disk", "tmpfs", "cuda_ipc"])
    parser.add_argument("--versions", type=int, default=3, help="versions per case (median reported)")
    parser.add_argument("--disk-dir", default=None, help="directory on a real disk (default: a temp dir)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="where the engine's parameters live"
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the lora transport's adapters")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-5, 1e-6], help="bus: learning rates")
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float32"], help="bus: dtypes each version is sent in"
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="bus: the saved versions of this run dir (weights/v<N>, consecutive) instead of a random-init trajectory",
    )
    harness.add_output_args(parser)
    args = parser.parse_args()
    engine_transports = set(args.transports) - {"bus"}  # bus runs on the CPU, whatever --device says
    if args.device == "cuda" and not torch.cuda.is_available() and engine_transports:
        raise SystemExit(
            "bench_weights --device cuda needs CUDA; use --device cpu for disk, tmpfs, lora and bus"
        )
    if args.device == "cpu" and "cuda_ipc" in args.transports:
        raise SystemExit("--transports cuda_ipc needs --device cuda; on the CPU choose disk, tmpfs or lora")
    from areal_async import lora
    from areal_async.weights_file import write_weights_dir
    from bus.events import WeightsLoad
    from workers.weight_memory import WeightSender

    ctx = mp.get_context("spawn")
    rows = bus_rows(args) if "bus" in args.transports else []
    for shape in args.shapes if engine_transports else []:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=_engine, args=(shape, args.device, inbox, outbox))
        engine.start()
        assert outbox.get(timeout=300) == "ready"
        for transport in (t for t in args.transports if t != "bus"):
            totals, prepares, parts, nbytes = [], [], [], 0
            shm = transport in ("tmpfs", "lora")
            root = Path(tempfile.mkdtemp(dir="/dev/shm" if shm else args.disk_dir or None))
            cfg = SimpleNamespace(
                weight_sync=SimpleNamespace(
                    transport=transport, bucket_mb=512, transfer_timeout_s=60.0, host="127.0.0.1"
                )
            )
            sender = WeightSender(cfg, "cuda:0") if transport == "cuda_ipc" else None  # type: ignore[arg-type]
            for v in range(args.versions):
                if transport == "lora":
                    snapshot = lora_adapters(shape, args.lora_rank, args.device, seed=v)
                else:
                    snapshot = qwen2_weights(shape, args.device)
                nbytes = sum(t.numel() * t.element_size() for t in snapshot.values())
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if sender is not None:
                    sender.prepare(v, snapshot)
                    torch.cuda.synchronize()
                    prepares.append(time.perf_counter() - t0)
                    inbox.put(("cuda_ipc", WeightsLoad(policy_version=v, path="", transfer=sender.offer(v))))
                else:  # what the trainer's writer does
                    path = root / f"v{v}"
                    if transport == "lora":
                        spec = lora.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
                        lora.write_adapter_dir(path, snapshot, spec)
                    else:
                        write_weights_dir(path, snapshot)
                    prepares.append(0.0)
                    inbox.put((transport, str(path)))
                done, timings = outbox.get(timeout=300)
                totals.append(done - t0)
                parts.append(timings)
                del snapshot
            shutil.rmtree(root, ignore_errors=True)
            row = {
                "case": f"{shape} {transport}",
                "shape": shape,
                "transport": transport,
                "gb": round(nbytes / 1e9, 3),
                "published_to_loaded_s": round(statistics.median(totals), 4),
                "prepare_s": round(statistics.median(prepares), 4),
                **{k: round(statistics.median(p[k] for p in parts), 4) for k in parts[0]},
                "all_s": [round(t, 4) for t in totals],
            }
            if transport == "lora":
                row["lora_rank"] = args.lora_rank
            rows.append(row)
            print(row, flush=True)
        inbox.put(None)
        engine.join(60)
    harness.print_table(
        [r for r in rows if r["transport"] != "bus"],
        ["case", "gb", "published_to_loaded_s", "prepare_s", "read_s", "apply_s", "merge_s"],
    )
    if "bus" in args.transports:
        harness.print_table(
            [r for r in rows if r["transport"] == "bus"],
            ["case", "gb", "anchor_mb", "delta_mb", "delta_pct", "write_s", "published_to_loaded_s",
             "encode_cpu_s", "decode_cpu_s", "join_s"],
        )  # fmt: skip
    result = harness.make_result(
        "weights",
        args,
        rows,
        METRICS,
        device=args.device,
        note="Random bf16 weights of the Qwen2 shapes; one trainer and one engine process "
        + ("on one GPU. " if args.device == "cuda" else "(a LocalEngine on one thread). ")
        + "disk/tmpfs/lora include the fsynced write; cuda_ipc includes pack, digest, export, map, digest, copy; "
        "lora: rank-r adapters of every linear module, merged into the engine's weights before they are "
        "served on CUDA, served through low-rank hooks until the merge lands on the CPU (merge_s). "
        + (
            "bus: versions of an AdamW trajectory (random-init model, random tokens)"
            if args.run_dir is None
            else f"bus: the saved versions of the run dir {args.run_dir}"
        )
        + " through a weights bucket "
        "of a local nats-server, writer and reader in one process taking turns; the engine's part is "
        "fetch + decode + sha256 check + copy into preallocated parameters.",
    )
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
