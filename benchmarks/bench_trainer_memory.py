"""Benchmark the trainer's resident memory on the CPU demo, phase by phase.

Builds the trainer's ``Learner`` as the trainer worker does (``init_trainer_process_group``,
``Learner(cfg, model_path)`` from ``--config``, model path from ``workers.common.resolve_model_path``),
then runs ``--steps`` steps on synthetic groups shaped like the run's batch (``trainer.batch_size``
groups x ``rollout.group_size`` completions, prompts of ``--prompt-len`` +- 2 tokens, completions of
1..``max_new_tokens``), each followed by ``snapshot_weights`` and ``write_weights`` into a temporary
directory, and ``checkpoint`` after the last step. The loop is the worker's without the bus: steps
and snapshots through ``anyio.to_thread``, the write in a background task fed by a one-slot stream,
overlapping the next step (``--serial``: the write finishes before the next step starts).

After each phase it reads VmRSS, the phase's own peak (VmHWM, reset after each phase through
``/proc/self/clear_refs``), RssAnon and RssFile from ``/proc/self/status``; CPU seconds and minor
page faults (``getrusage``); the glibc heap (``mallinfo2``: bytes the arenas took from the system,
free bytes they keep, mmapped blocks; ``malloc_info``: each arena's size); and the bytes of the
tensors it can name (weights, gradients, AdamW states, weight snapshots still alive). Phases inside
a step come from hooks: the model's forward (pi_prox without grad, then the update's), the
optimizer's step pre-hook (after backward and clipping) and post-hook. While a write overlaps a
step, phases share the process's peak. glibc's malloc knobs are environment variables:

  python -m benchmarks.bench_trainer_memory                       # the demo: configs/arith_cpu.yaml
  MALLOC_ARENA_MAX=2 python -m benchmarks.bench_trainer_memory --steps 12 --no-checkpoint
  python -m benchmarks.bench_trainer_memory --set trainer.micro_batch_tokens=1024

Prints a table; ``--out FILE`` writes the result (benchmarks.harness layout, a row per phase),
``--save-baseline`` makes it the baseline of its hardware.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import re
import resource
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio

from benchmarks import harness

GIB = 2**30

METRICS: dict[str, harness.Direction] = {"rss_gib": "lower", "peak_rss_gib": "lower"}
"""What report --check compares (rows: one per phase)."""

MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.fdopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    return libc


def arena_sizes(libc: Any) -> list[float]:
    """GiB each glibc arena holds from the system (``malloc_info``), largest first."""
    with tempfile.TemporaryFile() as f:
        stream = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        f.seek(0)
        text = f.read().decode()
    sizes = re.findall(r'<heap nr="\d+">.*?<system type="current" size="(\d+)"/>', text, re.DOTALL)
    return sorted((int(n) / GIB for n in sizes), reverse=True)


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in bytes."""
    keys = {"VmRSS", "VmHWM", "RssAnon", "RssFile"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Recorder:
    """One row per phase: resident memory at its end, its own peak, the heap, the named tensors."""

    def __init__(self, learner: Any = None) -> None:
        self.libc = _libc()
        self.learner = learner
        self.snapshots: list[tuple[weakref.ref[Any], int]] = []
        """Weight snapshots (a reference to one of their tensors, their bytes) for ``snapshot_gib``."""
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.peak_per_phase = reset_peak()
        """False where /proc refused the reset: ``peak_rss_gib`` is then the peak so far."""
        self.last = time.perf_counter()
        self.last_usage = resource.getrusage(resource.RUSAGE_SELF)

    def track_snapshot(self, tensors: dict[str, Any]) -> None:
        self.snapshots.append((weakref.ref(next(iter(tensors.values()))), tensor_bytes(tensors.values())))

    def mark(self, phase: str) -> None:
        with self.lock:
            now, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            last, self.last_usage = self.last_usage, usage
            status, heap = proc_status(), self.libc.mallinfo2()
            row = {
                "case": phase,
                "thread": threading.current_thread().name.split()[0],
                "seconds": round(now - self.last, 2),
                "cpu_s": usage.ru_utime + usage.ru_stime - last.ru_utime - last.ru_stime,
                "sys_s": usage.ru_stime - last.ru_stime,
                "page_faults": usage.ru_minflt - last.ru_minflt,
                "rss_gib": status["VmRSS"] / GIB,
                "peak_rss_gib": status["VmHWM"] / GIB,
                "anon_gib": status["RssAnon"] / GIB,
                "file_gib": status["RssFile"] / GIB,
                "heap_gib": heap.arena / GIB,
                "heap_used_gib": heap.uordblks / GIB,
                "heap_free_gib": heap.fordblks / GIB,
                "mmap_gib": heap.hblkhd / GIB,
                "arenas_gib": "+".join(f"{a:.2f}" for a in arena_sizes(self.libc) if a >= 0.01),
            }
            if self.learner is not None:
                engine = self.learner.engine
                row["weights_gib"] = tensor_bytes(engine.params) / GIB
                row["grads_gib"] = tensor_bytes(p.grad for p in engine.params) / GIB
                states = engine.optimizer.state.values()
                row["adam_gib"] = tensor_bytes(v for s in states for v in s.values() if v.dim() > 0) / GIB
            self.snapshots = [(ref, size) for ref, size in self.snapshots if ref() is not None]
            row["snapshot_gib"] = sum(size for _, size in self.snapshots) / GIB
            self.rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            self.last = time.perf_counter()
            self.peak_per_phase = reset_peak() and self.peak_per_phase


def synthetic_groups(cfg: Any, vocab: int, prompt_len: int, version: int, seed: int) -> list[Any]:
    """``trainer.batch_size`` groups shaped like the demo's, built as ``workers/trainer.py`` does."""
    from areal_async.training.learner import GroupSample

    rng = random.Random(seed)
    max_new = cfg.rollout.sampling.max_new_tokens
    groups = []
    for g in range(cfg.trainer.batch_size):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len + rng.randint(-2, 2))]
        lengths = [rng.randint(1, max_new) for _ in range(cfg.rollout.group_size)]
        rewards = [float(rng.random() < 0.5) for _ in lengths]
        rewards[0] = 1.0 - rewards[-1]  # never all equal
        groups.append(
            GroupSample(
                task_id=f"train-{seed}-{g}",
                prompt_ids=prompt,
                completions=[[rng.randrange(vocab) for _ in range(n)] for n in lengths],
                behave_logprobs=[[-5 * rng.random() for _ in range(n)] for n in lengths],
                rewards=rewards,
                finish_reasons=["length" if n == max_new else "stop" for n in lengths],
                head_version=version,
            )
        )
    return groups


def add_phase_hooks(learner: Any, rec: Recorder, step: list[int]) -> None:
    """Mark the pi_prox forward, the update's forward, backward (+ clipping) and the optimizer step.

    With several micro-batches the forwards after the first are ``forward mb<k>`` (each phase then
    holds the backward of the micro-batch before it)."""
    import torch

    engine = learner.engine
    seen: dict[str, int] = {}

    def forward_done(_module: Any, _args: Any, _out: Any) -> None:
        phase = f"step {step[0]} {'forward' if torch.is_grad_enabled() else 'pi_prox'}"
        seen[phase] = seen.get(phase, 0) + 1
        rec.mark(phase if seen[phase] == 1 else f"{phase} mb{seen[phase]}")

    engine.model.register_forward_hook(forward_done)
    engine.optimizer.register_step_pre_hook(lambda *_: rec.mark(f"step {step[0]} backward"))
    engine.optimizer.register_step_post_hook(lambda *_: rec.mark(f"step {step[0]} optimizer"))


async def run(args: argparse.Namespace) -> Recorder:
    """The worker's loop without the bus: ``workers/trainer.py`` ``serve``, ``Trainer.step`` and
    ``Trainer.write_weights`` (the same threads, the same one-slot stream to the writer)."""
    rec = Recorder()
    from areal_async.run_file import load_config
    from areal_async.training.learner import Learner, init_trainer_process_group
    from workers.common import resolve_model_path

    rec.mark("imports")
    cfg = load_config(args.config, args.set)
    init_trainer_process_group(cfg.trainer.device)
    model_path = resolve_model_path(cfg.model.path)
    rec.mark("resolve model")
    learner = await anyio.to_thread.run_sync(Learner, cfg, model_path)
    rec.learner = learner
    rec.mark("load")
    vocab = int(learner.engine.config.vocab_size)
    step = [0]
    add_phase_hooks(learner, rec, step)
    out_dir = Path(tempfile.mkdtemp(prefix="trainer-memory-"))
    weights_out, weights_in = anyio.create_memory_object_stream[tuple[int, Any]](1)

    async def write_weights() -> None:
        async for version, tensors in weights_in:
            await anyio.to_thread.run_sync(learner.write_weights, out_dir / f"v{version}", tensors)
            rec.mark(f"write v{version}")
            written.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write_weights)
            for s in range(1, args.steps + 1):
                step[0] = s
                written = anyio.Event()
                groups = synthetic_groups(cfg, vocab, args.prompt_len, learner.version, seed=s)
                metrics = await anyio.to_thread.run_sync(learner.step, groups)
                rec.mark(f"step {s} end")
                print(f"step {s}: loss {metrics['loss']:.6f}, compute {metrics['compute_seconds']:.1f} s")
                tensors = await anyio.to_thread.run_sync(learner.snapshot_weights)
                rec.track_snapshot(tensors)
                rec.mark(f"snapshot v{learner.version}")
                await weights_out.send((learner.version, tensors))
                del tensors
                if args.serial:
                    await written.wait()
            weights_out.close()
        if args.checkpoint:
            await anyio.to_thread.run_sync(learner.checkpoint, out_dir, {"trained_task_ids": []}, 1)
            rec.mark("checkpoint")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return rec


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        "case",
        "thread",
        "seconds",
        "cpu_s",
        "sys_s",
        "page_faults",
        "rss_gib",
        "peak_rss_gib",
        "anon_gib",
        "file_gib",
        "heap_gib",
        "heap_free_gib",
    ]
    cols += ["arenas_gib", "mmap_gib", "weights_gib", "grads_gib", "adam_gib", "snapshot_gib"]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/arith_cpu.yaml", help="run file (the demo's by default)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=40, help="mean prompt tokens (+-2 per group)")
    parser.add_argument("--serial", action="store_true", help="finish each write before the next step")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a key of the run file"
    )
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    harness.add_output_args(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    rec = anyio.run(run, args)
    rows = rec.rows
    print_table(rows)
    print(f"total {time.perf_counter() - started:.0f} s")
    params = {**vars(args), "malloc_env": {k: os.environ[k] for k in MALLOC_ENV if k in os.environ}}
    doc = harness.make_result(
        "trainer_memory",
        params,
        rows,
        METRICS,
        note="GiB; peak_rss_gib is "
        + ("the phase's own peak" if rec.peak_per_phase else "the peak so far (VmHWM could not be reset)"),
    )
    harness.emit(doc, args.out, args.save_baseline)


if __name__ == "__main__":
    main()
