"""Coordinated omission, measured: the same service under closed-loop users and under an open-loop schedule.

One service (``verl loadtest``'s own, on loopback), then streamed chats only (``ChatStreamUser`` / ``OpenLoopUser``,
the same prompts and ``max_tokens``):

1. closed loop: Locust user steps (``--step-users``); each user waits for its answer. The top level's throughput
   is the service's saturated rate T, and its p95 latency what a closed-loop test reports there;
2. open loop: rates of 0.5, 1 and 1.5 x T on a Poisson schedule, latency from the scheduled send.

Above the knee the open loop keeps sending while the service is behind, so the queue shows in its latency; the
closed loop slows its own load instead and reports a p95 that hides it. Same measured span per level/rate.

    .venv/bin/python benchmarks/open_vs_closed.py                                   # the built-in tiny model
    .venv/bin/python benchmarks/open_vs_closed.py --model builtin:smollm2-135m-instruct --step-users 2,4 \\
        --max-tokens 32 --step-time 30
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.open_loop import read_records, summarise  # noqa: E402
from loadtest.open_run import OpenLoopConfig, open_command  # noqa: E402
from loadtest.render import make_report  # noqa: E402
from loadtest.run import local_service, locust_command, run_locust  # noqa: E402
from loadtest.settings import SLO, LoadTestConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model to serve (default: the service's built-in tiny one).")
    parser.add_argument("--step-users", default="8,32")
    parser.add_argument("--step-time", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--factors", default="0.5,1.0,1.5", help="Open-loop rates as multiples of the closed "
                                                                 "loop's top throughput.")
    args = parser.parse_args()
    env = {"VERL_SERVE_MODEL": args.model} if args.model else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        closed_cfg = LoadTestConfig(out_dir=out / "closed", step_users=args.step_users, step_time_s=args.step_time,
                                    step_settle_s=min(5.0, args.step_time / 4), user_classes=["ChatStreamUser"],
                                    max_tokens=args.max_tokens)
        (out / "closed").mkdir()
        with local_service(out / "server.log", env, 300) as url:
            prefix = out / "closed" / "locust"
            code = run_locust(locust_command(url, prefix, closed_cfg.plan(), closed_cfg),
                              closed_cfg.plan().duration_s + 120, out / "closed.log")
            if code not in (0, 1):
                raise SystemExit((out / "closed.log").read_text()[-3000:])
            report, _ = make_report(prefix, out / "closed", SLO(), plots=False)
            top = report["steps"][-1]
            saturated = top["requests_per_s"]
            rows = [{"mode": f"closed loop, {s['users']} users", "offered": None, "throughput": s["requests_per_s"],
                     "p50": s["latency_p50_ms"], "p95": s["latency_p95_ms"], "p99": s["latency_p99_ms"]}
                    for s in report["steps"]]
            open_cfg = OpenLoopConfig(LoadTestConfig(out_dir=out / "open", max_tokens=args.max_tokens), [1.0],
                                      duration_s=args.step_time)
            for factor in (float(f) for f in args.factors.split(",")):
                rate = round(saturated * factor, 2)
                prefix = out / f"open_{rate:g}"
                code = run_locust(open_command(url, prefix, rate, open_cfg), args.step_time + 150,
                                  out / f"open_{rate:g}.log")
                result = summarise(read_records(f"{prefix}_requests.jsonl"), rate, args.step_time)
                rows.append({"mode": f"open loop, {factor:g} x T", "offered": rate,
                             "throughput": result["request_throughput"], "p50": result["median_e2el_ms"],
                             "p95": result["p95_e2el_ms"], "p99": result["p99_e2el_ms"],
                             "failed": result["failed"], "lag_p99": result["schedule_lag_p99_ms"]})
                print(json.dumps(rows[-1]), flush=True)
    print("=== summary")
    print(f"Model {args.model or 'built-in tiny'}; streamed chats, max_tokens {args.max_tokens}, {args.step_time:g} s "
          f"per level/rate; T = the closed loop's top-level throughput ({saturated:.1f} requests/s). Latency in ms "
          "(closed: from the actual send, Locust's window over the level's settled part; open: from the scheduled "
          "send, every request):\n")
    print("| mode | offered req/s | achieved req/s | e2e p50 | e2e p95 | e2e p99 | failed | schedule lag p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['offered'] or '-'} | {r['throughput']:.1f} | {r['p50']:.0f} | {r['p95']:.0f} | "
              f"{r['p99']:.0f} | {r.get('failed', '-')} | "
              f"{'-' if r.get('lag_p99') is None else format(r['lag_p99'], '.1f')} |")
    above = [r for r in rows if r["offered"] and r["offered"] > saturated]
    if above:
        ratio = above[-1]["p95"] / rows[len(report["steps"]) - 1]["p95"]
        print(f"\nAbove the knee, at about the same achieved throughput, the open loop's p95 is {ratio:.1f}x the "
              "closed loop's: the queue a closed loop's users never build.")


if __name__ == "__main__":
    main()
