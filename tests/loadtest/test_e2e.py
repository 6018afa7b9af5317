"""End to end: the real service (uvicorn subprocess, loopback) under real Locust (headless subprocess).

1. A stepped run (1, 2, 4 users x 5 s, the default mixed user) -> the capacity report's numbers are checked against
   Locust's CSVs, read here independently with the csv module.
2. A streaming-only run (2 users, 8 s): the client's TTFT (Locust ``LLM ttft_ms``) against the service's own
   ``verl:time_to_first_token_seconds`` histogram over the same interval (two /metrics scrapes).

Tolerance for (2), and why. For every request the client's interval contains the service's: the client starts its
clock before sending and stops it when the chunk arrives; the service measures admission (after parsing, chat
template and tokenization) -> first token. So the client mean is the service mean plus HTTP/JSON handling, chat
template + tokenization, SSE delivery and the load generator's own scheduling; measured 3-5 ms on this machine.
Allowed: client mean - service mean within [-(1 ms + 5%), 15 ms + 25%]. The lower slack covers the few requests
the two sides do not share (Locust writes its CSV once a second, and users stopped mid-request are not counted);
the upper slack covers scheduler noise on a shared 2-core box (absolute) and queueing (proportional). Means are
compared because both are exact (Locust keeps the sum; Prometheus keeps ``_sum``/``_count``); the histogram's
percentiles are only bucket interpolations. ITL gets a looser check whose job is to catch a client that reads
the stream in big blocks (every token then seems to arrive at once, ITL ~ 0).

About 60 s in all; no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.render import make_report
from loadtest.report import parse_server_metrics
from loadtest.run import LOCUST_CONF, LOCUSTFILE, http_get, local_service, locust_command, run_locust
from loadtest.settings import SLO, LoadTestConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(170), pytest.mark.serial]  # timed load

HTTP_NAMES = {"/generate", "/v1/completions", "/v1/chat/completions [stream]"}
LEVELS, STEP_S, SETTLE_S = (1, 2, 4), 5, 2


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    log = tmp_path_factory.mktemp("service") / "server.log"
    with local_service(log, env={"VERL_SERVE_MODEL": "builtin:tiny-arith", "VERL_SERVE_ENGINE": "transformers"},
                       startup_timeout_s=120) as url:
        assert url.startswith("http://127.0.0.1:")
        yield url


def read_stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


def read_history(prefix: Path) -> list[dict[str, str]]:
    with open(f"{prefix}_stats_history.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def stepped_run(service, tmp_path_factory):
    out = tmp_path_factory.mktemp("stepped")
    config = LoadTestConfig(out_dir=out, step_users=",".join(map(str, LEVELS)), step_time_s=STEP_S,
                            step_settle_s=SETTLE_S, extra_locust_args=["--num-prompts", "32"])
    prefix = out / "locust"
    code = run_locust(locust_command(service, prefix, config.plan(), config), 90, out / "locust.log")
    assert code == 0, (out / "locust.log").read_text()[-3000:]
    report, paths = make_report(prefix, out / "report", SLO(p95_ms=60_000, max_failure_rate=0.01))
    return prefix, report, paths


def test_stepped_run_csvs_and_report_agree(stepped_run):
    prefix, report, paths = stepped_run
    stats = read_stats(prefix)
    http = {k: v for k, v in stats.items() if k[0] == "POST"}
    assert {name for _, name in http} == HTTP_NAMES  # the mixed user sent all three requests
    count = {name: int(row["Request Count"]) for (_, name), row in stats.items()}
    failures = sum(int(row["Failure Count"]) for row in stats.values() if row["Name"] != "Aggregated")
    # Every response passed the checks (status, JSON shape, non-empty text, usage counts) ...
    assert failures == 0, Path(f"{prefix}_failures.csv").read_text()
    assert all(count[name] > 0 for name in HTTP_NAMES)
    # ... so each one fired its LLM entries (same greenlet, no yield in between: the CSV holds both or neither).
    http_total = sum(count[name] for name in HTTP_NAMES)
    assert count["e2e_latency_ms"] == count["output_tokens"] == count["output_tokens_per_s"] == http_total
    assert count["ttft_ms"] == count["/v1/chat/completions [stream]"] >= count["itl_ms"]
    # Locust's Aggregated row is every entry together; the report separates the HTTP requests.
    assert count["Aggregated"] == sum(v for k, v in count.items() if k != "Aggregated")
    totals = report["totals"]
    assert totals["http_requests"] == http_total == totals["steps_requests"] == totals["history_http_requests"]
    assert totals["locust_aggregated_requests"] == count["Aggregated"]
    assert totals["llm_entries"] == count["Aggregated"] - http_total

    # Per step, straight from _stats_history.csv: the last second of each level.
    history = read_history(prefix)
    by_ts: dict[int, dict[str, dict[str, str]]] = {}
    for row in history:
        by_ts.setdefault(int(row["Timestamp"]), {})[row["Name"]] = row
    last_at = {}  # level -> its last timestamp
    for ts in sorted(by_ts):
        users = int(by_ts[ts]["Aggregated"]["User Count"])
        if users:
            last_at[users] = ts
    assert sorted(last_at) == list(LEVELS)

    def http_at(ts: int) -> int:
        return sum(int(r["Total Request Count"]) for n, r in by_ts[ts].items() if n in HTTP_NAMES)

    ends = [http_at(last_at[level]) for level in LEVELS]
    ends[-1] = http_at(max(by_ts))  # requests finishing while users stop belong to the last level
    expected = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    steps = report["steps"]
    assert [s["users"] for s in steps] == list(LEVELS)
    assert [s["requests"] for s in steps] == expected
    for step, level in zip(steps, LEVELS, strict=True):
        end = by_ts[last_at[level]]
        assert step["end"] == last_at[level]
        assert step["latency_p95_ms"] == float(end["e2e_latency_ms"]["95%"])
        assert step["latency_p99_ms"] == float(end["e2e_latency_ms"]["99%"])
        assert step["ttft_p50_ms"] == float(end["ttft_ms"]["50%"])
        assert step["requests_per_s"] > 0 and step["output_tokens_per_s"] > 0 and step["failure_rate"] == 0
        # Locust writes a history row about once a second; on a busy box it skips one now and then, and the
        # window's base is then the row before (one second more, never less).
        assert 1 <= step["window_s"] <= STEP_S - SETTLE_S + 1

    # The SLO search on real numbers: a 60 s p95 holds everywhere; no 1 ms p95 holds anywhere.
    cap = report["capacity"]
    assert (cap["max_users_within_slo"], cap["planning_users"], cap["all_levels_within_slo"]) == (4, 3, True)
    assert cap["rps_at_max"] == steps[-1]["requests_per_s"]
    strict, _ = make_report(prefix, prefix.parent / "strict", SLO(p95_ms=1))
    assert strict["capacity"]["max_users_within_slo"] is None

    info = json.loads(Path(f"{prefix}_loadtest.json").read_text())
    assert info["plan"]["levels"] == list(LEVELS) and info["percentile_window_s"] == STEP_S - SETTLE_S
    assert report["window_s"] == STEP_S - SETTLE_S
    assert json.loads(paths["json"].read_text())["totals"] == totals
    assert "**Capacity: 4 users**" in paths["markdown"].read_text()
    for key in ("latency", "throughput"):
        assert paths[key].stat().st_size > 10_000


def test_stream_ttft_agrees_with_service_metrics(service, tmp_path):
    prefix = tmp_path / "stream"
    before = http_get(service + "/metrics")[1].decode()
    command = [sys.executable, "-m", "locust", "--config", str(LOCUST_CONF), "-f", str(LOCUSTFILE), "--headless",
               "-H", service, "--csv", str(prefix), "--html", f"{prefix}.html", "--load-shape", "fixed",
               "-u", "2", "-r", "2", "-t", "8s",
               "--num-prompts", "32", "--text-prompts", "content", "ChatStreamUser"]
    assert run_locust(command, 60, tmp_path / "locust.log") == 0, (tmp_path / "locust.log").read_text()[-3000:]
    server = parse_server_metrics(http_get(service + "/metrics")[1].decode(), baseline=before)
    stats = read_stats(prefix)
    ttft, itl = stats[("LLM", "ttft_ms")], stats[("LLM", "itl_ms")]
    client_n, client_ms = int(ttft["Request Count"]), float(ttft["Average Response Time"])
    server_n, server_ms = server["ttft"]["count"], server["ttft"]["mean_ms"]
    assert client_n >= 20 and int(stats[("POST", "/v1/chat/completions [stream]")]["Failure Count"]) == 0
    # Only streamed chats ran, so both sides count the same requests but the edges (see the module docstring).
    assert 0 <= server_n - client_n <= 2 + 1.5 * client_n / 8
    assert server_ms * 0.95 - 1.0 <= client_ms <= server_ms * 1.25 + 15.0, (client_ms, server_ms)
    client_itl, server_itl = float(itl["Average Response Time"]), server["itl"]["mean_ms"]
    assert server_itl * 0.5 <= client_itl <= server_itl + 15.0, (client_itl, server_itl)


def test_users_and_run_time_on_the_command_line_mean_a_fixed_load(service, tmp_path):
    # `locust ... -u 2 -r 2 -t 5s` with the conf's stepped shape: the user's -u/-t win, and the log says so.
    prefix = tmp_path / "fixed"
    command = [sys.executable, "-m", "locust", "--config", str(LOCUST_CONF), "-f", str(LOCUSTFILE), "--headless",
               "-H", service, "--csv", str(prefix), "--html", f"{prefix}.html", "-u", "2", "-r", "2", "-t", "5s",
               "--num-prompts", "16", "--max-users", "8", "--step-time", "30"]
    start = time.monotonic()
    assert run_locust(command, 60, tmp_path / "locust.log") == 0, (tmp_path / "locust.log").read_text()[-3000:]
    assert time.monotonic() - start < 30  # not four 30 s steps
    assert "-u/-t given: a fixed load of 2 users" in (tmp_path / "locust.log").read_text()
    users = {row["User Count"] for row in read_history(prefix)}
    assert users <= {"0", "1", "2"} and "2" in users


@pytest.mark.budget(30)
@pytest.mark.slow
def test_verl_loadtest_command(tmp_path):
    """The one command: service up on loopback, stepped Locust run, service down, report (about 40 s)."""
    import subprocess

    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "verl.cli", "loadtest", "--out", str(out), "--step-users", "1,2", "--step-time", "6",
         "--step-settle", "2", "--slo-p95-ms", "60000", "--locust-arg=--num-prompts=16"],
        capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Capacity: 2 users within the SLO" in result.stderr
    report = json.loads((out / "capacity_report.json").read_text())
    assert [s["users"] for s in report["steps"]] == [1, 2]
    stats = read_stats(out / "locust")
    assert report["totals"]["locust_aggregated_requests"] == int(stats[("", "Aggregated")]["Request Count"])
    # The service was scraped before it stopped: it served at least what Locust counted as successes.
    served = sum(report["server"]["http_requests"].get(p, {}).get("200", 0)
                 for p in ("/generate", "/v1/completions", "/v1/chat/completions"))
    assert served >= report["totals"]["http_requests"] - report["totals"]["http_failures"] > 0
    assert "server.log" in {p.name for p in out.iterdir()} and (out / "latency_vs_users.png").is_file()


def test_verl_loadtest_against_a_running_service_with_two_processes(service, tmp_path):
    """``verl loadtest --url URL --processes 2``: no service is started, two Locust worker processes generate the
    load, the counts equal Locust's, and the cross-check counts this run only although the service had served
    other requests before it (``/metrics`` scraped before and after); the per-replica line plans for a target."""
    import subprocess

    for _ in range(5):  # traffic before the test, which the report must not count
        assert httpx.post(service + "/generate", json={"prompt": "1+1=", "max_new_tokens": 2}).status_code == 200
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "verl.cli", "loadtest", "--url", service + "/", "--processes", "2", "--out", str(out),
         "--step-users", "2", "--step-time", "8", "--step-settle", "2", "--slo-p95-ms", "60000",
         "--target-rps", "1000", "--locust-arg=--num-prompts=16"],
        capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "testing the running service" in result.stderr and "2 processes" in result.stderr
    assert "server.log" not in {p.name for p in out.iterdir()}  # nothing was started
    log = (out / "locust.log").read_text()
    # The load came from worker processes: the master spawned the users on both. ("The last worker quit", the check
    # before, depends on the order of the shutdown: a default-group run on three pytest workers saw the master stop
    # first, 2026-12-01.)
    assert "to 2 ready workers" in log, log[-2000:]
    report = json.loads((out / "capacity_report.json").read_text())
    stats = read_stats(out / "locust")
    count = {name: int(row["Request Count"]) for (_, name), row in stats.items()}
    http_total = sum(count[name] for name in HTTP_NAMES)
    assert count["e2e_latency_ms"] == count["output_tokens"] == http_total == report["totals"]["http_requests"] > 0
    assert report["totals"]["locust_aggregated_requests"] == count["Aggregated"]
    served = sum(report["server"]["http_requests"].get(p, {}).get("200", 0)
                 for p in ("/generate", "/v1/completions", "/v1/chat/completions"))
    ok = http_total - report["totals"]["http_failures"]
    assert ok <= served <= ok + 2  # + what the 2 users had in flight when Locust stopped them; not the 5 before
    cap = report["capacity"]
    assert cap["replicas_tested"] == 1 and cap["replicas_for_target"] >= 1
    assert "needs" in result.stderr and "Per replica" in result.stderr


@pytest.mark.budget(32)
@pytest.mark.slow
def test_distributed_locust_processes_aggregate_custom_entries(service, tmp_path):
    """``--processes 2`` (a master and two forked workers): the LLM entries each worker fires reach the master's
    CSVs, and the report's counts still equal Locust's (about 25 s)."""
    config = LoadTestConfig(out_dir=tmp_path, step_users="1,2", step_time_s=8, step_settle_s=SETTLE_S,
                            extra_locust_args=["--num-prompts", "32", "--processes", "2"])
    prefix = tmp_path / "locust"
    code = run_locust(locust_command(service, prefix, config.plan(), config), 90, tmp_path / "locust.log")
    log = (tmp_path / "locust.log").read_text()
    assert code == 0, log[-3000:]
    assert "The last worker quit" in log, log[-3000:]  # the master ran the test through its workers
    stats = read_stats(prefix)
    count = {name: int(row["Request Count"]) for (_, name), row in stats.items()}
    http_total = sum(count[name] for name in HTTP_NAMES)
    assert all(count[name] > 0 for name in HTTP_NAMES)
    assert count["e2e_latency_ms"] == count["output_tokens"] == http_total
    assert count["ttft_ms"] == count["/v1/chat/completions [stream]"]
    report, _ = make_report(prefix, tmp_path / "report", SLO(p95_ms=60_000, max_failure_rate=0.01))
    assert [s["users"] for s in report["steps"]] == [1, 2]
    assert report["totals"]["http_requests"] == http_total == report["totals"]["steps_requests"]
    assert report["totals"]["locust_aggregated_requests"] == count["Aggregated"]


@pytest.mark.budget(32)
@pytest.mark.slow
def test_locust_master_and_workers_as_separate_processes(service, tmp_path):
    """``--master`` and two ``--worker`` processes started on their own (as on separate machines): the stepped
    shape runs on the master, the custom entries of both workers reach its CSVs, and the report's counts equal
    Locust's."""
    import subprocess

    from tests.ports import free_port

    config = LoadTestConfig(out_dir=tmp_path, step_users="2,4", step_time_s=8, step_settle_s=SETTLE_S,
                            extra_locust_args=["--num-prompts", "32"])
    prefix = tmp_path / "locust"
    port = free_port()
    master = locust_command(service, prefix, config.plan(), config) + [
        "--master", "--expect-workers", "2", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port)]
    worker = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
              "--master-port", str(port)]
    workers = [subprocess.Popen(worker, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        code = run_locust(master, 120, tmp_path / "locust.log")
    finally:
        for proc in workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    log = (tmp_path / "locust.log").read_text()
    assert code == 0, log[-3000:]
    assert all(proc.returncode is not None for proc in workers)  # the master told them to quit
    stats = read_stats(prefix)
    count = {name: int(row["Request Count"]) for (_, name), row in stats.items()}
    http_total = sum(count[name] for name in HTTP_NAMES)
    assert count["e2e_latency_ms"] == count["output_tokens"] == http_total > 0
    report, _ = make_report(prefix, tmp_path / "report", SLO(p95_ms=60_000, max_failure_rate=0.01))
    assert [s["users"] for s in report["steps"]] == [2, 4]
    assert report["totals"]["http_requests"] == http_total == report["totals"]["steps_requests"]
    assert report["totals"]["locust_aggregated_requests"] == count["Aggregated"]
