"""The dashboard's JSON API: incremental points per run, status, samples, alerts, bad input."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from runlogs import reward, write_steps

from verl.dashboard.app import create_app
from verl.dashboard.server import resolve_runs
from verl.errors import ConfigError


@pytest.fixture
def runs(tmp_path):
    paths = []
    for run in range(2):
        path = tmp_path / "outputs" / "verl" / f"exp{run}" / "verl_logs.jsonl"
        path.parent.mkdir(parents=True)
        write_steps(path, run, 1, 6, total=10)
        paths.append(path)
    return paths


def test_points_are_sent_once_and_then_only_new_ones(runs):
    client = TestClient(create_app(runs, refresh_seconds=1))
    first = client.get("/api/data").json()
    assert [r["name"] for r in first["runs"]] == ["exp0", "exp1"]
    run0 = first["runs"][0]
    assert run0["reset"] is True
    assert run0["points"]["rollout/reward_mean"] == [[s, reward(0, s)] for s in range(1, 7)]
    assert run0["points"]["eval/accuracy"] == [[5, pytest.approx(0.55)]]
    assert run0["status"] == {**run0["status"], "state": "running", "last_step": 6, "total_steps": 10}
    cursors = ",".join(f"{r['generation']}:{r['cursor']}" for r in first["runs"])
    assert client.get(f"/api/data?cursors={cursors}").json()["runs"][0]["points"] == {}

    write_steps(runs[0], 0, 7, 10, total=10, finish=True)
    second = client.get(f"/api/data?cursors={cursors}").json()
    run0, run1 = second["runs"]
    assert run0["reset"] is False and run1["points"] == {}
    assert run0["points"]["rollout/reward_mean"] == [[s, reward(0, s)] for s in range(7, 11)]
    assert run0["status"]["state"] == "finished" and run0["status"]["reason"] == "completed"
    assert second["alerts"][0]["rule"] == "kl_far_above_target" and second["alerts"][0]["run"] == "exp0"
    assert second["samples"][0]["response"] == "<answer run0 step10>"  # newest first


def test_a_rewritten_log_resets_the_browser(runs):
    client = TestClient(create_app(runs))
    first = client.get("/api/data").json()["runs"][0]
    runs[0].write_text("")
    write_steps(runs[0], 0, 1, 2, total=10)
    again = client.get(f"/api/data?cursors={first['generation']}:{first['cursor']}").json()["runs"][0]
    assert again["reset"] is True and again["generation"] == first["generation"] + 1
    assert again["points"]["rollout/reward_mean"] == [[1, reward(0, 1)], [2, reward(0, 2)]]


def test_page_assets_are_local_and_headers_strict(runs):
    client = TestClient(create_app(runs))
    page = client.get("/")
    assert page.status_code == 200 and "/static/uPlot.iife.min.js" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # nothing loaded from another host
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/static/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot")
    assert client.get("/api/config").json()["runs"][1]["name"] == "exp1"
    assert client.get("/api/data?cursors=0:1,0:1,0:1").status_code == 400  # three cursors for two runs
    assert client.get("/api/data?cursors=a:b").status_code == 400


def test_run_directories_and_directories_of_runs_resolve(runs, tmp_path):
    assert resolve_runs([runs[0].parent]) == [runs[0]]
    assert resolve_runs([tmp_path / "outputs"]) == runs  # every run below a directory
    assert resolve_runs([runs[0].parent, runs[0]]) == [runs[0]]  # duplicates dropped
    with pytest.raises(ConfigError, match="no training log found"):
        resolve_runs([tmp_path / "nope"])


def test_a_busy_port_and_bad_refresh_are_clear_errors(runs):
    import socket

    from verl.dashboard.server import check_port, serve
    from verl.errors import VerlError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(VerlError, match=f"cannot listen on 127.0.0.1:{port}.*pass another --port"):
            check_port("127.0.0.1", port)
    with pytest.raises(ConfigError, match="--port must be between 1 and 65535"):
        check_port("127.0.0.1", 70000)
    with pytest.raises(ConfigError, match="--refresh must be > 0"):
        serve([runs[0]], refresh_seconds=0)
