"""End-of-run report: a PNG plot and a one-screen summary from the run directory.

Reads ``metrics.jsonl`` (one line per training step, written by the trainer) and
``eval.jsonl`` (one line per evaluation round, written by the controller). Plots train
reward, eval accuracy, staleness and step time against step and against wall time into
``<run_dir>/report.png``; returns the summary text (also written to ``summary.txt``), which
also lists the peak resident memory of each role's process tree when the launcher measured it,
and the stalls the watchdog found and their heals (``stalls.jsonl``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def format_rss(size: int) -> str:
    """Resident memory for people: ``"312 MiB"``, ``"1.4 GiB"``; ``"-"`` when never measured."""
    if size <= 0:
        return "-"
    if size < 2**30:
        return f"{size / 2**20:.0f} MiB"
    return f"{size / 2**30:.1f} GiB"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash; the rest is still useful
    return rows


def summarize(run_dir: Path, wall_s: float | None = None, peak_rss: Mapping[str, int] | None = None) -> str:
    steps = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    lines = [f"run dir      {run_dir}"]
    if wall_s is not None:
        lines.append(f"wall time    {wall_s:.0f} s")
    if steps:
        last = steps[-1]
        k = max(1, len(steps) // 5)
        first_r = sum(s.get("reward_mean", 0.0) for s in steps[:k]) / k
        last_r = sum(s.get("reward_mean", 0.0) for s in steps[-k:]) / k
        stale = [s.get("staleness_max", 0.0) for s in steps]
        step_s = [s.get("step_s", 0.0) for s in steps]
        lines += [
            f"steps        {len(steps)} (policy version {last.get('policy_version')})",
            f"train reward {first_r:.3f} (first {k} steps) -> {last_r:.3f} (last {k})",
            f"staleness    max {max(stale):.0f}, mean {sum(s.get('staleness_mean', 0.0) for s in steps) / len(steps):.2f}",
            f"step time    mean {sum(step_s) / len(step_s):.2f} s "
            f"(wait {_mean(steps, 'wait_s'):.2f}, compute {_mean(steps, 'compute_s'):.2f}, save {_mean(steps, 'save_s'):.2f})",
            f"tokens/s     {_mean(steps, 'trained_tokens_per_s'):.1f} trained",
        ]
    if evals:
        accs = ", ".join(f"v{e['policy_version']}={e['eval/accuracy']:.3f}" for e in evals)
        lines.append(f"eval acc     {accs}")
    if peak_rss:
        lines.append("peak RSS     " + ", ".join(f"{role} {format_rss(n)}" for role, n in peak_rss.items()))
    lines += stall_lines(run_dir)
    return "\n".join(lines)


def stall_lines(run_dir: Path) -> list[str]:
    """One line per stall and per heal in ``<run_dir>/stalls.jsonl`` (written by the watchdog)."""
    lines = []
    for r in read_jsonl(run_dir / "stalls.jsonl"):
        if r.get("event") == "RunStalled":
            lines.append(f"stall        {r['role']} {r['state']} ({r['action']}): {r['evidence']}")
        elif r.get("event") == "RunHealed":
            lines.append(f"healed       {r['role']} after {r['stalled_s']:.1f} s ({r['state']})")
    return lines


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else 0.0


def plot(run_dir: Path) -> Path | None:
    steps = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if not steps and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min([r["time"] for r in steps + evals if "time" in r], default=0.0)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    panels = [
        ("train reward", steps, "reward_mean"),
        ("eval accuracy", evals, "eval/accuracy"),
        ("staleness max / mean", steps, "staleness_max"),
        ("step time (s)", steps, "step_s"),
    ]
    for col, (title, rows, key) in enumerate(panels):
        for row_i, xkey in enumerate(("policy_version", "time")):
            ax = axes[row_i][col]
            xs = [(r[xkey] - t0) if xkey == "time" else r[xkey] for r in rows if key in r]
            ys = [r[key] for r in rows if key in r]
            ax.plot(xs, ys, marker="o", markersize=3)
            if key == "staleness_max":
                ax.plot(xs, [r.get("staleness_mean", 0.0) for r in rows if key in r], marker=".", alpha=0.7)
            ax.set_title(title)
            ax.set_xlabel("policy version (step)" if xkey == "policy_version" else "wall time (s)")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def write_report(
    run_dir: Path, *, wall_s: float | None = None, peak_rss: Mapping[str, int] | None = None
) -> str:
    text = summarize(run_dir, wall_s, peak_rss)
    png = plot(run_dir)
    if png is not None:
        text += f"\nplot         {png}"
    (run_dir / "summary.txt").write_text(text + "\n")
    sys.stdout.write("\n" + text + "\n")
    return text
