"""The "scale_summary" section of docs/benchmarks.md and docs/scale.png, from the scale baselines
(`benchmarks/baselines/scale*__*.json`, written by `benchmarks.bench_scale`).

    python -m benchmarks.scale_report          # or: python -m benchmarks.bench_scale render
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import harness

REPO = harness.REPO

SECTION_START, SECTION_END = "<!-- scale_summary:start -->", "<!-- scale_summary:end -->"


def render() -> None:
    """The "scale" section of docs/benchmarks.md and docs/scale.png from the scale baselines."""
    docs = {
        d["benchmark"]: d
        for d in map(json.loads, map(Path.read_text, sorted(harness.BASELINES.glob("scale*__*.json"))))
    }
    lines = [SECTION_START, ""]
    if "scale_validate" in docs:
        doc = docs["scale_validate"]
        lines += [
            "Validation: the simulator fed each whole run's profile, at that run's shape "
            f"(`{doc['command']}`; {doc['hardware']}, {doc['time'][:10]}).",
            "",
            "| run | max_staleness | predicted s/step | measured s/step | error | predicted async/sync | measured | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["results"]:
            if "error" not in r:
                continue
            lines.append(
                f"| {r['hardware']} | {r['max_staleness']} | {r['seconds_per_step']:.2f} | "
                f"{r['measured_seconds_per_step']:.2f} | {100 * r['error']:+.1f}% | {r.get('speedup', 1):.2f}x | "
                f"{r.get('measured_speedup', 1):.2f}x | {100 * r.get('speedup_error', 0):+.1f}% |"
            )
        lines.append("")
    if "scale" in docs:
        doc = docs["scale"]
        lines += [
            f"Fleet sweep on one nats-server (`{doc['command']}`; {doc['hardware']}, {doc['time'][:10]}). "
            "Rates are per second of wall time at the run's `time_scale`; CPU is the share of one core.",
            "",
            "| engines | processes | ranks | max_staleness | traffic | bus | s/step (modelled) | msgs/s | KB/s | nats-server CPU | "
            "controller CPU | weight-sync CPU | admission ms/task | bus share | staleness mean | stale groups | "
            "hand-off to all (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["results"]:
            if "seconds_per_step" not in r:
                lines.append(f"| {r['engines']} | failed (exit {r['returncode']}) |")
                continue
            cells = [
                r["engines"],
                r["processes"],
                r["trainer_ranks"],
                r["max_staleness"],
                r.get("workflow", "single_turn").replace("_", "-"),
                "3-node cluster" if r.get("nodes", 1) == 3 else "one server",
                cell(r.get("seconds_per_step"), "{:.2f}"),
                cell(r.get("msgs_per_s"), "{:,.0f}"),
                cell(r.get("bytes_per_s"), "{:,.0f}", 1e-3),
                cell(r.get("nats_cpu"), "{:.1f}%", 100),
                cell(r.get("controller_cpu"), "{:.1f}%", 100),
                cell(r.get("weight_sync_cpu"), "{:.1f}%", 100),
                cell(r.get("admission_ms_per_task"), "{:.2f}"),
                cell(r.get("bus_share"), "{:.2f}%", 100),
                cell(r.get("staleness_mean"), "{:.2f}"),
                cell(r.get("stale_share"), "{:.0f}%", 100),
                cell(r.get("fanout_s_median"), "{:.2f}"),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines += ["", "![scale](scale.png)", ""]
        plot(doc["results"], REPO / "docs" / "scale.png")
    if "scale_areal" in docs:
        doc = docs["scale_areal"]
        lines += [
            f"AReaL's 1.5B setting (`{doc['command']}`; {doc['hardware']}, {doc['time'][:10]}): 3/4 of the "
            "GPUs generate, `configs/profiles/areal_1p5b.yaml`; effective trained tokens/s predicted and "
            "reported by the paper (Appendix C.3 at 8 GPUs; Fig. 4, read from its plot, at 32 and 256).",
            "",
            "| GPUs | engines | trainer ranks | max_staleness | prompts x 16 per step | predicted tokens/s | AReaL | "
            "s/step | staleness mean | stale groups |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["results"]:
            if "seconds_per_step" not in r:
                lines.append(f"| {r['gpus']} | failed (exit {r['returncode']}) |")
                continue
            paper = r.get("published_tokens_per_s")
            lines.append(
                f"| {r['gpus']} | {r['engines']} | {r['trainer_ranks']} | {r['max_staleness']} | {r['batch_size']} | "
                f"{r['trained_tokens_per_s']:,.0f} | {f'{paper:,}' if paper else '-'} | {r['seconds_per_step']:.0f} | "
                f"{r['staleness_mean']:.2f} | {100 * (r.get('stale_share') or 0):.0f}% |"
            )
        lines.append("")
    lines.append(SECTION_END)
    page_path = REPO / "docs" / "benchmarks.md"
    page = page_path.read_text()
    body = "\n".join(lines)
    if SECTION_START in page:
        head, _, rest = page.partition(SECTION_START)
        _, _, tail = rest.partition(SECTION_END)
        page = head + body + tail
    else:
        page = page.rstrip("\n") + "\n\n## scale_summary\n\n" + body + "\n"
    page_path.write_text(page)
    print(f"rendered {harness.repo_path(page_path)}")


def cell(value: float | None, spec: str, factor: float = 1.0) -> str:
    return "-" if value is None else spec.format(value * factor)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eta = max((r["max_staleness"] for r in rows), key=lambda e: sum(r["max_staleness"] == e for r in rows))
    ok = [
        r
        for r in rows
        if "seconds_per_step" in r
        and r["max_staleness"] == eta
        and r.get("nodes", 1) == 1
        and r.get("workflow", "single_turn") == "single_turn"
    ]
    engines = [r["engines"] for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(engines, [r["msgs_per_s"] for r in ok], marker="o", label="messages/s")
    a.set_xscale("log", base=2)
    a.set_xlabel("simulated engines")
    a.set_ylabel("messages/s through nats-server")
    a.set_title(f"max_staleness {eta}, time_scale {ok[0]['time_scale'] if ok else ''}")
    b.plot(engines, [100 * r["nats_cpu"] for r in ok], marker="o", label="nats-server")
    b.plot(engines, [100 * (r["controller_cpu"] or 0) for r in ok], marker="o", label="controller")
    b.plot(engines, [100 * (r["weight_sync_cpu"] or 0) for r in ok], marker="o", label="weight-sync")
    b.set_xscale("log", base=2)
    b.set_xlabel("simulated engines")
    b.set_ylabel("% of one core")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    render()
