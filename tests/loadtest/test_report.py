"""loadtest/report.py on hand-written Locust CSVs: per-step numbers, SLO search and planning point by hand."""

from __future__ import annotations

import json
import math

import pytest

from loadtest.render import make_report, summary_text
from loadtest.report import FleetPlan, build_report, capacity, histogram_quantile, parse_server_metrics, resolve_prefix
from loadtest.settings import SLO
from tests.loadtest.locust_csv import history_row, stats_row, write_run
from verl.errors import DataError

GEN, CHAT = "/generate", "/v1/chat/completions [stream]"

# A stepped run, 1 -> 2 -> 4 users, 4 history rows per step, 2 s percentile window, a trailing row after the users
# stopped. Columns: timestamp, users, /generate total, /generate failures, chat total.
TIMELINE = [
    (99, 0, 0, 0, 0),
    (100, 1, 2, 0, 1), (101, 1, 4, 0, 2), (102, 1, 6, 0, 3), (103, 1, 8, 0, 4),
    (104, 2, 11, 0, 6), (105, 2, 14, 0, 8), (106, 2, 17, 0, 10), (107, 2, 20, 0, 12),
    (108, 4, 24, 1, 15), (109, 4, 28, 2, 18), (110, 4, 32, 2, 21), (111, 4, 36, 3, 24),
    (112, 0, 37, 3, 24),
]
# Percentiles Locust wrote at each step's last row (the step's window): e2e p50/p95/p99 and TTFT p50/p95/p99.
E2E_AT = {103: (50, 80, 90), 107: (60, 120, 150), 111: (90, 400, 500)}
TTFT_AT = {103: (20, 30, 35), 107: (25, 45, 50), 111: (40, 90, 95)}


def tokens_mean(ts: int) -> float:
    return 4.0 if ts <= 103 else 5.0 if ts <= 109 else 6.0


def history() -> list[list]:
    rows = []
    for ts, users, gen, gen_fail, chat in TIMELINE:
        ok = gen + chat - gen_fail
        e2e, ttft = E2E_AT.get(ts, (55, 85, 95)), TTFT_AT.get(ts, (22, 33, 44))
        rows += [
            history_row(ts, users, "POST", GEN, gen, gen_fail, 100.0, 100, 150, 160),
            history_row(ts, users, "POST", CHAT, chat, 0, 110.0, 110, 160, 170),
            history_row(ts, users, "LLM", "e2e_latency_ms", ok, 0, 90.0, *e2e),
            history_row(ts, users, "LLM", "output_tokens", ok, 0, tokens_mean(ts), 5, 6, 7),
            history_row(ts, users, "LLM", "ttft_ms", chat, 0, 30.0, *ttft),
            history_row(ts, users, "", "Aggregated", gen + chat + 2 * ok + chat, gen_fail, 70.0, 60, 140, 300),
        ]
    return rows


STATS = [
    stats_row("POST", GEN, 37, 3, 100.0, 100, 150, 160),
    stats_row("POST", CHAT, 24, 0, 110.0, 110, 160, 170),
    stats_row("LLM", "e2e_latency_ms", 58, 0, 90.0, 80, 300, 450),
    stats_row("LLM", "output_tokens", 58, 0, 6.0, 6, 7, 7),
    stats_row("LLM", "ttft_ms", 24, 0, 30.0, 25, 80, 90),
    stats_row("", "Aggregated", 201, 3, 70.0, 60, 140, 300),
]
FAILURES = [["POST", GEN, "HTTP 429: the server is at capacity", 3, "", ""]]
INFO = {"plan": {"levels": [1, 2, 4], "step_time_s": 4, "settle_s": 2, "window_s": 2}, "percentile_window_s": 2}


@pytest.fixture()
def prefix(tmp_path):
    return write_run(tmp_path / "csv", STATS, history(), FAILURES, INFO)


def test_steps_by_hand(prefix):
    report = build_report(prefix, SLO(p95_ms=200, max_failure_rate=0.05))
    steps = report["steps"]
    assert [s["users"] for s in steps] == [1, 2, 4]
    # Requests: differences of the HTTP totals at each step's last row (the trailing row counts for the last step).
    assert [s["requests"] for s in steps] == [12, 32 - 12, 61 - 32]
    assert [s["failures"] for s in steps] == [0, 0, 3]
    assert steps[2]["failure_rate"] == pytest.approx(3 / 29)
    # Requests/s over the last 2 s: (12-6)/2, (32-22)/2, (60-46)/2.
    assert [s["requests_per_s"] for s in steps] == [3.0, 5.0, 7.0]
    assert [s["window_s"] for s in steps] == [2, 2, 2]
    # Output tokens/s: (12*4 - 6*4)/2, (32*5 - 22*5)/2, (57*6 - 44*5)/2.
    assert [s["output_tokens_per_s"] for s in steps] == [12.0, 25.0, 61.0]
    assert [(s["latency_p50_ms"], s["latency_p95_ms"], s["latency_p99_ms"]) for s in steps] == list(E2E_AT.values())
    assert [(s["ttft_p50_ms"], s["ttft_p95_ms"]) for s in steps] == [v[:2] for v in TTFT_AT.values()]
    totals = report["totals"]
    assert totals["http_requests"] == 61 == totals["steps_requests"] == totals["history_http_requests"]
    assert totals["locust_aggregated_requests"] == 201
    assert totals["llm_entries"] == 58 + 58 + 24
    assert totals["output_tokens"] == 58 * 6
    assert totals["duration_s"] == 111 - 100
    assert report["window_s"] == 2
    assert report["notes"] == []


def test_users_caught_spawning_between_levels_are_not_a_step(tmp_path, monkeypatch):
    """With several Locust processes a history row can catch a level's users half spawned (3 on the way from 2 to
    4, 1 on the way to 2 at the start): with the plan's levels known those rows are no step of their own; their
    requests count toward the next level, and a note says so."""
    import tests.loadtest.test_report as this

    timeline = [(100, 1, 1, 0, 0), *[(ts + 1, *rest) for ts, *rest in TIMELINE[1:]]]  # a transient 1 first
    timeline = [(ts, 3 if ts == 109 else users, *rest) for ts, users, *rest in timeline]  # and 3 on the way to 4
    monkeypatch.setattr(this, "TIMELINE", [(99, 0, 0, 0, 0), *timeline])
    info = {**INFO, "plan": {**INFO["plan"], "levels": [2, 4]}}
    report = build_report(write_run(tmp_path / "csv", STATS, history(), FAILURES, info), SLO())
    assert [s["users"] for s in report["steps"]] == [2, 4]
    # The 1-user rows (ts 100-104) and the 3-user row (ts 109) belong to the next level: 2 counts to its last row.
    assert [s["requests"] for s in report["steps"]] == [32, 61 - 32]
    assert report["totals"]["steps_requests"] == report["totals"]["http_requests"]
    assert any("spawning between levels" in note for note in report["notes"])
    without_plan = build_report(write_run(tmp_path / "plain", STATS, history(), FAILURES, None), SLO())
    assert [s["users"] for s in without_plan["steps"]] == [1, 2, 3, 4]


def test_capacity_and_planning_point(prefix):
    # p95 200 ms, failures <= 5%: the 4-user step misses both (400 ms, 10.3%), so capacity is 2 users.
    report = build_report(prefix, SLO(p95_ms=200, max_failure_rate=0.05))
    assert [s["meets_slo"] for s in report["steps"]] == [True, True, False]
    assert report["steps"][2]["why_not"] == ["p95 400 ms > 200 ms", "failure rate 10.34% > 5.00%"]
    cap = report["capacity"]
    assert cap["max_users_within_slo"] == 2 and cap["first_failing_users"] == 4
    assert cap["planning_users"] == 1  # floor(2 * 0.8)
    assert cap["rps_at_max"] == 5.0 and cap["planning_rps"] == pytest.approx(4.0)

    # A loose SLO: every level meets it; 4 users -> plan floor(3.2) = 3 users, 0.8 * 7 req/s.
    cap = build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.2))["capacity"]
    assert (cap["max_users_within_slo"], cap["planning_users"], cap["all_levels_within_slo"]) == (4, 3, True)
    assert cap["planning_rps"] == pytest.approx(5.6)
    # 50% headroom instead of 20%: 2 users, 3.5 req/s.
    cap = build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.2, headroom=0.5))["capacity"]
    assert (cap["planning_users"], cap["planning_rps"]) == (2, pytest.approx(3.5))
    # Only the failure rate breaks the 4-user level.
    report = build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.05))
    assert report["capacity"]["max_users_within_slo"] == 2
    assert report["steps"][2]["why_not"] == ["failure rate 10.34% > 5.00%"]
    # Even 1 user misses a 70 ms p95: no capacity, plan 0.
    cap = build_report(prefix, SLO(p95_ms=70))["capacity"]
    assert (cap["max_users_within_slo"], cap["planning_users"], cap["first_failing_users"]) == (None, 0, 1)
    # A TTFT SLO of 40 ms: 2 users have TTFT p95 45 ms -> capacity 1, plan floor(0.8) = 0.
    report = build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.2, ttft_p95_ms=40))
    assert report["capacity"]["max_users_within_slo"] == 1 and report["capacity"]["planning_users"] == 0
    assert report["steps"][1]["why_not"] == ["TTFT p95 45 ms > 40 ms"]


def _step(users: int, ok: bool, rps: float = 10.0) -> dict:
    return {"users": users, "why_not": [] if ok else ["too slow"], "requests_per_s": rps}


def test_capacity_stops_at_first_failing_level():
    slo = SLO()
    # A lucky higher level after a failing one never counts.
    cap = capacity([_step(1, True), _step(2, False), _step(4, True)], slo)
    assert (cap["max_users_within_slo"], cap["first_failing_users"]) == (1, 2)
    # A level tested twice must pass both times; steps come in any order.
    cap = capacity([_step(2, True), _step(1, True), _step(2, False)], slo)
    assert cap["max_users_within_slo"] == 1
    # 10 users hold, 12 do not: plan floor(10 * 0.8) = 8 users and 0.8 x the mean rps measured at 10 users.
    steps = [_step(1, True), _step(2, True), _step(4, True), _step(8, True), _step(10, True, 40.0),
             _step(10, True, 50.0), _step(12, False)]
    cap = capacity(steps, slo)
    assert (cap["max_users_within_slo"], cap["planning_users"]) == (10, 8)
    assert cap["rps_at_max"] == 45.0 and cap["planning_rps"] == pytest.approx(36.0)
    assert capacity([_step(5, True)], slo)["planning_users"] == 4  # 5 * 0.8 = 4.000000000000001 in floats


def test_report_files(prefix, tmp_path):
    out = tmp_path / "report"
    report, paths = make_report(prefix, out, SLO(p95_ms=200, max_failure_rate=0.05))
    assert set(paths) == {"json", "markdown", "html", "latency", "throughput"}
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(report, default=str))
    md = paths["markdown"].read_text()
    assert "**Capacity: 2 users** within the SLO (5 requests/s)." in md
    assert "**Plan for 1 users** per replica (80% of capacity, 20% headroom; about 4 requests/s)." in md
    assert "The next level, 4 users, misses it: p95 400 ms > 200 ms; failure rate 10.34% > 5.00%." in md
    assert "| 4 | 29 | 7 | 10.34% | 90 | 400 | 500 | 40 | 90 | 61 | no: " in md
    assert "HTTP 429: the server is at capacity" in md and "![Latency vs users](latency_vs_users.png)" in md
    html = paths["html"].read_text()
    assert "<b>Capacity: 2 users</b>" in html and "<img src='throughput_vs_users.png'" in html
    for key in ("latency", "throughput"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_prefix_forms(prefix, tmp_path):
    assert resolve_prefix(f"{prefix}_stats.csv") == prefix
    assert resolve_prefix(f"{prefix}_stats_history.csv") == prefix
    assert resolve_prefix(prefix.parent) == prefix
    with pytest.raises(DataError, match="exactly one Locust"):
        resolve_prefix(tmp_path)  # no *_stats.csv directly inside


def test_without_llm_entries_uses_aggregated(tmp_path):
    # Another locustfile: only HTTP entries. Latency comes from the Aggregated row; no TTFT or tokens/s.
    rows = []
    for ts, users, total in ((10, 1, 5), (11, 1, 10), (12, 2, 20), (13, 2, 30)):
        rows += [history_row(ts, users, "GET", "/", total, 0, 50.0, 40, 90, 99),
                 history_row(ts, users, "", "Aggregated", total, 0, 50.0, 40 + ts, 90 + ts, 99 + ts)]
    prefix = write_run(tmp_path, [stats_row("GET", "/", 30, 0, 50.0), stats_row("", "Aggregated", 30, 0, 50.0)],
                       rows)
    report = build_report(prefix)
    assert [(s["users"], s["requests"], s["latency_p95_ms"]) for s in report["steps"]] == [(1, 10, 101), (2, 20, 103)]
    assert report["steps"][0]["ttft_p95_ms"] is None and report["steps"][0]["output_tokens_per_s"] is None
    assert report["slo"]["latency_metric"] == "Aggregated"
    assert any("default 10 s percentile window" in n for n in report["notes"])
    # Window 10 s is longer than these steps: rates cover the whole step (base = the previous step's end).
    assert report["steps"][1]["requests_per_s"] == (30 - 10) / 2


def test_errors_name_file_and_column(prefix, tmp_path):
    with pytest.raises(DataError, match=r"run_stats\.csv' does not exist; run Locust with --csv"):
        build_report(tmp_path / "run")
    history_file = f"{prefix}_stats_history.csv"
    with open(history_file) as handle:
        text = handle.read()
    with open(history_file, "w") as handle:
        handle.write(text.replace("Total Request Count", "Total Requests", 1))
    with pytest.raises(DataError, match=r"stats_history\.csv' has no column 'Total Request Count'"):
        build_report(prefix)
    with open(history_file, "w") as handle:
        handle.write(text.replace("\n101,1,POST", "\nsoon,1,POST", 1))
    with pytest.raises(DataError, match=r"stats_history\.csv', line \d+, column 'Timestamp': 'soon' is not a number"):
        build_report(prefix)
    # History without per-endpoint rows (Locust ran without --csv-full-history).
    aggregated_only = [line for line in text.splitlines() if ",Aggregated," in line or line.startswith("Timestamp")]
    with open(history_file, "w") as handle:
        handle.write("\n".join(aggregated_only) + "\n")
    with pytest.raises(DataError, match="--csv-full-history"):
        build_report(prefix)
    open(f"{prefix}_stats.csv", "w").close()
    with pytest.raises(DataError, match=r"run_stats\.csv' has no column 'Type'.*empty file"):
        build_report(prefix)
    with pytest.raises(DataError, match="must be > 0 ms"):
        SLO(p95_ms=0)
    with pytest.raises(DataError, match="headroom"):
        SLO(headroom=1.0)


def test_histogram_quantile_by_hand():
    # 10 observations: 4 <= 0.01, 4 in (0.01, 0.02], 2 in (0.02, 0.04].
    buckets = [(0.01, 4.0), (0.02, 8.0), (0.04, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.01 * (5 - 4) / 4)  # rank 5 in bucket 2
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.02 + 0.02 * (9.5 - 8) / 2)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.01 * 2 / 4)  # first bucket starts at 0
    assert histogram_quantile(0.5, [(0.01, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, [(0.01, 1.0), (math.inf, 10.0)]) == 0.01  # +Inf bucket: largest finite bound


SCRAPE = """# TYPE verl:time_to_first_token_seconds histogram
verl:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} {b1}
verl:time_to_first_token_seconds_bucket{le="0.02",model_name="m"} {b2}
verl:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} {b3}
verl:time_to_first_token_seconds_count{model_name="m"} {b3}
verl:time_to_first_token_seconds_sum{model_name="m"} {total}
# TYPE verl:http_requests counter
verl:http_requests_total{method="POST",path="/generate",status="200"} {ok}
verl:http_requests_total{method="POST",path="/generate",status="429"} 1.0
"""


def scrape(b1, b2, b3, total, ok):
    return SCRAPE.replace("{b1}", str(b1)).replace("{b2}", str(b2)).replace("{b3}", str(b3)).replace(
        "{total}", str(total)).replace("{ok}", str(ok))


def test_server_metrics_difference():
    before, after = scrape(1, 2, 2, 0.02, 2), scrape(3, 8, 10, 0.17, 12)
    whole = parse_server_metrics(after)
    assert whole["ttft"]["count"] == 10 and whole["ttft"]["mean_ms"] == pytest.approx(17.0)
    assert whole["http_requests"] == {"/generate": {"200": 12, "429": 1}}
    delta = parse_server_metrics(after, baseline=before)
    # Between the scrapes: 8 first tokens summing to 0.15 s; 2 in <=10 ms, 4 in (10, 20], 2 above 20 ms.
    assert delta["ttft"]["count"] == 8 and delta["ttft"]["mean_ms"] == pytest.approx(150 / 8)
    assert delta["ttft"]["p50_ms"] == pytest.approx(10 + 10 * (4 - 2) / 4)
    assert delta["http_requests"] == {"/generate": {"200": 10}}


def test_uncomputed_percentile_never_passes(tmp_path):
    # Locust writes 0 for a windowed percentile it could not compute (a long stall): not "0 ms, within SLO".
    rows = []
    for ts, total, p95 in ((10, 5, 90), (11, 10, 90), (12, 12, 0), (13, 14, 0)):
        users = 1 if ts < 12 else 2
        rows += [history_row(ts, users, "GET", "/", total, 0, 50.0, 40, 90, 99),
                 history_row(ts, users, "", "Aggregated", total, 0, 50.0, p95 and 40, p95, p95 and 99)]
    prefix = write_run(tmp_path, [stats_row("GET", "/", 14, 0, 50.0), stats_row("", "Aggregated", 14, 0, 50.0)],
                       rows)
    report = build_report(prefix, SLO(p95_ms=100))
    assert [s["meets_slo"] for s in report["steps"]] == [True, False]
    assert report["steps"][1]["latency_p95_ms"] is None
    assert report["steps"][1]["why_not"][0].startswith("no latency percentile for the window")
    assert report["capacity"]["max_users_within_slo"] == 1


def test_an_uncomputed_percentile_at_a_steps_end_reads_the_latest_computed_one_in_its_window(tmp_path):
    """Locust with worker processes often writes 0 at a level's last row (its window found no snapshot in the
    second after a report): the level's p95 is then the latest computed one of the level within its window (a CI
    run judged a fleet's first level "no latency" for that), never one from before the window."""
    rows = []
    timeline = ((10, 1, 5, 70), (11, 1, 10, 80), (12, 1, 12, 0),  # level 1: 0 at its end, 80 a second before
                (13, 2, 14, 300), (14, 2, 16, 0), (15, 2, 18, 0), (16, 2, 20, 0))  # level 2: 300 is too old
    for ts, users, total, p95 in timeline:
        rows += [history_row(ts, users, "GET", "/", total, 0, 50.0, 40, 90, 99),
                 history_row(ts, users, "", "Aggregated", total, 0, 50.0, p95 and 40, p95, p95 and 99)]
    info = {"plan": {"levels": [1, 2], "step_time_s": 3, "settle_s": 1, "window_s": 2}, "percentile_window_s": 2}
    prefix = write_run(tmp_path, [stats_row("GET", "/", 20, 0, 50.0), stats_row("", "Aggregated", 20, 0, 50.0)],
                       rows, [], info)
    report = build_report(prefix, SLO(p95_ms=100))
    first, second = report["steps"]
    assert (first["latency_p50_ms"], first["latency_p95_ms"], first["latency_p99_ms"]) == (40, 80, 99)
    assert first["meets_slo"] and second["latency_p95_ms"] is None and not second["meets_slo"]
    assert report["capacity"]["max_users_within_slo"] == 1


def test_per_replica_planning_line():
    """Measured on 2 replicas: 10 users hold at 45 requests/s, so plan 36 requests/s (20% headroom), 18 per
    replica; 100 requests/s then needs ceil(100 / 18) = 6 replicas, 36 exactly needs 2 (not 3 by rounding)."""
    steps = [_step(1, True), _step(10, True, 40.0), _step(10, True, 50.0), _step(12, False)]
    cap = capacity(steps, SLO(), FleetPlan(replicas=2, target_rps=100))
    assert cap["per_replica_planning_rps"] == pytest.approx(18.0)
    assert (cap["replicas_tested"], cap["replicas_for_target"]) == (2, 6)
    assert capacity(steps, SLO(), FleetPlan(replicas=2, target_rps=36))["replicas_for_target"] == 2
    assert capacity(steps, SLO(), FleetPlan(replicas=1, target_rps=5))["replicas_for_target"] == 1
    one = capacity(steps, SLO())
    assert one["per_replica_planning_rps"] == pytest.approx(36.0) and one["replicas_for_target"] is None
    # Nothing within the SLO: nothing to plan from.
    none = capacity([_step(1, False)], SLO(), FleetPlan(replicas=2, target_rps=10))
    assert none["per_replica_planning_rps"] is None and none["replicas_for_target"] is None
    with pytest.raises(DataError, match="replicas"):
        FleetPlan(replicas=0)
    with pytest.raises(DataError, match="target load"):
        FleetPlan(target_rps=0)


def test_per_replica_line_in_the_summary(prefix):
    report = build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.2), plan=FleetPlan(replicas=2, target_rps=50))
    cap = report["capacity"]
    text = summary_text(report)
    assert f"Per replica: about {cap['per_replica_planning_rps']:.3g} requests/s" in text
    assert "measured on 2 replicas" in text and "on the 2 replicas tested" in text
    assert f"50 requests/s needs {cap['replicas_for_target']} replicas" in text
    assert "--target-rps" in summary_text(build_report(prefix, SLO(p95_ms=1000, max_failure_rate=0.2)))


def test_answer_shares_and_their_warnings(tmp_path):
    """Answers cut at max_tokens per endpoint and agent sessions without a tool call: shares from the 1/0 entries'
    means, a warning line at 25% or more (a README agent test once measured 522 sessions of 0 calls in silence)."""
    turn = "/v1/chat/completions [agent turn]"
    stats = [*STATS,
             stats_row("LLM", f"answers_cut_at_max_tokens {GEN}", 37, 0, 0.1),
             stats_row("LLM", f"answers_cut_at_max_tokens {turn}", 20, 0, 1.0),
             stats_row("LLM", "sessions_without_tool_call", 20, 0, 1.0)]
    prefix = write_run(tmp_path / "csv", stats, history(), FAILURES, {**INFO, "max_tokens": 32})
    report = build_report(prefix, SLO(p95_ms=200))
    answers = report["answers"]
    assert answers["cut_at_max_tokens"] == {GEN: {"share": 0.1, "answers": 37}, turn: {"share": 1.0, "answers": 20}}
    assert answers["sessions_without_tool_call"] == {"share": 1.0, "sessions": 20}
    assert len(report["warnings"]) == 2  # not /generate's 10%
    assert report["warnings"][0].startswith(f"100% of the 20 answers of {turn} were cut at max_tokens")
    assert "raise --max-tokens 32" in report["warnings"][0]
    assert report["warnings"][1].startswith("100% of the 20 agent sessions made no tool call")
    text = summary_text(report)
    assert "Warning: 100% of the 20 answers of" in text
    assert f"Answers cut at max_tokens: 10% of 37 on {GEN}, 100% of 20 on {turn}." in text
    assert "Agent sessions without a tool call: 100% of 20." in text
    quiet = build_report(write_run(tmp_path / "ok", [*STATS, stats_row("LLM", f"answers_cut_at_max_tokens {GEN}",
                                                                        37, 0, 0.0)], history(), FAILURES, INFO))
    assert quiet["warnings"] == [] and quiet["answers"]["sessions_without_tool_call"] is None


def test_agent_users_get_a_budget_that_fits_a_tool_call(tmp_path):
    from loadtest.settings import LoadTestConfig  # noqa: PLC0415

    assert LoadTestConfig(out_dir=tmp_path).max_tokens == 32
    assert LoadTestConfig(out_dir=tmp_path, user_mix="agent").max_tokens == 128
    assert LoadTestConfig(out_dir=tmp_path, user_classes=["AgentUser"]).max_tokens == 128
    assert LoadTestConfig(out_dir=tmp_path, user_mix="agent", max_tokens=16).max_tokens == 16  # as asked


def test_rates_with_worker_processes_span_whole_report_intervals(tmp_path, monkeypatch):
    """With --processes the master's totals move only when a worker report arrives (every 3 s here): a 2 s window
    that falls between two reports read 0 requests/s (a fleet test's capacity line went missing). Its ends snap to
    the report arrivals: 9 requests arrived at ts 103 and 9 more at 106, so the rate is (18 - 9) / (106 - 103)."""
    timeline = [(99, 0, 0, 0, 0), (100, 2, 0, 0, 0), (101, 2, 0, 0, 0), (102, 2, 0, 0, 0), (103, 2, 6, 0, 3),
                (104, 2, 6, 0, 3), (105, 2, 6, 0, 3), (106, 2, 12, 0, 6), (107, 2, 12, 0, 6), (108, 2, 12, 0, 6),
                (109, 0, 14, 0, 7)]
    import tests.loadtest.test_report as this

    info = {"plan": {"levels": [2], "step_time_s": 9, "settle_s": 7, "window_s": 2}, "percentile_window_s": 2}
    stats = [stats_row("POST", GEN, 14, 0, 100.0, 100, 150, 160), stats_row("POST", CHAT, 7, 0, 110.0, 110, 160, 170),
             *STATS[2:]]
    monkeypatch.setattr(this, "TIMELINE", timeline)
    rows = history()
    one = build_report(write_run(tmp_path / "one", stats, rows, [], info), SLO())["steps"][0]
    assert one["requests"] == 21 and one["requests_per_s"] == 0.0  # one process: the totals are exact each second
    bursts = build_report(write_run(tmp_path / "two", stats, rows, [], {**info, "processes": 2}), SLO())["steps"][0]
    assert bursts["requests"] == 21
    assert bursts["requests_per_s"] == (18 - 9) / (106 - 103) and bursts["window_s"] == 3
