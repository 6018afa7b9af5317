"""The dashboard in real headless Chromium: the page loads, charts draw every run's points, new points appear."""

from __future__ import annotations

import pytest
from runlogs import reward, write_steps

from verl.dashboard.app import create_app
from verl.dashboard.browser import find_chromium, headless_chromium, wait_for_points
from verl.utils.net import running_app

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    find_chromium() is None, reason="needs the system Chromium: apt-get install -y chromium chromium-driver"
)]

RUN_COLORS = [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)]  # the page's first two series colours

COUNT_PIXELS = """([panel, rgb]) => {
    const chart = window.verlDashboard.charts[panel];
    const ctx = chart.ctx, canvas = ctx.canvas;
    const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < data.length; i += 4) {
        const near = [0, 1, 2].every((c) => Math.abs(data[i + c] - rgb[c]) < 12);
        if (near) n += 1;
    }
    return n;
}"""


def test_dashboard_renders_runs_and_follows_a_growing_log(tmp_path):
    logs = []
    for run in range(2):
        path = tmp_path / f"run{run}" / "verl_logs.jsonl"
        path.parent.mkdir()
        write_steps(path, run, 1, 8, total=12)
        logs.append(path)
    app = create_app(logs, refresh_seconds=0.3)
    with running_app(app) as url, headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(str(exc)))
        page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
        page.goto(url)

        wait_for_points(page, "reward", [8, 8])
        data = page.evaluate("window.verlDashboard.charts.reward.data")
        assert data[0] == list(range(1, 9))
        assert data[1] == pytest.approx([reward(0, s) for s in range(1, 9)])
        assert data[2] == pytest.approx([reward(1, s) for s in range(1, 9)])
        labels = page.evaluate("window.verlDashboard.charts.reward.series.slice(1).map((s) => s.label)")
        assert labels == ["run0", "run1"]
        for rgb in RUN_COLORS:  # both runs' lines are actually painted on the canvas
            assert page.evaluate(COUNT_PIXELS, ["reward", list(rgb)]) > 50
        for panel in ("kl", "policy_loss", "entropy", "response_length", "throughput", "eval_accuracy"):
            wait_for_points(page, panel, [1, 1])
        wait_for_points(page, "mismatch", [8])
        series = page.evaluate("window.verlDashboard.charts.mismatch.series.slice(1).map((s) => s.label)")
        assert series == ["run0"]  # run1 logged no rollout_corr/k3_kl: no line for it
        wait_for_points(page, "probs_diff", [8, 8])  # run0 by TRL's name, run1 by verl's
        for metric in ("reward_mean", "length_mean", "turns_mean", "error_rate", "step_seconds_mean"):
            wait_for_points(page, f"env-CalculatorEnv-{metric}", [8])  # run0's environment, a panel per metric
        assert page.evaluate("window.verlDashboard.charts['env-CalculatorEnv-reward_mean'].data[1]") == \
            pytest.approx([0.2 + 0.01 * s for s in range(1, 9)])
        assert "Environment CalculatorEnv: step latency" in page.locator("#charts").inner_text()
        wait_for_points(page, "task-humaneval-pass_at_1", [1])  # run0's eval task (trainer.eval_tasks)
        assert "Eval task humaneval: pass@1" in page.locator("#charts").inner_text()
        assert not page.evaluate("window.verlDashboard.panels.some((p) => p.task === 'clean')")  # eval/clean/*
        eval_steps = page.evaluate("window.verlDashboard.charts.eval_accuracy.data[0]")
        assert eval_steps == [5]
        assert page.locator("#samples tbody tr").count() == 16
        assert page.locator("#samples tbody").inner_text().count("<answer run") == 16  # shown as text, not HTML
        assert "step 8/12" in page.locator("#runs").inner_text()

        write_steps(logs[0], 0, 9, 12, total=12, finish=True)  # the "trainer" goes on
        wait_for_points(page, "reward", [12, 8])
        data = page.evaluate("window.verlDashboard.charts.reward.data")
        assert data[0] == list(range(1, 13))
        assert data[1][8:] == pytest.approx([reward(0, s) for s in range(9, 13)])
        assert data[2][8:] == [None] * 4  # run1 has not reached these steps
        page.wait_for_function("document.querySelector('#alerts tbody tr') !== null")
        assert "KL <b>high</b>" in page.locator("#alerts tbody").inner_text()
        assert "finished" in page.locator("#runs").inner_text()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert problems == []  # no script errors, no CSP violations
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
