"""The staleness grid's results file and its section of docs/benchmarks.md.

``benchmarks/results/staleness_grid.json`` (committed, so cells accumulate across sessions and
machines) holds one record per run, keyed by cell name (``max_staleness2-decoupled-s0``)::

    {"benchmark": "staleness_grid", "cells": {"max_staleness2-decoupled-s0": {
        "max_staleness": 2, "objective": "decoupled" | "naive", "kv_after_load": "keep" | "recompute" | "finish",
        "seed": 0, "config": ..., "overrides": [...], "extra": [...], "machine": <CPU model>,
        "hardware": ..., "commit": ..., "time": ..., "steps": 60, "wall_s": ..., "startup_s": ...,
        "train_s": ..., "trained_tokens_per_s": ..., "seconds_per_step": ...,
        "staleness_mean": ..., "staleness_max": ...,
        "behave_capped_fraction_mean" / "_max", "behave_weight_max_mean" / "_max",
        "accuracy_at_step": {"10": ...}, "accuracy_at_s": {"120": ...}, "final_accuracy": ...,
        "time_to_50_s", "time_to_60_s" (None if never), "evals": [[version, seconds, accuracy], ...]}}}

Seconds count from the start of the first training step. ``render`` turns the file into the
tables, the comparison against the seed spread and the figure between the page's
``<!-- staleness-grid:start -->`` and ``<!-- staleness-grid:end -->`` markers; the rest of the page
(and ``python -m benchmarks.report``, which keeps this section) is left alone. Written by
``python -m benchmarks.bench_staleness``, which also renders (``--render``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

START, END = "<!-- staleness-grid:start -->", "<!-- staleness-grid:end -->"
VARIANTS = {"staleness": ("decoupled", "naive"), "interrupt": ("keep", "recompute", "finish")}
"""Per grid, what tells its groups apart: the loss, or ``rollout.kv_after_load``; in table order."""

Record = Mapping[str, Any]


def load_results(path: Path) -> dict[str, Any]:
    """The results file (an empty one if it does not exist yet); ValueError if it is something else."""
    if not path.exists():
        return {"benchmark": "staleness_grid", "cells": {}}
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), dict):
        raise ValueError(f"{path}: not a staleness grid results file (no 'cells' object); move it aside")
    return doc


def save_cell(path: Path, record: Mapping[str, Any]) -> None:
    """Add one cell to the results file: re-read, replace atomically (a kill leaves the old file)."""
    doc = load_results(path)
    doc["cells"][record["name"]] = dict(record)
    doc["cells"] = dict(sorted(doc["cells"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(f.name, path)


def last_before(curve: Iterable[tuple[float, float]], limit: float) -> float | None:
    """The value of the last (x, value) with x <= limit (``curve`` sorted by x), None if none."""
    value = None
    for x, v in curve:
        if x > limit:
            break
        value = v
    return value


def spread(values: Sequence[float | None], digits: int = 2, scale: float = 1.0) -> str:
    """Mean ± half the range over seeds; ``(k/n)`` when only k of n seeds have a value."""
    got = [scale * v for v in values if v is not None]
    if not got:
        return "-"
    text = f"{sum(got) / len(got):.{digits}f}"
    if len(got) > 1:
        text += f" ± {(max(got) - min(got)) / 2:.{digits}f}"
    return text + (f" ({len(got)}/{len(values)})" if len(got) < len(values) else "")


def groups(cells: Iterable[Record], grid: str) -> dict[tuple[int, str], list[Record]]:
    """Records by (max_staleness, loss) for the staleness grid (kept KV), by (max_staleness,
    kv_after_load) for the interrupt grid (decoupled loss, at the bounds where a recompute or finish
    cell exists)."""
    cells = list(cells)
    if grid == "staleness":
        pick = [(c, c["objective"]) for c in cells if c["kv_after_load"] == "keep"]
    else:
        bounds = {c["max_staleness"] for c in cells if c["kv_after_load"] != "keep"}
        pick = [
            (c, c["kv_after_load"])
            for c in cells
            if c["objective"] == "decoupled" and c["max_staleness"] in bounds
        ]
    order = {v: i for i, v in enumerate(VARIANTS[grid])}
    out: dict[tuple[int, str], list[Record]] = {}
    for cell, variant in sorted(pick, key=lambda p: (p[0]["max_staleness"], order[p[1]], p[0]["seed"])):
        out.setdefault((cell["max_staleness"], variant), []).append(cell)
    return out


def _mean_max(cells: list[Record], key: str, digits: int, scale: float = 1.0) -> str:
    """Per-run means of a step statistic over seeds, then the largest step value of any run."""
    if cells[0]["objective"] == "naive":
        return "n/a (w = 1)"
    top = max(scale * c[f"{key}_max"] for c in cells)
    return f"{spread([c[f'{key}_mean'] for c in cells], digits, scale)} / {top:.{digits}f}"


SPEED: dict[str, Callable[[list[Record]], str]] = {
    "seeds": lambda cs: str(len(cs)),
    "trained tok/s": lambda cs: spread([c["trained_tokens_per_s"] for c in cs], 1),
    "s/step": lambda cs: spread([c["seconds_per_step"] for c in cs]),
    "staleness mean / max": lambda cs: (
        f"{spread([c['staleness_mean'] for c in cs])} / {max(c['staleness_max'] for c in cs):.0f}"
    ),
    "capped % mean / max": lambda cs: _mean_max(cs, "behave_capped_fraction", 3, 100),
    "w max mean / max": lambda cs: _mean_max(cs, "behave_weight_max", 1),
    "to 50% (s)": lambda cs: spread([c["time_to_50_s"] for c in cs], 0),
    "to 60% (s)": lambda cs: spread([c["time_to_60_s"] for c in cs], 0),
}
"""The columns of a grid's first table, from the records of one group."""


def markdown(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def tables(grid: str, by: Mapping[tuple[int, str], list[Record]]) -> list[str]:
    """Two markdown tables of one grid: speed and off-policyness, then held-out accuracy."""
    label = "loss" if grid == "staleness" else "kv_after_load"
    first = next(iter(by.values()))[0]
    at_steps, at_s = list(first["accuracy_at_step"]), list(first["accuracy_at_s"])
    speed = [[str(bound), v, *(column(cs) for column in SPEED.values())] for (bound, v), cs in by.items()]
    accuracy = [
        [str(bound), v]
        + [spread([c["accuracy_at_step"].get(s) for c in cs]) for s in at_steps]
        + [spread([c["accuracy_at_s"].get(t) for c in cs]) for t in at_s]
        for (bound, v), cs in by.items()
    ]
    head = ["max_staleness", label, *(f"acc @{s}" for s in at_steps), *(f"acc @{t} s" for t in at_s)]
    return [*markdown(["max_staleness", label, *SPEED], speed), "", *markdown(head, accuracy)]


def _at_common_time(a: list[Record], b: list[Record]) -> tuple[str, list[Any], list[Any]] | None:
    """Accuracy at the latest wall time every run of ``a`` and ``b`` was still training."""
    span = min(c["train_s"] for c in (*a, *b))
    times = [t for t in a[0]["accuracy_at_s"] if int(t) <= span]
    if not times:
        return None
    t = max(times, key=int)
    return f" (@{t} s)", [c["accuracy_at_s"].get(t) for c in a], [c["accuracy_at_s"].get(t) for c in b]


COMPARED: dict[str, Callable[[list[Record], list[Record]], tuple[str, list[Any], list[Any]] | None]] = {
    "trained tok/s": lambda a, b: (
        "",
        [c["trained_tokens_per_s"] for c in a],
        [c["trained_tokens_per_s"] for c in b],
    ),
    "final accuracy": lambda a, b: ("", [c["final_accuracy"] for c in a], [c["final_accuracy"] for c in b]),
    "accuracy at wall time": _at_common_time,
    "to 50% (s)": lambda a, b: ("", [c["time_to_50_s"] for c in a], [c["time_to_50_s"] for c in b]),
}


def comparisons(cells: Sequence[Record]) -> list[str]:
    """Which differences exceed the seed spread: a row per pair of groups, a column per metric; a
    difference counts only where both have 2+ seeds and their min-max ranges do not overlap."""
    st, it = groups(cells, "staleness"), groups(cells, "interrupt")
    name = "max_staleness"
    pairs = {f"{name}{e} naive vs decoupled": (st.get((e, "naive")), st.get((e, "decoupled"))) for e, _ in st}
    pairs |= {f"{name}{e} {v} vs {name}0": (st.get((e, v)), st.get((0, v))) for e, v in st if e > 0}
    pairs |= {f"{name}{e} {v} vs keep": (it.get((e, v)), it.get((e, "keep"))) for e, v in it if v != "keep"}
    rows = []
    for name, (a, b) in pairs.items():
        if not (a and b):
            continue
        row = [name]
        for compare in COMPARED.values():
            got = compare(a, b)
            if got is None or None in got[1] or None in got[2]:
                row.append("-")
                continue
            where, va, vb = got
            ma, mb = sum(va) / len(va), sum(vb) / len(vb)
            apart = min(len(va), len(vb)) > 1 and (min(va) > max(vb) or max(va) < min(vb))
            change = f"{100 * (ma - mb) / abs(mb):+.0f}%" if mb else f"{ma - mb:+.2f}"
            row.append((f"**{change} apart**" if apart else f"{change} within") + where)
        rows.append(row)
    return markdown(["comparison", *COMPARED], rows) if rows else []


def render_region(doc: Mapping[str, Any], figure: str | None) -> str:
    """The markdown between the markers: per grid its tables, the comparisons, the figure."""
    cells = list(doc["cells"].values())
    if not cells:
        return "No cells measured yet (`benchmarks/results/staleness_grid.json` holds none)."
    out: list[str] = []
    for grid in ("staleness", "interrupt"):
        by = groups(cells, grid)
        if by:
            out += [f"**{grid} grid** (mean ± half the range over seeds)", "", *tables(grid, by), ""]
    compared = comparisons(cells)
    if compared:
        out += ["**Differences against the seed spread** (first group minus second, relative)", ""]
        out += [*compared, ""]

    def each(key: Callable[[Record], str]) -> str:
        return "; ".join(sorted({key(c) for c in cells}))

    machines = each(lambda c: f"{c['machine']} ({c['hardware']})")
    extra = each(lambda c: " ".join(c["extra"]) or "none")
    out.append(
        f"{len(cells)} runs of {each(lambda c: c['config'])}, {each(lambda c: str(c['steps']))} steps; "
        f"machines: {machines}; extra overrides: {extra}; commits {each(lambda c: str(c['commit'])[:7])}."
    )
    if figure:
        out += ["", f"![staleness grid]({figure})"]
    return "\n".join(out)


def replace_region(page: str, region: str) -> str:
    """``page`` with the text between the markers replaced; ValueError if they are missing."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page has no {START} ... {END} region; add it under '## staleness_grid'")
    return f"{head}{START}\n{region}\n{END}{tail}"


def plot(doc: Mapping[str, Any], out: Path) -> None:
    """Accuracy over steps and over seconds per group: the mean over seeds, the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(doc["cells"].values())
    grids = [g for g in ("staleness", "interrupt") if groups(cells, g)]
    fig, axes = plt.subplots(len(grids), 2, figsize=(12, 4.2 * len(grids)), squeeze=False)
    for row, grid in zip(axes, grids, strict=True):
        by = groups(cells, grid)
        bounds = sorted({bound for bound, _ in by})
        for (bound, variant), members in by.items():
            dash = ("-", "--", ":")[VARIANTS[grid].index(variant)]
            style = {"color": f"C{bounds.index(bound) % 10}", "linestyle": dash}
            for ax, axis in zip(row, (0, 1), strict=True):
                curves = [sorted((e[axis], e[2]) for e in c["evals"]) for c in members]
                xs = sorted({x for curve in curves for x, _ in curve})
                ys = [[y for y in (last_before(curve, x) for curve in curves) if y is not None] for x in xs]
                keep = [k for k, y in enumerate(ys) if y]
                xs, ys = [xs[k] for k in keep], [ys[k] for k in keep]
                ax.plot(
                    xs,
                    [sum(y) / len(y) for y in ys],
                    label=f"max_staleness {bound} {variant} (n={len(members)})",
                    **style,
                )
                ax.fill_between(
                    xs, [min(y) for y in ys], [max(y) for y in ys], color=style["color"], alpha=0.15
                )
        row[0].set_xlabel("policy version (step)")
        row[1].set_xlabel("seconds since the first step began")
        for ax in row:
            ax.set_ylabel(f"held-out accuracy ({grid} grid)")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def render(results: Path, page: Path, figure: Path) -> None:
    doc = load_results(results)
    if doc["cells"]:
        plot(doc, figure)
    link = os.path.relpath(figure, page.parent) if doc["cells"] else None
    page.write_text(replace_region(page.read_text(), render_region(doc, link)))
    print(f"wrote {harness.repo_path(page)}" + (f" and {harness.repo_path(figure)}" if link else ""))
