"""The dashboard in a real browser (headless Chromium) on a live tiny run, then on the finished one.

One run serves every assertion a person would make by looking: ``areal-async run --dashboard``
prints the URL; the Fleet page lists every role live; a reward worker killed with SIGKILL is shown
dead and its replacement live with one restart; the Steps chart grows while the run trains,
without a reload; a scored rollout's prompt, completion text and reward appear; after the run, the
dashboard of the finished run (read from its JetStream store) shows every step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.browser import browser_page, dashboard_process
from tests.helpers.jobs import finish_job, read_steps, start_job, tiny_config
from workers.dashboard import url_of
from workers.roles import run_roles

WAIT_MS = 120_000


def _fleet_rows(page) -> list[dict[str, str]]:
    return page.eval_on_selector_all(
        "#fleet-table tbody tr",
        "rows => rows.map(r => ({role: r.dataset.role, state: r.dataset.state, pid: r.dataset.pid,"
        " restarts: r.children[9].textContent}))",
    )


@pytest.mark.timeout(600)
def test_dashboard_shows_a_live_run_a_killed_worker_replaced_and_the_finished_run(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Fleet, Steps, Rollouts and Dead letters of a live run update without a reload; a killed worker
    turns dead and its replacement shows up; the stopped run's store shows every step.

    The run is long enough that it cannot end while the page is watched, however slow the machine:
    once everything is seen it is stopped with SIGINT, as a user stops a run."""
    name, total = "dash", 1000
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        name,
        rollout__group_size=4,
        trainer__total_steps=total,
        trainer__batch_size=4,
        trainer__eval_every=4,
        dataset__eval_size=4,
        checkpoint__every_steps=4,
        bus__heartbeat_interval_s=0.5,
        bus__heartbeat_ttl_s=3,
    )
    run_dir = tmp_path / name
    started = time.monotonic()
    proc = start_job(cfg, flags=("--dashboard", "--dashboard-port", "0"))
    try:
        deadline = time.monotonic() + 120
        while (url := url_of(run_dir)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "the run's dashboard did not start"
            time.sleep(0.1)
        with browser_page() as page:
            page.goto(url + "#fleet")
            roles = list(run_roles(False))
            page.wait_for_function(
                """roles => roles.every(role => [...document.querySelectorAll('#fleet-table tbody tr')]
                     .some(r => r.dataset.role === role && r.dataset.state === 'live'))""",
                arg=roles,
                timeout=WAIT_MS,
            )

            victim = next(r for r in _fleet_rows(page) if r["role"] == "reward" and r["state"] == "live")
            page.click("nav a[data-page=steps]")
            page.wait_for_selector("#chart-reward[data-points]", state="attached")
            first = int(page.get_attribute("#chart-reward", "data-points"))

            os.kill(int(victim["pid"]), signal.SIGKILL)
            page.wait_for_function(
                """pid => [...document.querySelectorAll('#fleet-table tbody tr')]
                     .some(r => r.dataset.pid === pid && r.dataset.state === 'dead')""",
                arg=victim["pid"],
                timeout=WAIT_MS,
            )
            dead = page.locator(f"#fleet-table tr[data-pid='{victim['pid']}']")
            assert "state-dead" in (dead.get_attribute("class") or "")  # drawn to stand out
            page.wait_for_function(
                """pid => [...document.querySelectorAll('#fleet-table tbody tr')].some(r =>
                     r.dataset.role === 'reward' && r.dataset.pid !== pid && r.dataset.state === 'live'
                     && r.children[9].textContent === '1')""",
                arg=victim["pid"],
                timeout=WAIT_MS,
            )

            # the chart grows as steps arrive, on the page loaded before them (no reload)
            page.wait_for_function(
                f"Number(document.querySelector('#chart-reward').dataset.points) >= {first + 2}",
                timeout=WAIT_MS,
            )
            assert page.inner_text("#steps-count") != f"{first} steps"

            page.click("nav a[data-page=rollouts]")
            page.wait_for_selector("#rollout-list .group .completion", timeout=WAIT_MS)
            prompt = page.inner_text("#rollout-list .group .prompt")
            assert "+" in prompt and prompt.strip().endswith("="), prompt  # mode_select: "3+4="
            reward = page.get_attribute("#rollout-list .group .completion", "data-reward")
            assert reward in ("0", "1"), reward  # arithmetic_strict: 0 or 1
            completion = page.locator("#rollout-list .group .completion").first
            assert completion.locator("span").nth(0).inner_text().startswith("r ")  # its reward
            assert completion.locator("span").nth(1).inner_text().endswith(" tok")  # its token count
            assert completion.locator("pre").count() == 1  # its text
            assert page.locator("#rollout-list .group").count() >= 1
        proc.send_signal(signal.SIGINT)
    finally:
        res = finish_job(proc, run_dir, started, timeout=300)
    assert res.returncode == 130, res.output[-3000:]  # stopped by the SIGINT, every process cleanly
    assert f"dashboard of run {name}: http://127.0.0.1:" in res.output
    assert "ssh -N -L" in res.output
    stored = len({ev.step for ev in read_steps(run_dir, name)})

    with dashboard_process(cfg) as url, browser_page() as page:
        page.goto(url + "#steps")
        page.wait_for_function("window.__firstStepsRender !== undefined", timeout=WAIT_MS)
        assert page.inner_text("#steps-count") == f"{stored} steps"
        assert int(page.get_attribute("#chart-reward", "data-points")) == stored
        assert "finished run" in page.inner_text("#status")
