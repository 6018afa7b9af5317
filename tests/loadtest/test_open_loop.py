"""Open-loop load (loadtest/open_loop.py): the schedule, the numbers from hand-made request records (latency from
the scheduled send, TPOT, goodput, rejections, the generator's lag), then the real CLI against the real service."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadtest.open_loop import (
    RequestRecord,
    arrival_offsets,
    meets_slo,
    merge_worker_records,
    parse_rates,
    parse_slo,
    replay_schedule,
    summarise,
    worker_records_path,
    worker_share,
    write_records,
)
from loadtest.open_run import Sweep, find_knee, knee_line
from verl.errors import ConfigError, DataError


def test_constant_and_gamma_schedules():
    assert arrival_offsets(4, 1.0, "constant") == pytest.approx([0.0, 0.25, 0.5, 0.75])
    gaps = np.diff(arrival_offsets(200, 200.0, "poisson", 1.0, seed=1))
    # Poisson: exponential gaps, mean 1/rate and coefficient of variation 1; gamma shape k gives CV 1/sqrt(k).
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.02) and gaps.std() / gaps.mean() == pytest.approx(1, rel=0.03)
    bursty = np.diff(arrival_offsets(200, 200.0, "poisson", 0.25, seed=1))
    assert bursty.mean() == pytest.approx(1 / 200, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2, rel=0.05)
    offsets = arrival_offsets(50, 10.0, "poisson", seed=3)
    assert offsets[0] == 0 and offsets[-1] < 10 and np.all(np.diff(offsets) >= 0)
    assert np.array_equal(offsets, arrival_offsets(50, 10.0, "poisson", seed=3))  # the same seed, the same schedule
    for args, message in (((0, 1.0), "--rate"), ((1, 0.0), "--duration"), ((1, 1.0, "uniform"), "--arrival"),
                          ((1, 1.0, "poisson", 0.0), "--burstiness")):
        with pytest.raises(ConfigError, match=message):
            arrival_offsets(*args)


def test_worker_processes_split_one_schedule_and_their_records_merge(tmp_path):
    """--processes N: process i sends arrivals i, i+N, ... (together, the whole schedule, each at rate/N), and the
    report reads one file of every process's records in schedule order."""
    shares = [list(worker_share(7, worker, 3)) for worker in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(i for share in shares for i in share) == list(range(7))
    with pytest.raises(ValueError):
        worker_share(7, 3, 3)
    prefix = tmp_path / "open_8"
    offsets = [0.0, 0.1, 0.25, 0.3, 0.5]
    for worker in range(2):
        write_records(worker_records_path(prefix, worker),
                      [RequestRecord(scheduled_s=offsets[i], status=200) for i in worker_share(5, worker, 2)])
    merged = merge_worker_records(prefix)
    assert merged == tmp_path / "open_8_requests.jsonl"
    assert [json.loads(line)["scheduled_s"] for line in merged.read_text().splitlines()] == offsets
    assert sorted(p.name for p in tmp_path.iterdir()) == ["open_8_requests.jsonl"]  # the parts are gone
    assert merge_worker_records(prefix) == merged  # a run without worker files: the one file as written
    write_records(worker_records_path(prefix, 1), [RequestRecord(scheduled_s=0.1, status=200)])
    with pytest.raises(DataError, match=r"worker process\(es\) \[0\] of 2 wrote no open-loop records"):
        merge_worker_records(prefix, processes=2)  # worker 0's share missing: not a report of half the schedule


def test_the_master_ends_the_open_loop_when_every_worker_says_its_records_are_written(tmp_path):
    """With --processes the master waits for each worker's OPEN_DONE_MESSAGE, not for the workers' user counts
    to read 0 (a busy worker missing heartbeats reads 0: the master ended the test and killed it before it wrote
    its share), and gives up on a silent worker after the schedule, the request timeout and a grace period."""
    import subprocess
    import sys

    from loadtest.run import LOCUST_CONF

    replay = tmp_path / "replay.jsonl"
    replay.write_text('{"offset_s": 0.5}\n{"offset_s": 12.5}\n')
    probe = (  # importing locust monkey-patches this process (gevent): drive the locustfile in a child process
        "import time, types\n"
        "import loadtest.locustfile as lf\n"
        "opts = types.SimpleNamespace(duration=8, request_timeout=60, replay_schedule=None)\n"
        "lf._worker_schedule_done(environment=None, msg=types.SimpleNamespace(data={'worker': 1}))\n"
        "waits = lf.open_loop_finished(2, opts)\n"
        "lf._worker_schedule_done(environment=None, msg=types.SimpleNamespace(data={'worker': 0}))\n"
        "ends = lf.open_loop_finished(2, opts) is not None\n"
        "lf.OPEN_LOOP.pop('finished_at'); lf.OPEN_LOOP['workers_done'] = {1}\n"
        "give_up_at = lf.OPEN_LOOP['give_up_at'] - time.monotonic()\n"
        "still = lf.open_loop_finished(2, opts)\n"
        "lf.OPEN_LOOP['give_up_at'] = time.monotonic() - 1\n"
        "gives_up = lf.open_loop_finished(2, opts) is not None\n"
        f"span = lf.schedule_span_s(types.SimpleNamespace(duration=8, replay_schedule={str(replay)!r}))\n"
        "print(waits, ends, still, gives_up, round(give_up_at), span)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=LOCUST_CONF.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"None True None True {8 + 60 + 30} 12.5"
    assert "worker process(es) [0] never reported" in done.stderr


def test_the_open_loop_user_runs_only_its_schedule():
    """Locust's metaclass adds a base class's tasks to a subclass's `tasks`: the open-loop user must not also run
    AgentUser's closed-loop session (it did, first, in about half the runs: a stray agent turn)."""
    import subprocess
    import sys

    probe = "import loadtest.locustfile as lf; print([t.__qualname__ for t in lf.OpenLoopUser.tasks])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['OpenLoopUser.run_schedule']"  # importing locust patches a process: a child


def test_slo_and_rate_parsing():
    assert parse_slo("ttft:300,tpot:50,e2el:2000") == {"ttft": 300.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_slo(None) == {}
    for bad, message in (("ttfb:3", "one of ttft, tpot, itl, e2el"), ("ttft:x", "not a number"),
                         ("ttft:0", "> 0 ms"), ("ttft", "METRIC:MS")):
        with pytest.raises(ConfigError, match=message):
            parse_slo(bad)
    assert parse_rates("2, 4,8") == [2.0, 4.0, 8.0]
    with pytest.raises(ConfigError, match="positive"):
        parse_rates("2,-1")


def records() -> list[RequestRecord]:
    """Four scheduled requests, times in seconds from the start."""
    return [
        # On time: TTFT 0.1 s, end 0.5 s, 5 tokens -> TPOT (0.5 - 0.1) / 4 = 0.1 s; gaps 0.1 s each.
        RequestRecord(0.0, sent_s=0.001, status=200, ttft_s=0.1, end_s=0.5, output_tokens=5,
                      itl_s=[0.1, 0.1, 0.1, 0.1], finish_reason="stop"),
        # Sent 20 ms late: its latency still counts from 1.0 s (TTFT 0.3, e2el 1.0), and one gap of 0.4 s.
        RequestRecord(1.0, sent_s=1.02, status=200, ttft_s=1.3, end_s=2.0, output_tokens=3, itl_s=[0.3, 0.4],
                      finish_reason="length"),
        RequestRecord(2.0, sent_s=2.0, status=429, error="HTTP 429: at capacity"),  # shed: against goodput
        RequestRecord(3.0, sent_s=3.003, status=200, ttft_s=3.2, end_s=3.2, output_tokens=1, finish_reason="stop"),
    ]


def test_summary_in_vllm_bench_terms_by_hand():
    result = summarise(records(), rate=1.0, duration_s=4.0, slo={"ttft": 250, "itl": 350}, percentiles=(50, 99))
    assert (result["completed"], result["failed"], result["rejected"]) == (3, 1, 1)
    assert result["rejection_rate"] == 0.25 and result["duration"] == 4.0  # the schedule's end, after the last answer
    assert result["request_throughput"] == pytest.approx(3 / 4)
    # Goodput: #1 (TTFT 100, gaps 100) and #4 (TTFT 200) meet ttft<=250 and itl<=350; #2 misses both; #3 was shed.
    assert result["request_goodput"] == pytest.approx(2 / 4) and result["goodput_share_of_offered"] == 0.5
    assert result["output_throughput"] == pytest.approx(9 / 4) and result["total_output_tokens"] == 9
    assert result["mean_ttft_ms"] == pytest.approx((100 + 300 + 200) / 3)
    assert result["median_ttft_ms"] == pytest.approx(200) and result["p50_ttft_ms"] == pytest.approx(200)
    assert result["mean_e2el_ms"] == pytest.approx((500 + 1000 + 200) / 3)
    assert result["mean_tpot_ms"] == pytest.approx((100 + 350) / 2)  # one-token answers have no TPOT
    assert result["mean_itl_ms"] == pytest.approx((4 * 100 + 300 + 400) / 6)
    assert result["p99_itl_ms"] == pytest.approx(float(np.percentile([100, 100, 100, 100, 300, 400], 99)))
    assert result["schedule_lag_p50_ms"] == pytest.approx(float(np.percentile([1, 20, 0, 3], 50)))
    assert result["generator_bound"] is True  # p99 of (1, 20, 0, 3) ms is above 10 ms
    assert result["finish_length_share"] == pytest.approx(1 / 3)
    assert result["errors"] == {"HTTP 429: at capacity": 1}
    assert not math.isnan(result["std_e2el_ms"])
    assert summarise(records(), 1.0, 4.0, max_lag_p99_ms=25)["generator_bound"] is False
    assert summarise(records(), 1.0, 4.0)["request_goodput"] is None  # no SLO: no goodput claimed
    assert meets_slo(records()[0], {"tpot": 100}) and not meets_slo(records()[0], {"tpot": 99})


def fake_run(rate: float, capacity: float = 37.0, lag_from: float = 1e9) -> dict:
    """A service that completes min(rate, capacity) requests/s within the SLO (the rest are shed)."""
    offered = int(rate * 10)
    good = int(min(rate, capacity) * 10)
    return {"request_rate": rate, "num_prompts": offered, "completed": good, "goodput_share_of_offered": good / offered,
            "generator_bound": rate >= lag_from}


def test_the_sweep_finds_the_knee_coarse_then_fine():
    knee = find_knee(fake_run, 4.0, Sweep(share=0.95, fine_steps=3))
    # Doubling: 4, 8, 16, 32 hold; 64 misses (37/64). Bisection: 48 misses, 40 misses (0.925), 36 holds.
    assert [p["request_rate"] for p in knee["probes"]] == [4, 8, 16, 32, 36, 40, 48, 64]
    assert knee["knee_rate"] == 36 and knee["first_missing_rate"] == 40 and knee["stopped_by"] == "goodput"
    assert find_knee(fake_run, 64.0, Sweep())["knee_rate"] is None  # even the start misses
    capped = find_knee(fake_run, 4.0, Sweep(max_rate=20))
    assert capped["knee_rate"] == 16 and capped["stopped_by"] == "max_rate"
    # A generator that cannot keep the schedule ends the search: its numbers would measure the client.
    bound = find_knee(lambda r: fake_run(r, lag_from=30), 4.0, Sweep())
    assert bound["knee_rate"] == 16 and bound["stopped_by"] == "generator"
    results = {"goodput_slo_ms": {"e2el": 500}, "sweep": {k: v for k, v in knee.items() if k != "probes"}}
    assert knee_line(results) == ("Knee: 36 requests/s is the largest rate whose goodput stayed >= 95% of the offered "
                                  "rate (40 requests/s missed); plan for 28.8 requests/s (20% headroom).")
    with pytest.raises(ConfigError, match="goodput-share"):
        Sweep(share=1.5)


def test_replay_schedule_from_records_by_hand():
    task = [({"role": "user", "content": "one two"},), ({"role": "user", "content": "a b c d e f g h"},)]
    records = [
        {"kind": "request", "arrival": 100.0, "prompt": [{"role": "user", "content": "hi"}], "completion_tokens": 7,
         "prompt_tokens": 9, "index": 0},
        {"kind": "request", "arrival": 100.0, "prompt": None, "completion_tokens": 4, "index": 1},  # choice 2 of 2
        {"kind": "request", "arrival": 103.0, "prompt": "2+2=", "completion_tokens": 0, "index": 0},
        {"kind": "request", "arrival": 101.0, "prompt": None, "prompt_tokens": 7, "completion_tokens": 5,
         "index": 0},
        {"kind": "request", "arrival": 102.0, "shadow": True, "completion_tokens": 5},  # a mirror: not traffic
        {"kind": "reward", "id": "c1", "reward": 1.0},
        {"kind": "request", "time": 110.0, "e2e_s": 4.0, "prompt": "x", "completion_tokens": 2},  # no arrival field
    ]
    rows, notes = replay_schedule(records, 2.0, task)
    assert [r["offset_s"] for r in rows] == [0.0, 0.5, 1.5, 3.0]  # (arrival - 100) / 2; time - e2e for the last
    assert [r["max_tokens"] for r in rows] == [7, 5, 1, 2]
    assert rows[0]["messages"] == [{"role": "user", "content": "hi"}] and rows[0]["recorded_prompt"]
    assert rows[2]["messages"] == [{"role": "user", "content": "2+2="}]
    assert rows[1]["messages"] == list(task[1]) and not rows[1]["recorded_prompt"]  # 7 tokens: nearest is 8 words
    assert "1 of 4 records carry no prompt" in notes[1]
    with pytest.raises(DataError, match="no request rows with an arrival"):
        replay_schedule([{"kind": "reward", "id": "x", "reward": 1}], 1.0, task)
    with pytest.raises(ConfigError, match="--replay-speed"):
        replay_schedule(records, 0, task)


@pytest.mark.e2e
def test_open_loop_rates_then_a_replay_of_the_recorded_traffic(tmp_path):
    """Two rates against the real service (records kept with texts), then the same traffic replayed from its
    records at twice the speed from two Locust processes: every request again (both shares merged), the recorded
    gaps halved, the recorded prompts and lengths."""
    from loadtest.run import local_service  # noqa: PLC0415
    from tests.eval.test_cli_e2e import cli  # noqa: PLC0415

    records_path = tmp_path / "records.jsonl"
    env = {"VERL_SERVE_RECORDS_PATH": str(records_path), "VERL_SERVE_RECORD_TEXTS": "true"}
    out = tmp_path / "open"
    with local_service(tmp_path / "server.log", env, 120) as url:
        result = cli("loadtest", "--url", url, "--rate", "4,12", "--duration", "4", "--slo", "ttft:5000,e2el:10000",
                     "--max-lag-p99-ms", "200", "--out", str(out))
        assert "4 req/s offered" in result.output and "12 req/s offered" in result.output
        results = json.loads((out / "open_loop.json").read_text())
        assert results["mode"] == "open-loop" and [r["request_rate"] for r in results["runs"]] == [4, 12]
        sent = 0
        for run in results["runs"]:
            requests = [json.loads(line) for line in
                        (out / f"open_{run['request_rate']:g}_requests.jsonl").read_text().splitlines()]
            assert len(requests) == run["num_prompts"] > 0 and run["completed"] == run["num_prompts"]
            sent += len(requests)
            for key in ("request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
                        "median_tpot_ms", "p95_itl_ms", "p99_e2el_ms", "schedule_lag_p99_ms"):
                assert run[key] is not None and run[key] >= 0, key
            # Latency counts from the scheduled send: never below the time from the actual send.
            assert all(r["end_s"] - r["scheduled_s"] >= r["end_s"] - r["sent_s"] for r in requests)
        assert results["runs"][1]["num_prompts"] > results["runs"][0]["num_prompts"]
        report = (out / "open_loop.md").read_text()
        assert "**open loop**" in report and "| 12 |" in report

        replayed = tmp_path / "replay"
        cli("loadtest", "--url", url, "--replay", str(records_path), "--replay-speed", "2", "--max-lag-p99-ms",
            "200", "--processes", "2", "--out", str(replayed))  # two Locust processes: each sends half
    recorded = [json.loads(line) for line in records_path.read_text().splitlines()]
    first_run = [r for r in recorded if r.get("kind", "request") == "request"][:sent]
    schedule = [json.loads(line) for line in (replayed / "replay_schedule.jsonl").read_text().splitlines()]
    assert len(schedule) == sent and all(row["recorded_prompt"] for row in schedule)
    arrivals = sorted(r["arrival"] for r in first_run)
    assert [row["offset_s"] for row in schedule] == pytest.approx([(a - arrivals[0]) / 2 for a in arrivals])
    assert sorted(row["max_tokens"] for row in schedule) == sorted(max(1, r["completion_tokens"]) for r in first_run)
    replay_results = json.loads((replayed / "open_loop.json").read_text())
    (run,) = replay_results["runs"]
    assert replay_results["processes"] == 2 and "The last worker quit" in (replayed / "replay.log").read_text()
    assert run["arrival"] == "replay" and run["num_prompts"] == sent and run["completed"] == sent
    # The replayed answers have the recorded lengths (the same prompts, greedy, max_tokens = the recorded length).
    answers = [json.loads(line)["output_tokens"] for line in (replayed / "replay_requests.jsonl").read_text()
               .splitlines()]
    recorded_lengths = sorted(r["completion_tokens"] for r in first_run)
    assert len(answers) == sent and sum(answers) == pytest.approx(sum(recorded_lengths), rel=0.05)
    same = sum(a == b for a, b in zip(sorted(answers), recorded_lengths, strict=True))
    assert same >= 0.9 * sent, (sorted(answers), recorded_lengths)
    assert "replayed" in replay_results["replay_notes"][0]
    bad = cli("loadtest", "--slo", "ttft:300", "--out", str(tmp_path / "bad"), ok=False)
    assert bad.exit_code != 0 and "add --rate" in bad.output


def open_result(rates_and_p99: dict[float, float], **settings) -> dict:
    runs = [summarise([RequestRecord(0.0, 0.0, 200, 0.05, p99 / 1000, 3, [0.01, 0.01], "stop")], rate, 1.0,
                      {"e2el": 500}) for rate, p99 in rates_and_p99.items()]
    return {"mode": "open-loop", "model": "m", "max_tokens": 32, "arrival": "poisson", "burstiness": 1.0,
            "duration_s": 1.0, "seed": 0, "goodput_slo_ms": {"e2el": 500}, "runs": runs, **settings}


def test_compare_two_runs_paired_by_rate(tmp_path):
    from loadtest.compare import compare_runs  # noqa: PLC0415
    from tests.eval.test_cli_e2e import cli  # noqa: PLC0415

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "open_loop.json").write_text(json.dumps(open_result({4: 200, 8: 400, 16: 900})))
    (tmp_path / "b.json").write_text(json.dumps(open_result({8: 300, 16: 600, 32: 800}, max_tokens=64)))
    report, paths = compare_runs(tmp_path / "a", tmp_path / "b.json", tmp_path / "cmp")
    assert [row["rate"] for row in report["rows"]] == [8, 16] and report["only_a"] == [4] and report["only_b"] == [32]
    e2el = report["rows"][1]["fields"]["p99_e2el_ms"]
    assert (e2el["a"], e2el["b"], e2el["diff"], e2el["ratio"], e2el["b_better"]) == pytest.approx(
        (900, 600, -300, 600 / 900, True))
    goodput = report["rows"][1]["fields"]["request_goodput"]  # 900 ms > the 500 ms SLO in A, 600 ms too in B
    assert goodput["a"] == goodput["b"] == 0 and goodput["b_better"] is None
    assert report["settings_differ"] == {"max_tokens": (32, 64)}
    md = paths["markdown"].read_text()
    assert "## 16 requests/s offered" in md and "| p99_e2el_ms | 900 | 600 | -300 (better) | 0.667 |" in md
    assert "Only A offered 4 requests/s" in md
    result = cli("loadtest-report", "--compare", str(tmp_path / "a"), str(tmp_path / "b.json"), "--out",
                 str(tmp_path / "cli"))
    assert "16 req/s offered: throughput" in result.output and (tmp_path / "cli" / "open_loop_compare.json").is_file()
    bad = cli("loadtest-report", "--compare", str(tmp_path / "a"), str(tmp_path / "nothing"), ok=False)
    assert bad.exit_code != 0 and "no open_loop.json at" in bad.output


def test_sessions_in_the_summary_by_hand():
    sessions = [RequestRecord(0.0, 0.0, 200, None, 0.8, 30, [], "stop", turns=2, tool_calls=1),
                RequestRecord(1.0, 1.0, 200, None, 1.2, 10, [], "stop", turns=1, tool_calls=0)]
    result = summarise(sessions, 2.0, 2.0)
    assert result["sessions"] == {"completed": 2, "turns_mean": 1.5, "tool_calls_mean": 0.5,
                                  "without_tool_call_share": 0.5}
    assert result["mean_e2el_ms"] == pytest.approx((800 + 200) / 2) and result["mean_ttft_ms"] is None


@pytest.mark.e2e
def test_agent_sessions_start_at_the_rate(tmp_path):
    """--user-mix agent --rate: each scheduled arrival starts a session (the tiny agent, sampled, calls sometimes)."""
    from tests.eval.test_cli_e2e import cli  # noqa: PLC0415

    out = tmp_path / "agents"
    result = cli("loadtest", "--user-mix", "agent", "--rate", "4", "--duration", "5", "--max-lag-p99-ms", "200",
                 "--locust-arg=--temperature=1.0", "--out", str(out))
    assert "sessions:" in result.output
    (run,) = json.loads((out / "open_loop.json").read_text())["runs"]
    records = [json.loads(line) for line in (out / "open_4_requests.jsonl").read_text().splitlines()]
    done = [r for r in records if r["status"] == 200]
    assert run["sessions"]["completed"] == len(done) == len(records) > 0
    # A session goes on past its first turn exactly when the model called a tool (the client ran it and sent back
    # the result); the share without a call is the report's.
    assert all(r["turns"] >= 1 and (r["tool_calls"] > 0) == (r["turns"] > 1) for r in done)
    without = sum(1 for r in done if not r["tool_calls"]) / len(done)
    assert run["sessions"]["without_tool_call_share"] == pytest.approx(without)
    assert run["mean_ttft_ms"] is None and run["mean_e2el_ms"] > 0
