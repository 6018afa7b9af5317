"""Driving the dashboard in a headless browser: the browser test and ``python -m verl.dashboard.browser``.

    python -m verl.dashboard.browser --log_dir RUN_A RUN_B --out docs/dashboard.png

starts the dashboard on a free local port, opens it in headless Chromium (Debian's ``chromium`` package, driven by
Playwright; no browser download), waits until the charts have drawn every run's points, and saves a full-page
screenshot.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from verl.dashboard.app import create_app
from verl.dashboard.server import resolve_runs
from verl.errors import MissingDependencyError
from verl.tracking.follow import row_kind
from verl.utils.log import read_jsonl
from verl.utils.net import running_app

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A Playwright ``Browser`` on the system Chromium."""
    executable = find_chromium()
    if executable is None:
        raise MissingDependencyError("chromium", "the headless dashboard browser",
                                     "apt-get install -y chromium chromium-driver")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise MissingDependencyError("playwright", "the headless dashboard browser") from None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def wait_for_points(page: Any, panel: str, points_per_run: list[int], timeout_ms: int = 30000) -> None:
    """Wait until chart ``panel`` holds at least ``points_per_run[i]`` non-null points for run series ``i``."""
    page.wait_for_function(
        """([panel, want]) => {
            const chart = window.verlDashboard && window.verlDashboard.charts[panel];
            if (!chart || chart.data.length - 1 < want.length) return false;
            return want.every((n, i) => chart.data[i + 1].filter((v) => v !== null).length >= n);
        }""",
        arg=[panel, points_per_run], timeout=timeout_ms,
    )


def screenshot(log_dirs: list[Path], out: Path, width: int = 1400, height: int = 1000, full_page: bool = True) -> Path:
    """Save a screenshot of the dashboard showing ``log_dirs`` once every run's reward curve is drawn."""
    logs = resolve_runs(log_dirs)
    expected = [sum(1 for r in read_jsonl(p) if row_kind(r) == "metrics" and r.get("scope") == "rollout"
                    and "reward_mean" in r) for p in logs]
    app = create_app(logs, refresh_seconds=1.0)
    with running_app(app, name="dashboard") as url, headless_chromium() as browser:
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url)
        wait_for_points(page, "reward", expected)
        page.wait_for_timeout(300)  # let the last frame paint before the capture
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=full_page)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Screenshot the verl dashboard in headless Chromium.")
    parser.add_argument("--log_dir", nargs="+", required=True, type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--viewport-only", action="store_true", help="capture the window, not the whole page")
    args = parser.parse_args(argv)
    print(screenshot(args.log_dir, args.out, args.width, args.height, full_page=not args.viewport_only))


if __name__ == "__main__":
    main()
