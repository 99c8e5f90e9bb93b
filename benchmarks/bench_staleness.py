"""Decoupled vs naive PPO across staleness bounds, and interruptible generation on and off, with seeds.

Two grids of runs of one job (default ``configs/arith_cpu.yaml``: SmolLM2-135M learns 2-digit
addition), each cell one ``areal-async run`` started by ``bench_async.run_one`` (generation and the
trainer pinned to separate cores):

- ``staleness``: ``rollout.max_staleness`` in 0,1,2,4,8 x the loss: ``decoupled`` (ppo_decoupled) or
  ``naive`` (``trainer.loss.decoupled=false``: the PPO ratio against the behaviour logprobs), running
  requests keeping their KV across weight loads (``rollout.kv_after_load=keep``).
- ``interrupt``: max_staleness 2 and 4 x ``rollout.kv_after_load`` ``keep``, ``recompute`` or
  ``finish`` (no interruption: running requests end on the old weights first), decoupled loss. A
  ``keep`` cell is the same run as the staleness cell ``decoupled`` of its max_staleness and seed, run
  once.

A cell is named ``max_staleness<E>-<loss or mode>-s<seed>``; its seed is the config's ``seed`` (the engine's
sampling and the trainer's), while the data order and the held-out split stay fixed. Cells run
seed by seed, so a half-finished grid has every cell once. Each finished cell is written at once
(atomically) into ``--results``, a committed file; a cell already there is not run again (``--redo``
reruns the selected ones), so a killed grid loses only the running cell.

Per cell: held-out greedy accuracy at every 10 steps and at fixed seconds after the first step
began (the last evaluation finished by then; a run that ended earlier counts with its last one),
trained tokens/s, staleness mean/max, the behaviour weight's capped fraction and max (mean over
steps and max), seconds to 50% and 60% accuracy (None if never), wall time, the CPU.

    python -m benchmarks.bench_staleness --set 'weight_sync.dir=/dev/shm/areal-{name}'    # both grids
    python -m benchmarks.bench_staleness --grid interrupt --dry-run     # what is left, and its commands
    python -m benchmarks.bench_staleness --only max_staleness2-finish-s0 max_staleness4-finish-s0
    python -m benchmarks.bench_staleness --render    # tables into docs/benchmarks.md, docs/staleness_grid.png
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import bench_async, harness
from benchmarks.staleness_report import VARIANTS, last_before, load_results, render, save_cell
from workers.report import read_jsonl

REPO = harness.REPO
RESULTS = REPO / "benchmarks" / "results" / "staleness_grid.json"
PAGE = REPO / "docs" / "benchmarks.md"
FIGURE = REPO / "docs" / "staleness_grid.png"
MAX_STALENESS = {"staleness": (0, 1, 2, 4, 8), "interrupt": (2, 4)}
"""The ``rollout.max_staleness`` values of each grid."""
TARGETS = (0.5, 0.6)


@dataclass(frozen=True)
class Cell:
    """One run of the grid: ``variant`` is the loss (staleness grid) or kv_after_load (interrupt)."""

    grid: str
    max_staleness: int
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"max_staleness{self.max_staleness}-{self.variant}-s{self.seed}"

    @property
    def decoupled(self) -> bool:
        return self.variant != "naive"

    @property
    def mode(self) -> str:
        return self.variant if self.grid == "interrupt" else "keep"

    @property
    def run(self) -> Cell:
        """The cell whose run this is: an interrupt ``keep`` cell is the staleness ``decoupled`` one."""
        return (
            Cell("staleness", self.max_staleness, "decoupled", self.seed) if self.variant == "keep" else self
        )


def plan(grid: str, max_staleness: Sequence[int] | None, seeds: Sequence[int]) -> list[Cell]:
    """The cells of ``grid`` (``staleness``, ``interrupt`` or ``all``), seed by seed."""
    grids = ("staleness", "interrupt") if grid == "all" else (grid,)
    return [
        Cell(g, bound, variant, seed)
        for seed in seeds
        for g in grids
        for bound in (max_staleness if max_staleness is not None else MAX_STALENESS[g])
        for variant in VARIANTS[g]
    ]


def cell_args(args: argparse.Namespace, cell: Cell) -> argparse.Namespace:
    """``args`` as bench_async.command_for / run_one read them, with the cell's own overrides."""
    extra = [f"rollout.kv_after_load={cell.mode}", f"seed={cell.seed}", *args.set]
    return argparse.Namespace(**{**vars(args), "set": extra, "target": TARGETS[0]})


def summarize_run(
    steps: Sequence[Mapping[str, Any]],
    evals: Sequence[Mapping[str, Any]],
    at_steps: Sequence[int],
    at_seconds: Sequence[int],
) -> dict[str, Any]:
    """A cell's accuracy, speed and behaviour-weight numbers from its metrics.jsonl and eval.jsonl.
    Seconds count from the start of the first step (its ``time`` minus its ``step_s``)."""
    t0 = steps[0]["time"] - steps[0]["step_s"]
    curve = sorted((int(e["policy_version"]), e["time"] - t0, float(e["eval/accuracy"])) for e in evals)
    by_step = [(v, a) for v, _, a in curve]
    by_time = sorted((t, a) for _, t, a in curve)
    out: dict[str, Any] = {
        "train_s": steps[-1]["time"] - t0,
        "final_accuracy": by_step[-1][1] if by_step else None,
        "accuracy_at_step": {str(s): last_before(by_step, s) for s in at_steps},
        "accuracy_at_s": {str(t): last_before(by_time, t) for t in at_seconds},
        "evals": [[v, round(t, 1), a] for v, t, a in curve],
    }
    for target in TARGETS:
        reached = [t for t, a in by_time if a >= target]
        out[f"time_to_{round(100 * target)}_s"] = min(reached) if reached else None
    for key in ("behave_capped_fraction", "behave_weight_max"):
        values = [float(s.get(key, 0.0)) for s in steps]
        out[f"{key}_mean"], out[f"{key}_max"] = sum(values) / len(values), max(values)
    return out


def run_cell(args: argparse.Namespace, cell: Cell) -> dict[str, Any] | None:
    """Run one cell from a clean run dir; its record, or None (said why) if it did not finish."""
    sub = cell_args(args, cell)
    shutil.rmtree(args.out / cell.name, ignore_errors=True)  # a killed attempt is never resumed
    launched = time.time()
    row = bench_async.run_one(sub, cell.name, cell.max_staleness, cell.decoupled)
    log = harness.repo_path(args.out / f"{cell.name}.log")
    if row["returncode"] != 0 or row.get("steps", 0) < args.steps:
        print(f"{cell.name}: failed (exit {row['returncode']}, {row.get('steps', 0)} steps); see {log}")
        return None
    run_dir = args.out / cell.name
    steps, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    env = harness.capture_env()
    overrides = bench_async.command_for(sub, cell.name, cell.max_staleness, cell.decoupled)[2]
    summary = summarize_run(steps, evals, range(10, args.steps + 1, 10), args.wall_times)
    return {
        "name": cell.name,
        "max_staleness": cell.max_staleness,
        "objective": "decoupled" if cell.decoupled else "naive",
        "kv_after_load": cell.mode,
        "seed": cell.seed,
        "config": harness.repo_path(args.config),
        "overrides": [o for o in overrides if not o.startswith(("name=", "dir="))],
        "extra": list(args.set),
        "machine": env["cpu"]["model"],
        "hardware": harness.hardware_key(env),
        "commit": env["commit"],
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "steps": row["steps"],
        "wall_s": row["wall_s"],
        "startup_s": steps[0]["time"] - steps[0]["step_s"] - launched,
        **{
            k: row[k] for k in ("trained_tokens_per_s", "seconds_per_step", "staleness_mean", "staleness_max")
        },
        **summary,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("staleness", "interrupt", "all"), default="all")
    p.add_argument(
        "--max-staleness",
        "--etas",
        dest="max_staleness",
        default=None,
        help="comma list of rollout.max_staleness values (default 0,1,2,4,8 staleness; 2,4 interrupt)",
    )
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--wall-times", default="120,240,360,480,600", help="seconds for accuracy at wall time")
    p.add_argument("--results", type=Path, default=RESULTS, help="cells measured so far (read and extended)")
    p.add_argument("--only", nargs="+", metavar="CELL", help="run only these cells (names as in --dry-run)")
    p.add_argument("--redo", action="store_true", help="run the selected cells even if in --results")
    p.add_argument("--dry-run", action="store_true", help="print the cells still to run and their commands")
    p.add_argument("--render", action="store_true", help="only render --results into --page and --figure")
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--figure", type=Path, default=FIGURE)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "arith_cpu.yaml")
    p.add_argument("--affinity", default=bench_async.AFFINITY, help="AREAL_CPU_AFFINITY of every run")
    p.add_argument("--cuda-devices", default="", help="AREAL_CUDA_DEVICES of every run")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides, every cell"
    )
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-staleness", help="run dirs and logs")
    p.add_argument("--keep-weights", action="store_true", help="keep each run's checkpoints and weights")
    args = p.parse_args(argv)
    if args.render:
        render(args.results, args.page, args.figure)
        return
    args.wall_times = [int(t) for t in args.wall_times.split(",") if t.strip()]
    bounds = [int(e) for e in args.max_staleness.split(",") if e.strip()] if args.max_staleness else None
    cells = plan(args.grid, bounds, [int(s) for s in args.seeds.split(",") if s.strip()])
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in cells})
        if unknown:
            p.error(f"unknown cells {unknown}; this grid has {[c.name for c in cells]}")
        cells = [c for c in cells if c.name in args.only]
    done = load_results(args.results)["cells"]
    runs: dict[Cell, list[str]] = {}
    for cell in cells:
        runs.setdefault(cell.run, []).append(cell.name)
    todo = [r for r in runs if args.redo or r.name not in done]
    skipped = [names for r, names in runs.items() if r not in todo]
    print(f"{len(todo)} runs to do; {len(skipped)} already in {harness.repo_path(args.results)}")
    for names in skipped:
        print(f"  done: {' = '.join(names)}")
    if args.dry_run:
        for run in todo:
            cmd, env, _ = bench_async.command_for(
                cell_args(args, run), run.name, run.max_staleness, run.decoupled
            )
            also = [n for n in runs[run] if n != run.name]
            print(f"{run.name}{f' (also {also[0]})' if also else ''}: ", end="")
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for run in todo:
        print(f"{run.name}: running", flush=True)
        record = run_cell(args, run)
        if record is not None:
            save_cell(args.results, record)
            print(
                f"{run.name}: {record['wall_s']:.0f} s, final accuracy {record['final_accuracy']}", flush=True
            )


if __name__ == "__main__":
    main()
