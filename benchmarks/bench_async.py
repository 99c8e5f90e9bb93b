"""Asynchronous vs synchronous RL: the same run at several staleness bounds (a small AReaL Table 2).

For each ``rollout.max_staleness`` in ``--max-staleness`` (decoupled PPO) and each in
``--naive-max-staleness`` (decoupled loss off: plain PPO against the behaviour logprobs) the script
runs the job with
``areal-async run``, generation and training pinned to separate CPU cores
(``AREAL_CPU_AFFINITY``, so they behave like separate devices), and reports:

- trained tokens/s (completion tokens trained / wall time from the first to the last step)
- seconds per step, time to reach ``--target`` eval accuracy, final eval accuracy
- staleness mean/max over trained groups
- bus share: seconds the trainer spent publishing and decoding events / step time
- the step's phases (wait for data, compute with its pi_prox forward, weight snapshot), the weight
  hand-off (published -> every engine serving, the engine's own load, both from the run's logs)
  and, where nvidia-smi runs, the GPUs' busy share and peak memory over the measured steps
  (``--warmup N`` leaves the first N steps, with their compilation, out of every figure)
- the ideal overlap bound (t_gen + t_train) / max(t_gen, t_train) from the synchronous run's own
  phase times (max_staleness 0; t_gen = the trainer's wait for data, t_train = compute + weight
  snapshot), and each run's speed-up over it (``speedup_vs_sync``) and share of that bound;
  decoupled and naive runs each against their own synchronous run (the naive loss has no pi_prox
  forward, so its steps are shorter)

Rows are labelled ``max_staleness<N>`` and ``naive-max_staleness<N>``. ``--etas`` and
``--naive-etas`` are accepted as other spellings of the two flags, so recorded commands still run.

    python -m benchmarks.bench_async --set weight_sync.dir=/dev/shm/areal-{name}   # baseline
    python -m benchmarks.bench_async --config tiny.yaml --max-staleness 0,2 --naive-max-staleness "" --steps 20 --out /tmp/b
    python -m benchmarks.bench_async --config configs/agent_cpu.yaml --naive-max-staleness "" --max-staleness 0,2,4   # episodes
    python -m benchmarks.bench_async --config configs/gsm8k_2gpu.yaml --max-staleness 0,1,2,4 --naive-max-staleness "" \
        --affinity "" --cuda-devices "generation=0;trainer=1" --dry-run     # two GPUs: what it would start

Writes ``result.json`` (benchmarks.harness layout) and ``bench_async.png`` into ``--out`` with each
run's directory; ``--save-baseline`` makes the result the baseline of its hardware (benchmark
``async``, or ``async_agent`` for a run file whose workflow runs agent workers).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_async.run_file import load_config
from benchmarks import harness
from benchmarks.gpu_busy import GpuSampler
from workers.report import read_jsonl

REPO = harness.REPO
AFFINITY = "generation=0;agent=0;trainer=1;trainer.io=0"
"""Default AREAL_CPU_AFFINITY: generation (and agents) on core 0, the trainer on core 1."""

METRICS: dict[str, harness.Direction] = {
    "trained_tokens_per_s": "higher",
    "seconds_per_step": "lower",
    "speedup_vs_sync": "higher",
    "time_to_target_s": "lower",
    "final_eval_accuracy": "higher",
    "save_s": "lower",
    "served_s": "lower",
    "gpu_busy": "higher",
}
"""What report --check compares (rows: one per run, ``max_staleness<N>`` and ``naive-max_staleness<N>``)."""


PHASES = ("wait_s", "compute_s", "prox_seconds", "save_s")
"""Per-step phases from metrics.jsonl averaged into each row."""


def command_for(
    args: argparse.Namespace, label: str, max_staleness: int, decoupled: bool
) -> tuple[list[str], dict[str, str], list[str]]:
    """The ``areal-async run`` command of one run, the environment it adds, and its overrides."""
    run_dir = args.out / label
    overrides = [
        f"name=bench-{label}",
        f"dir={run_dir}",
        f"rollout.max_staleness={max_staleness}",
        f"trainer.total_steps={args.steps}",
        f"trainer.loss.decoupled={'true' if decoupled else 'false'}",
        "checkpoint.every_steps=1000",
        *args.set,
    ]
    cmd = [sys.executable, "-m", "workers", "run", str(args.config), "--no-live"]
    for o in overrides:
        cmd += ["--set", o]
    env = {"AREAL_CPU_AFFINITY": args.affinity, "PYTHONUNBUFFERED": "1"}
    if args.cuda_devices:
        env["AREAL_CUDA_DEVICES"] = args.cuda_devices
    return cmd, env, overrides


def placement(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What one run starts: each role's processes, where they compute, and how weights move."""
    from workers.launcher import _worker_env
    from workers.roles import run_roles

    cfg = load_config(args.config, overrides)
    base = {k: v for k, v in os.environ.items() if k == "CUDA_VISIBLE_DEVICES"}
    if args.cuda_devices:
        base["AREAL_CUDA_DEVICES"] = args.cuda_devices
    lines = []
    for role in run_roles(cfg.uses_agents):
        gpus = _worker_env(base, role, None).get("CUDA_VISIBLE_DEVICES", "all")
        if role == "trainer":
            what = f"{cfg.trainer.num_ranks} rank(s) on {cfg.trainer.device}"
        elif role == "generation":
            what = f"{cfg.rollout.engine} engine on {cfg.rollout.device}"
        elif role == "weight-sync":
            what = f"weights by {cfg.weight_sync.transport}"
        else:
            what = "CPU"
        lines.append(f"  {role:<12} {what:<34} CUDA_VISIBLE_DEVICES={gpus}")
    return lines


HANDOFF = {"served_s": ("weights served", "total_s"), "engine_load_s": ("weights loaded", "seconds")}
"""Row key -> (log event, its field): published -> every engine serving, and the engine's own load."""


def handoff_seconds(run_dir: Path, versions: set[int]) -> dict[str, list[float]]:
    """The ``HANDOFF`` figures of ``versions`` from the run's per-worker JSON logs (read once)."""
    out: dict[str, list[float]] = {k: [] for k in HANDOFF}
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        for line in read_jsonl(path):
            if line.get("policy_version") not in versions:
                continue
            for key, (event, field) in HANDOFF.items():
                if line.get("event") == event and field in line:
                    out[key].append(float(line[field]))
    return out


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_one(args: argparse.Namespace, label: str, max_staleness: int, decoupled: bool) -> dict[str, Any]:
    run_dir = args.out / label
    cmd, extra, overrides = command_for(args, label, max_staleness, decoupled)
    env = {**os.environ, **extra}
    started = time.time()
    with open(args.out / f"{label}.log", "wb") as log, GpuSampler() as gpu:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if not args.keep_weights:
        # A run ends with a checkpoint and its last published versions (~2.6 GB for SmolLM2 with
        # its optimizer); a full sweep would otherwise fill a small disk or a tmpfs.
        for path in (run_dir / "checkpoints", load_config(args.config, overrides).weights_root):
            shutil.rmtree(path, ignore_errors=True)
    steps = read_jsonl(run_dir / "metrics.jsonl")[args.warmup :]
    evals = read_jsonl(run_dir / "eval.jsonl")
    row: dict[str, Any] = {
        "case": label,
        "label": label,
        "max_staleness": max_staleness,
        "decoupled": decoupled,
        "returncode": rc,
    }
    if len(steps) < 2:
        return row
    t0 = steps[0]["time"] - steps[0]["step_s"]
    span = steps[-1]["time"] - t0
    tokens = sum(s.get("loss_tokens", 0.0) for s in steps)
    step_s = sum(s["step_s"] for s in steps)
    reached = [e["time"] - started for e in evals if e["eval/accuracy"] >= args.target]
    handoff = handoff_seconds(run_dir, {int(s["policy_version"]) for s in steps})
    row.update(
        steps=len(steps),
        trained_tokens_per_s=tokens / span,
        seconds_per_step=span / len(steps),
        time_to_target_s=min(reached) if reached else None,
        final_eval_accuracy=evals[-1]["eval/accuracy"] if evals else None,
        eval_curve=[(e["policy_version"], e["eval/accuracy"]) for e in evals],
        staleness_mean=sum(s["staleness_mean"] for s in steps) / len(steps),
        staleness_max=max(s["staleness_max"] for s in steps),
        bus_share=sum(s.get("bus_s", 0.0) for s in steps) / step_s,
        t_gen=sum(s["wait_s"] for s in steps) / len(steps),
        t_train=sum(s["compute_s"] + s["save_s"] for s in steps) / len(steps),
        # The step's phases (means over the measured steps): pi_prox is part of compute.
        **{k: mean([s[k] for s in steps if k in s]) for k in PHASES},
        **{k: mean(v) for k, v in handoff.items()},
        gpu_busy=gpu.busy(t0, steps[-1]["time"]),
        gpu_peak_mib=gpu.peak_mib(t0, steps[-1]["time"]),
        wall_s=time.time() - started,
    )
    return row


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'run':<22}{'tok/s':>9}{'s/step':>8}{'to target':>10}{'final acc':>10}{'stale':>12}{'bus %':>7}"
    head += f"{'wait':>7}{'compute':>8}{'prox':>6}{'save':>7}{'served':>8}{'load':>7}{'GPU %':>7}"
    lines = [head]
    for r in rows:
        if "steps" not in r:
            lines.append(f"{r['label']:<22} failed (exit {r['returncode']})")
            continue
        tt = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "-"
        acc = fmt(r["final_eval_accuracy"], ".3f")
        busy = None if r["gpu_busy"] is None else 100 * r["gpu_busy"]
        lines.append(
            f"{r['label']:<22}{r['trained_tokens_per_s']:>9.1f}{r['seconds_per_step']:>8.2f}{tt:>10}{acc:>10}"
            f"{r['staleness_mean']:>7.2f}/{r['staleness_max']:<4.0f}{100 * r['bus_share']:>7.2f}"
            f"{fmt(r['wait_s'], '.2f'):>7}{fmt(r['compute_s'], '.2f'):>8}{fmt(r['prox_seconds'], '.2f'):>6}"
            f"{fmt(r['save_s'], '.3f'):>7}{fmt(r['served_s'], '.3f'):>8}{fmt(r['engine_load_s'], '.3f'):>7}"
            f"{fmt(busy, '.0f'):>7}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "steps" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r["label"] for r in ok], [r["trained_tokens_per_s"] for r in ok])
    a.set_ylabel("trained tokens/s")
    a.tick_params(axis="x", rotation=30)
    for r in ok:
        xs, ys = zip(*r["eval_curve"], strict=True) if r["eval_curve"] else ((), ())
        b.plot(xs, ys, marker="o", label=r["label"])
    b.set_xlabel("policy version")
    b.set_ylabel("eval accuracy")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_async.png", dpi=80)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "arith_cpu.yaml")
    p.add_argument(
        "--max-staleness",
        "--etas",
        dest="max_staleness",
        default="0,1,2,4",
        help="comma list of rollout.max_staleness values of the decoupled PPO runs",
    )
    p.add_argument(
        "--naive-max-staleness",
        "--naive-etas",
        dest="naive_max_staleness",
        default="0,4,8",
        help="comma list of rollout.max_staleness values of the runs with the decoupled loss off ('' = none)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="leave each run's first N steps out of every figure (start-up, compilation, first rollouts)",
    )
    p.add_argument("--target", type=float, default=0.5, help="eval accuracy for time-to-target")
    p.add_argument(
        "--affinity",
        default=AFFINITY,
        help="AREAL_CPU_AFFINITY for every run (trainer.io: the trainer's weight writer thread)",
    )
    p.add_argument(
        "--cuda-devices", default="", help="AREAL_CUDA_DEVICES for every run, e.g. 'generation=0;trainer=1'"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    p.add_argument(
        "--dry-run", action="store_true", help="print each run's command and placement; start nothing"
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "runs" / "bench-async", help="run dirs, result.json, the plot"
    )
    p.add_argument("--save-baseline", action="store_true", help="also write the result as the baseline")
    p.add_argument(
        "--keep-weights",
        action="store_true",
        help="keep each run's checkpoints and published weights (default: deleted once summarised)",
    )
    args = p.parse_args()
    plan = [(f"max_staleness{e}", int(e), True) for e in args.max_staleness.split(",") if e.strip()]
    plan += [
        (f"naive-max_staleness{e}", int(e), False) for e in args.naive_max_staleness.split(",") if e.strip()
    ]
    if args.dry_run:
        for label, max_staleness, decoupled in plan:
            cmd, extra, overrides = command_for(args, label, max_staleness, decoupled)
            print(f"{label}: {' '.join(f'{k}={shlex.quote(v)}' for k, v in extra.items())} {shlex.join(cmd)}")
            print("\n".join(placement(args, overrides)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, max_staleness, decoupled in plan:
        rows.append(run_one(args, label, max_staleness, decoupled))
        print(table(rows), flush=True)
    for decoupled in (True, False):
        family = [r for r in rows if r.get("decoupled") == decoupled and "steps" in r]
        base = next((r for r in family if r["max_staleness"] == 0), None)
        if base is None:
            continue
        # Each loss against its own synchronous run: the naive loss skips the pi_prox forward, so its
        # steps are shorter and its bound differs.
        bound = (base["t_gen"] + base["t_train"]) / max(base["t_gen"], base["t_train"], 1e-9)
        name = "decoupled" if decoupled else "naive"
        print(f"\n{name}: ideal overlap bound from its max_staleness=0 phases: {bound:.2f}x")
        for r in family:
            r["ideal_overlap_bound"] = bound
            r["speedup_vs_sync"] = r["trained_tokens_per_s"] / base["trained_tokens_per_s"]
            r["share_of_ideal"] = r["speedup_vs_sync"] / bound
            print(
                f"{r['label']:<22} speedup {r['speedup_vs_sync']:.2f}x  ({100 * r['share_of_ideal']:.0f}% of ideal)"
            )
    plot(rows, args.out)
    cfg = load_config(args.config, args.set)
    # Episode workloads (agent runs) keep their own baseline beside the single-turn one.
    name = "async_agent" if cfg.uses_agents else "async"
    note = f"workload: {harness.repo_path(args.config)} (workflow {cfg.rollout.workflow})"
    result = harness.make_result(
        name, args, rows, METRICS, device=cfg.trainer.device, drop=("keep_weights",), note=note
    )
    harness.emit(result, args.out / "result.json", args.save_baseline)


if __name__ == "__main__":
    main()
