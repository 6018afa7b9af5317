"""Our open-loop numbers against GuideLLM's, at the same rate, on the same service, prompts and max_tokens.

One service (ours, on loopback; the built-in tiny model or ``--model``), warmed up, then for each repeat both
generators in turn (the order alternates between repeats), each sending the same N = rate x ``--duration``
streamed chat completions — the built-in task's traffic-split prompts in file order — one every 1/rate seconds, and
waiting for all N answers:

- ours: Locust's ``OpenLoopUser`` (one process) on a replay schedule of those prompts (``verl loadtest --replay``'s
  path; ``--rate`` would draw prompts at random);
- GuideLLM: ``guidellm run --profile kind=constant,rate=R --constraint kind=max_requests,count=N`` on the same
  prompts (a JSONL file; it sends them in order), with the same ``max_tokens`` and temperature 0, one process.

Compared, medians over repeats: request throughput, TTFT p50/p99, the per-request decode time per token and the
end-to-end latency p50/p99, and output tokens per request. The names differ between the tools:

- our ``tpot`` (vLLM's bench: ``(e2el - ttft) / (output_tokens - 1)`` per request) is GuideLLM's
  ``inter_token_latency_ms``; GuideLLM's ``time_per_output_token_ms`` divides the whole latency, TTFT included, by
  the output tokens (compared as a row of its own, against ours computed that way from our records);
- our latencies count from the **scheduled** send, GuideLLM's from the actual send: they differ by the generator's
  lag (reported: our p99 lag, GuideLLM's mean delay from its target start).

GuideLLM lives in a venv of its own (it pins its own transformers):
``python -m venv .venv-guidellm && .venv-guidellm/bin/pip install torch==2.13.0 guidellm==0.8.1``.

    .venv/bin/python benchmarks/open_loop_crosscheck.py --guidellm .venv-guidellm/bin/guidellm
    .venv/bin/python benchmarks/open_loop_crosscheck.py --model builtin:smollm2-135m-instruct --rate 2 --duration 30
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.open_loop import REPLAY_SUFFIX, read_records, summarise  # noqa: E402
from loadtest.open_run import OpenLoopConfig, open_command  # noqa: E402
from loadtest.prompts import DEFAULT_PROMPT_FILE, load_prompts  # noqa: E402
from loadtest.run import local_service, run_locust  # noqa: E402
from loadtest.settings import LoadTestConfig  # noqa: E402

# (label, our summary's field, GuideLLM metric, its statistic): what each row compares.
ROWS = [("request throughput (req/s)", "request_throughput", None, None),
        ("TTFT p50 (ms)", "median_ttft_ms", "time_to_first_token_ms", "p50"),
        ("TTFT p99 (ms)", "p99_ttft_ms", "time_to_first_token_ms", "p99"),
        ("decode ms/token p50 (ours tpot, GuideLLM itl)", "median_tpot_ms", "inter_token_latency_ms", "p50"),
        ("latency/output token mean (GuideLLM tpot)", "latency_per_token_mean_ms", "time_per_output_token_ms", "mean"),
        ("E2E latency p50 (ms)", "median_e2el_ms", "request_latency", "p50"),
        ("E2E latency p99 (ms)", "p99_e2el_ms", "request_latency", "p99"),
        ("output tokens/request (mean)", "output_tokens_mean", "output_token_count", "mean")]


def ours(url: str, out: Path, texts: list[str], rate: float, max_tokens: int) -> dict[str, float]:
    """``texts`` in order, one every ``1/rate`` s: a replay schedule (``verl loadtest --replay``'s path through
    OpenLoopUser), so both tools send the same prompts in the same order."""
    schedule = [{"offset_s": i / rate, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
                for i, text in enumerate(texts)]
    run_dir = out / f"ours_{time.monotonic_ns()}"
    run_dir.mkdir()
    (run_dir / REPLAY_SUFFIX).write_text("".join(json.dumps(row) + "\n" for row in schedule))
    duration = len(texts) / rate
    config = OpenLoopConfig(LoadTestConfig(out_dir=run_dir, max_tokens=max_tokens), [rate], replay=schedule)
    prefix = run_dir / "open"
    code = run_locust(open_command(url, prefix, rate, config), duration + 150, Path(f"{prefix}.log"))
    if code not in (0, 1):
        raise SystemExit(Path(f"{prefix}.log").read_text()[-3000:])
    records = read_records(f"{prefix}_requests.jsonl")
    result = summarise(records, rate, duration, arrival="constant")
    good = [r for r in records if r.ok and r.output_tokens]
    # GuideLLM's time_per_output_token_ms: the whole latency (TTFT included) over the output tokens, per token.
    result["latency_per_token_mean_ms"] = (1000 * sum(r.end_s - r.scheduled_s for r in good)
                                           / sum(r.output_tokens for r in good))
    result["output_tokens_mean"] = statistics.fmean(r.output_tokens for r in good)
    return result


def guidellm(binary: str, url: str, model: str, prompts: Path, out: Path, rate: float, count: int,
             max_tokens: int) -> dict[str, Any]:
    """``prompts`` from the file's start, in order (GuideLLM does not shuffle), ``count`` of them at ``rate``; the
    run ends when all have answered (``max_requests``), as ours does."""
    path = out / f"guidellm_{time.monotonic_ns()}.json"
    # Greedy, as our generator sends it (temperature 0): the service samples at 1.0 when a request names none, and
    # GuideLLM sends none unless told (its answers were 29% longer that way).
    backend = {"kind": "openai_http", "target": url, "model": model, "max_tokens": max_tokens,
               "extras": {"body": {"temperature": 0}}}
    command = [binary, "run", "--backend", json.dumps(backend), "--profile", f"kind=constant,rate={rate:g}",
               "--constraint", f"kind=max_requests,count={count}", "--data", f"kind=json_file,path={prompts}",
               "--output", f"kind=json,path={path}", "--disable-console"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=count / rate + 300)
    if done.returncode != 0 or not path.is_file():
        raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    bench = json.loads(path.read_text())["benchmarks"][0]
    made = bench["scheduler_metrics"]["requests_made"]
    span = bench["scheduler_metrics"]["measure_end_time"] - bench["scheduler_metrics"]["measure_start_time"]
    metrics = bench["metrics"]

    def stat(metric: str, which: str) -> float:
        values = metrics[metric]["successful"]
        value = values["mean"] if which == "mean" else values["percentiles"][which]
        return value * 1000 if metric == "request_latency" else value  # seconds there, ms elsewhere

    result = {label: stat(metric, which) for label, _, metric, which in ROWS if metric}
    # Requests completed per second of the measured span (its requests_per_second metric is a distribution of
    # per-interval rates, not this).
    result["request throughput (req/s)"] = made["successful"] / span
    result["errored"], result["incomplete"] = made["errored"], made["incomplete"]
    result["target_start_delay_ms"] = 1000 * bench["scheduler_metrics"]["request_targeted_start_delay_avg"]
    return result


def ratio_text(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model to serve (default: the service's built-in tiny one).")
    parser.add_argument("--rate", type=float, default=20.0, help="Requests/s, constant spacing, for both tools.")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--guidellm", default=shutil.which("guidellm") or str(REPO / ".venv-guidellm/bin/guidellm"))
    args = parser.parse_args()
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"no guidellm at {args.guidellm}: see this script's docstring to install it")
    env = {"VERL_SERVE_MODEL": args.model} if args.model else {}
    theirs_runs: list[dict] = []
    ours_runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        count = round(args.rate * args.duration)
        texts = [p.text for p in load_prompts(DEFAULT_PROMPT_FILE, "prompt", 10_000)]
        texts = (texts * (count // len(texts) + 1))[:count]
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
        with local_service(out / "server.log", env, 300) as url:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
                model = json.load(response)["data"][0]["id"]
            ours(url, out, texts[-max(1, round(5 * args.rate)):], args.rate, args.max_tokens)  # warm-up, not counted
            for repeat in range(args.repeats):
                order = ["ours", "guidellm"] if repeat % 2 == 0 else ["guidellm", "ours"]
                for tool in order:
                    if tool == "ours":
                        ours_runs.append(ours(url, out, texts, args.rate, args.max_tokens))
                    else:
                        theirs_runs.append(guidellm(args.guidellm, url, model, prompts, out, args.rate, count,
                                                    args.max_tokens))
                    print(tool, json.dumps({k: v for k, v in (ours_runs if tool == "ours" else theirs_runs)[-1]
                                            .items() if isinstance(v, int | float)}), flush=True)
    print("=== summary")
    print(f"Model {args.model or 'built-in tiny'}; streamed chats, max_tokens {args.max_tokens}, constant "
          f"{args.rate:g} requests/s for {args.duration:g} s, {args.repeats} repeats per tool, alternating; medians "
          "over repeats. One Locust process against one GuideLLM process, the same service and prompts.\n")
    print("| metric | ours | GuideLLM 0.8.1 | ours / GuideLLM |")
    print("|---|---|---|---|")
    for label, field, _, _ in ROWS:
        mine = statistics.median(r[field] for r in ours_runs)
        theirs = statistics.median(r[label] for r in theirs_runs)
        print(f"| {label} | {mine:.2f} | {theirs:.2f} | {ratio_text(mine, theirs)} |")
    lag = statistics.median(r["schedule_lag_p99_ms"] for r in ours_runs)
    delay = statistics.median(r["target_start_delay_ms"] for r in theirs_runs)
    failed = sum(r["failed"] for r in ours_runs), sum(r["errored"] + r["incomplete"] for r in theirs_runs)
    print(f"\nGenerator lag: ours p99 {lag:.2f} ms behind the schedule; GuideLLM's mean delay from its target start "
          f"{delay:.2f} ms. Failed requests: ours {failed[0]}, GuideLLM {failed[1]}.")


if __name__ == "__main__":
    main()
