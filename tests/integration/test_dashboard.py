"""``areal-async dashboard`` of a finished run's store: read-only, token-protected off loopback, and
its Steps page for a 1,000-step run drawn in a real browser.

The store is synthetic (``tests/helpers/dashboard_run.py``): what a run leaves in JetStream, written
without workers, so the page's reads are the real ones on a run far longer than a test can train.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers.browser import browser_page, dashboard_process
from tests.helpers.dashboard_run import synthetic_run

STEPS = 1000
ROUTES = ("/", "/api/snapshot", "/api/events", "/static/app.js")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("dash"), "finished", STEPS)


def test_off_loopback_every_request_needs_the_token_and_nothing_but_get_is_served(finished_run: Path) -> None:
    """Bound to 0.0.0.0 the dashboard makes a token and prints it in its URL; a request without it
    (the event stream included) is 401, one with it (query, bearer, or the cookie the first answer
    sets) is served; POST, PUT, PATCH and DELETE are 405 on every route, with the token too."""
    with dashboard_process(finished_run, "--host", "0.0.0.0") as url:
        assert "?token=" in url
        base, token = url.split("?token=")
        with httpx.Client(base_url=base.replace("0.0.0.0", "127.0.0.1"), timeout=10) as client:
            for route in ROUTES:
                assert client.get(route).status_code == 401, route
            assert client.get("/api/snapshot", params={"token": token + "x"}).status_code == 401
            first = client.get("/", params={"token": token})
            assert first.status_code == 200 and "areal_dashboard=" in first.headers["set-cookie"]
            assert client.get("/api/snapshot").status_code == 200  # the cookie
            client.cookies.clear()
            bearer = {"Authorization": f"Bearer {token}"}
            snap = client.get("/api/snapshot", headers=bearer).json()
            assert snap["source"] == "store" and len(snap["steps"]["step"]) == STEPS
            with client.stream("GET", "/api/events", headers=bearer) as events:
                assert events.status_code == 200
                assert events.headers["content-type"].startswith("text/event-stream")
                assert next(events.iter_bytes()).startswith(b"retry:")
            for method in ("POST", "PUT", "PATCH", "DELETE"):
                for route in ROUTES:
                    assert client.request(method, route, headers=bearer).status_code == 405, (method, route)


def test_on_loopback_no_token_is_needed_and_the_url_says_how_to_tunnel(finished_run: Path) -> None:
    """The default bind is 127.0.0.1, served without a token to loopback names only (not to a page of
    another site that rebinds its name to 127.0.0.1); the printed lines carry the SSH hint."""
    with dashboard_process(finished_run) as url:
        assert url.startswith("http://127.0.0.1:") and "token" not in url
        assert httpx.get(url + "api/snapshot", timeout=10).status_code == 200
        rebound = httpx.get(url + "api/snapshot", headers={"Host": "attacker.example"}, timeout=10)
        assert rebound.status_code == 421  # a name rebound to 127.0.0.1 is not served
        printed = (finished_run.parent / "finished-dashboard.out").read_text()
        assert "ssh -N -L" in printed


def test_the_steps_page_of_a_1000_step_run_draws_every_step_and_every_page_shows_its_rows(
    finished_run: Path,
) -> None:
    """Steps: 1,000 points in the reward chart, held-out accuracy from the controller's record, the
    staleness bound; Fleet: the stored worker with its peak memory and restarts; Rollouts: the stored
    groups with reward and version span, an agent episode's turns and tool call, the reward filter;
    Dead letters: the dead letter and the refusal with reasons."""
    with dashboard_process(finished_run) as url, browser_page() as page:
        page.goto(url + "#steps")
        page.wait_for_function("window.__firstStepsRender !== undefined")
        assert page.inner_text("#steps-count") == f"{STEPS} steps"
        assert page.get_attribute("#chart-reward", "data-points") == str(STEPS)
        assert page.evaluate("state.data.max_staleness") == 2  # the bound line of the staleness chart
        assert page.evaluate("state.data.evals.length") == 11  # held-out accuracy at v0, v100, ... v1000

        page.click("nav a[data-page=fleet]")
        row = page.locator("#fleet-table tbody tr[data-role=trainer]")
        assert row.get_attribute("data-state") == "exited"
        assert "1.0 GiB" in row.inner_text() and row.locator("td").nth(9).inner_text() == "1"

        page.click("nav a[data-page=rollouts]")
        assert page.locator("#rollout-list .group").count() == 8
        newest = page.locator("#rollout-list .group").first  # an agent episode: its turns, its tool call
        assert "v999..v1000" in newest.inner_text()
        assert "3 turns: model 1 · context 1 · model 1" in newest.inner_text()
        assert newest.locator(".tool").first.inner_text().startswith("<tool_call>")
        page.fill("#f-rmin", "0.5")
        assert page.locator("#rollout-list .completion").count() == 8  # one rewarded completion a group

        page.click("nav a[data-page=letters]")
        text = page.inner_text("#letters-table")
        assert "undecodable msgpack: synthetic" in text and "refused: stale" in text
