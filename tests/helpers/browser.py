"""Headless Chromium for dashboard tests, the screenshot script and the page-load benchmark.

Playwright drives Debian's ``chromium`` (``apt-get install chromium``; Playwright's own browser
download is not used). ``dashboard_process`` runs ``areal-async dashboard`` for a run file and
yields its URL once it listens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def chromium_path() -> str | None:
    return os.environ.get("AREAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def browser_page(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A Playwright page of a headless Chromium; raises RuntimeError naming what to install."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise RuntimeError("playwright is missing: pip install 'areal-async[test]'") from None
    exe = chromium_path()
    if exe is None:
        raise RuntimeError("chromium is missing: apt-get install -y chromium (or set AREAL_CHROMIUM)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=exe,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


@contextmanager
def dashboard_process(config: Path, *args: str, timeout: float = 60.0) -> Iterator[str]:
    """``areal-async dashboard --config CONFIG --port 0`` in the background; yields its URL."""
    from areal_async.run_file import load_config
    from workers.dashboard import url_of

    run_dir = load_config(config, []).run_dir
    (run_dir / "dashboard.url").unlink(missing_ok=True)
    log = run_dir.parent / f"{run_dir.name}-dashboard.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "dashboard", "--config", str(config), "--port", "0", *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + timeout
        while (url := url_of(run_dir)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
