"""What the dashboard costs: page load of a 1,000-step run, and its effect on a running tiny run.

    python -m benchmarks.bench_dashboard [--steps 30] [--repeats 2] [--config RUN.yaml] [--out FILE]

Cases:

* ``page load N steps``: a synthetic finished run of N steps (``tests/helpers/dashboard_run.py``),
  its dashboard, headless Chromium (Debian's ``chromium``) opening the Steps page: milliseconds from
  navigation to the first drawn Steps chart and the bytes transferred for it (document, script,
  style, snapshot; compressed sizes), on a fresh browser and (median of 3) on reloads.
* ``tiny run``, ``tiny run + dashboard``: the tiny model of the e2e tests on mode_select, alternated
  ``--repeats`` times, the second with ``areal-async run --dashboard`` and a browser on its Steps
  page for the whole run: mean step time and the trainer's bus seconds per step (first 3 steps
  left out), and what the dashboard took from the bus (its connection's messages and bytes in)
  against what the workers published. ``--config configs/arith_cpu.yaml --steps 10``: the same with
  the CPU demo cut to 10 steps instead of the tiny model (cases ``run``, ``run + dashboard``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from tests.helpers.browser import browser_page, dashboard_process
from tests.helpers.dashboard_run import synthetic_run
from tests.helpers.jobs import finish_job, start_job, tiny_config
from tests.helpers.models import build_tiny_model
from workers.dashboard import url_of

METRICS: dict[str, harness.Direction] = {
    "first_render_ms": "lower",
    "page_bytes": "lower",
    "step_s": "lower",
    "bus_s_per_step": "lower",
}

TRANSFERRED = """() => {
  const nav = performance.getEntriesByType('navigation')[0];
  return nav.transferSize + performance.getEntriesByType('resource').reduce((n, e) => n + e.transferSize, 0);
}"""


def page_load(tmp: Path, steps: int) -> dict[str, Any]:
    """The first load in a fresh browser (nothing cached), then the median of 3 reloads."""
    config = synthetic_run(tmp, "pageload", steps)
    times, sizes = [], []
    with dashboard_process(config) as url, browser_page() as page:
        for _ in range(4):
            page.goto("about:blank")
            page.goto(url + "#steps")
            page.wait_for_function("window.__firstStepsRender !== undefined")
            assert page.get_attribute("#chart-reward", "data-points") == str(steps)
            times.append(page.evaluate("window.__firstStepsRender"))
            sizes.append(page.evaluate(TRANSFERRED))
    return {"case": f"page load {steps} steps", "first_render_ms": round(times[0], 1), "page_bytes": sizes[0],
            "reload_render_ms": round(statistics.median(times[1:]), 1), "reload_bytes": int(statistics.median(sizes[1:]))}  # fmt: skip


def _worker_published(run_dir: Path) -> int:
    total = 0
    for path in (run_dir / "logs").glob("*-*.jsonl"):
        for line in path.read_text().splitlines():
            if '"nats closed"' in line:
                total += int(json.loads(line).get("published", 0))
    return total


def _dashboard_use(run_dir: Path) -> dict[str, int]:
    out = (run_dir / "logs" / "dashboard.out").read_text()
    line = next(x for x in reversed(out.splitlines()) if x.startswith("dashboard bus use: "))
    return json.loads(line.removeprefix("dashboard bus use: "))


def tiny_run(
    tmp: Path, model: Path | None, name: str, steps: int, dashboard: bool, config: Path | None = None
) -> dict[str, Any]:
    """One run of the tiny model, or of ``config`` cut to ``steps`` (its run dir under ``tmp``)."""
    if config is None:
        assert model is not None
        cfg = tiny_config(
            tmp, model, name, rollout__group_size=4, trainer__total_steps=steps, trainer__batch_size=4,
            trainer__eval_every=10, dataset__eval_size=4, checkpoint__every_steps=10,
        )  # fmt: skip
        overrides: tuple[str, ...] = ()
    else:
        cfg = config
        overrides = (f"dir={tmp}/{name}", f"name={name}", f"trainer.total_steps={steps}")
    run_dir = tmp / name
    started = time.monotonic()
    flags = ("--dashboard", "--dashboard-port", "0") if dashboard else ()
    proc = start_job(cfg, *overrides, flags=flags)
    watcher = None
    if dashboard:
        done = threading.Event()

        def watch() -> None:  # a person keeping the Steps page open for the whole run
            while (url := url_of(run_dir)) is None and proc.poll() is None:
                time.sleep(0.1)
            if url is None:
                return
            with browser_page() as page:
                page.goto(url + "#steps")
                while proc.poll() is None and not done.is_set():
                    page.wait_for_timeout(500)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    res = finish_job(proc, run_dir, started, timeout=900)
    if watcher is not None:
        done.set()
        watcher.join(timeout=30)
    assert res.returncode == 0, res.output[-2000:]
    rows = res.metrics()[3:]
    row: dict[str, Any] = {
        "case": ("run" if config is not None else "tiny run") + (" + dashboard" if dashboard else ""),
        "step_s": round(statistics.mean(r["step_s"] for r in rows), 3),
        "bus_s_per_step": round(statistics.mean(r.get("bus_s", 0.0) for r in rows), 4),
        "wall_s": round(res.seconds, 1),
        "published_by_workers": _worker_published(run_dir),
    }
    if dashboard:
        use = _dashboard_use(run_dir)
        row.update(dashboard_in_msgs=use["in_msgs"], dashboard_in_bytes=use["in_bytes"],
                   dashboard_out_msgs=use["out_msgs"])  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="steps of each tiny run")
    parser.add_argument(
        "--repeats", type=int, default=2, help="tiny runs with and without the dashboard, each"
    )
    parser.add_argument(
        "--page-steps", type=int, default=1000, help="steps of the synthetic run for page load"
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="run this run file (cut to --steps) instead of the tiny model, e.g. configs/arith_cpu.yaml",
    )
    harness.add_output_args(parser)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp_dir:
        tmp = Path(tmp_dir)
        rows.append(page_load(tmp, args.page_steps))
        model = None if args.config else build_tiny_model(tmp / "model", hidden=64, layers=2, heads=4)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for i in range(args.repeats):
            for dashboard in (False, True):
                name = f"run{i}{'d' if dashboard else ''}"
                runs[dashboard].append(tiny_run(tmp, model, name, args.steps, dashboard, args.config))
        for measured in runs.values():
            merged = {k: (round(statistics.mean(r[k] for r in measured), 4) if k != "case" else v)
                      for k, v in measured[0].items()}  # fmt: skip
            merged["step_s_each"] = [r["step_s"] for r in measured]
            rows.append(merged)
    harness.print_table(rows, ["case", "first_render_ms", "page_bytes", "step_s", "bus_s_per_step"])
    for row in rows:
        print(json.dumps(row))
    note = (
        "Shared 2-core machine: step times move by 10-20% between identical runs; compare within one result."
    )
    harness.emit(
        harness.make_result("dashboard", args, rows, METRICS, note=note), args.out, args.save_baseline
    )


if __name__ == "__main__":
    main()
