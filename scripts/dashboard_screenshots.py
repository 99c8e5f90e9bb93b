"""Regenerate the dashboard screenshots in docs/ from a tiny run on this machine.

    python scripts/dashboard_screenshots.py [--out docs] [--steps 40]

Warm-starts the tiny model of the end-to-end tests (cached under .cache/dashboard-shots), runs
``areal-async run --dashboard`` on mode_select, and, while it trains, photographs each page in
headless Chromium (Debian's ``chromium``): Fleet just after a reward worker was killed (its row
dead, the replacement live), Dead letters after one undecodable payload was sent as the run's
``ops`` user (the reward worker dead-letters it), Rollouts, and Steps near the end of the run.
Takes about two minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.tiny_task import warm_start_mode_select  # noqa: E402
from tests.helpers.browser import browser_page  # noqa: E402
from tests.helpers.jobs import finish_job, start_job, steps_done, tiny_config  # noqa: E402
from workers.dashboard import url_of  # noqa: E402

WAIT_MS = 300_000


def _send_garbage(run_dir: Path, run: str) -> None:
    """One payload that is not an event, on ``rollout.generated``: the reward worker dead-letters it."""
    import anyio

    from bus import ConnectOptions, connect
    from bus.embedded import read_credentials

    async def send() -> None:
        url = (run_dir / "nats.url").read_text().strip()
        password = (read_credentials(run_dir / "nats") or {})["ops"]
        bus = await connect(ConnectOptions(url=url, name="screenshots", user="ops", password=password), run)
        try:
            await bus.js.publish(bus.subjects.rollout_generated, b"\xc1 not msgpack")
        finally:
            await bus.close()

    # Playwright's sync API holds this thread's event loop: send from a thread of its own.
    sender = threading.Thread(target=anyio.run, args=(send,), kwargs={"backend": "asyncio"})
    sender.start()
    sender.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cache = REPO / ".cache" / "dashboard-shots"
    import torch

    torch.set_num_threads(2)
    model = warm_start_mode_select(cache / "model")
    name = "tiny-dashboard"
    tmp = cache / "runs"
    run_dir = tmp / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = tiny_config(
        tmp, model, name, rollout__group_size=8, trainer__total_steps=args.steps, trainer__batch_size=8,
        trainer__eval_every=5, dataset__eval_size=16, checkpoint__every_steps=10,
        bus__heartbeat_interval_s=0.5, bus__heartbeat_ttl_s=3,
    )  # fmt: skip
    started = time.monotonic()
    proc = start_job(cfg, flags=("--dashboard", "--dashboard-port", "0"))
    try:
        while (url := url_of(run_dir)) is None:
            assert proc.poll() is None, "the run stopped before its dashboard started"
            time.sleep(0.2)
        with browser_page(1400, 820) as page:
            page.goto(url + "#fleet")
            while steps_done(run_dir) < args.steps // 4:
                time.sleep(0.5)
            victim = page.get_attribute("#fleet-table tr[data-role=reward][data-state=live]", "data-pid")
            assert victim is not None
            os.kill(int(victim), signal.SIGKILL)
            page.wait_for_selector(f"#fleet-table tr[data-pid='{victim}'][data-state=dead]", timeout=WAIT_MS)
            page.wait_for_selector(
                f"#fleet-table tr[data-role=reward][data-state=live]:not([data-pid='{victim}'])",
                timeout=WAIT_MS,
            )
            page.screenshot(path=args.out / "dashboard-fleet.png")
            _send_garbage(run_dir, name)
            page.click("nav a[data-page=letters]")
            page.wait_for_selector("#letters-table tr[data-kind='dead letter']", timeout=WAIT_MS)
            page.screenshot(path=args.out / "dashboard-letters.png")
            page.click("nav a[data-page=rollouts]")
            page.select_option("#f-kind", "train")  # a training group: all its completions
            page.wait_for_selector("#rollout-list .group", timeout=WAIT_MS)
            page.screenshot(path=args.out / "dashboard-rollouts.png")
            page.click("nav a[data-page=steps]")
            page.wait_for_function(
                f"Number(document.querySelector('#chart-reward').dataset.points) >= {args.steps - 2}",
                timeout=WAIT_MS,
            )
            page.screenshot(path=args.out / "dashboard-steps.png")
    finally:
        res = finish_job(proc, run_dir, started, timeout=600)
    print(f"run ended ({res.returncode}) after {res.seconds:.0f} s; screenshots in {args.out}")


if __name__ == "__main__":
    main()
