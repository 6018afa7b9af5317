"""Agent sessions under real Locust against the real service: ``AgentUser`` runs the model's tool calls
client-side and sends the results back; the CSVs hold one turn entry per HTTP request and the session entries per
finished session, and the capacity report turns them into sessions/s within a session-latency SLO.

The service serves the shipped tool-using warm start at temperature 1, so some sessions call the calculator (two
or more turns) and some answer at once (one turn); both show in the numbers.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from loadtest.render import make_report
from loadtest.run import local_service, locust_command, run_locust
from loadtest.settings import AGENT_MODEL, AGENT_PROMPTS, SLO, LoadTestConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(170)]

TURN = "/v1/chat/completions [agent turn]"


def read_stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as handle:
        return {row["Name"]: row for row in csv.DictReader(handle)}


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent")
    with local_service(out / "server.log", env={"VERL_SERVE_MODEL": AGENT_MODEL, "VERL_SERVE_ENGINE": "transformers",
                                                "VERL_SERVE_MAX_OUTPUT_TOKENS": "128"},
                       startup_timeout_s=120) as url:
        config = LoadTestConfig(out_dir=out, step_users="1,2", step_time_s=6, step_settle_s=2, user_mix="agent",
                                max_tokens=96, extra_locust_args=["--num-prompts", "32", "--temperature", "1.0"])
        prefix = out / "locust"
        command = locust_command(url, prefix, config.plan(), config)
        assert command[command.index("--prompt-file") + 1] == AGENT_PROMPTS
        code = run_locust(command, 90, out / "locust.log")
        assert code == 0, (out / "locust.log").read_text()[-3000:]
    return prefix


def test_sessions_turns_and_tool_calls_add_up(agent_run):
    stats = read_stats(agent_run)
    turns, sessions = int(stats[TURN]["Request Count"]), int(stats["session_latency_ms"]["Request Count"])
    assert int(stats[TURN]["Failure Count"]) == 0, Path(f"{agent_run}_failures.csv").read_text()
    assert sessions > 0 and int(stats["session_turns"]["Request Count"]) == sessions
    # Every turn is a request with its LLM entries; the sessions' turns add up to the turn requests (a session
    # still running when the users stop has turns but no session entry, hence <=).
    assert int(stats["e2e_latency_ms"]["Request Count"]) == turns
    mean_turns = float(stats["session_turns"]["Average Response Time"])
    assert round(sessions * mean_turns) <= turns  # (the CSV's mean times the count, up to float rounding)
    calls = float(stats["session_tool_calls"]["Average Response Time"])
    assert calls > 0 and mean_turns > 1  # some sessions called the tool and came back for the answer
    assert mean_turns <= 4  # --max-turns' default
    # Every answer says whether it was cut at max_tokens (1/0), every session whether it called no tool.
    cut = stats[f"answers_cut_at_max_tokens {TURN}"]
    assert int(cut["Request Count"]) == turns and 0 <= float(cut["Average Response Time"]) <= 1
    no_call = stats["sessions_without_tool_call"]
    assert int(no_call["Request Count"]) == sessions and float(no_call["Average Response Time"]) < 1
    # A session lasts at least as long as its turns: its mean exceeds the mean turn's.
    assert float(stats["session_latency_ms"]["Average Response Time"]) > float(stats[TURN]["Average Response Time"])


def test_the_capacity_report_counts_sessions_within_the_session_slo(agent_run):
    loose, paths = make_report(agent_run, agent_run.parent / "loose", SLO(p95_ms=60_000, session_p95_ms=60_000),
                               plots=False)
    steps = loose["steps"]
    assert [s["users"] for s in steps] == [1, 2]
    assert all(s["sessions_per_s"] > 0 and s["session_latency_p95_ms"] > 0 for s in steps)
    cap = loose["capacity"]
    assert cap["max_users_within_slo"] == 2 and cap["sessions_per_s_at_max"] == steps[-1]["sessions_per_s"]
    assert "agent sessions/s" in paths["markdown"].read_text() and "session p95 ms" in paths["markdown"].read_text()
    strict, _ = make_report(agent_run, agent_run.parent / "strict", SLO(p95_ms=60_000, session_p95_ms=1),
                            plots=False)
    assert strict["capacity"]["max_users_within_slo"] is None
    assert "session p95" in strict["steps"][0]["why_not"][0]
