"""Serving throughput at saturation: one uvicorn process, Ray Serve with 1 replica, Ray Serve with 2 replicas
(issue 27 item 7), one run.

Each mode serves ``--model`` (default ``builtin:tiny-arith``) with one torch thread per process/replica and takes the
same Locust shape: ``--users`` closed-loop users (no wait) sending ``/v1/completions`` with ``max_tokens`` tokens for
one step of ``--step-time`` s, the first ``--settle`` s left out (the project's stepped shape and capacity-report
reader, so the rate is Locust's own count over the measured window). Modes alternate over ``--repeats`` rounds;
medians. Ratios: 2 replicas over 1 (scaling; target >= 1.7x) and Ray Serve at 1 replica over plain uvicorn (the
proxy's overhead).

On a 2-core box the load generator (Locust, one process) and Ray Serve's proxy take CPU too, so two replicas with
one thread each do not have two cores to themselves; the summary prints the box's core count beside the ratio.

    .venv/bin/python benchmarks/fleet_scaling.py --users 16 --step-time 30 --repeats 2
    .venv/bin/python benchmarks/fleet_scaling.py --model builtin:smollm2-135m-instruct --users 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start(mode: str, port: int, model: str) -> subprocess.Popen:
    env = {**os.environ, "VERL_SERVE_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "VERL_SERVE_MODEL": model}
    if mode == "uvicorn":
        command = [sys.executable, "-m", "uvicorn", "serve.api:app", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning"]
    else:
        replicas = mode.split("x")[-1]
        command = [sys.executable, "-m", "verl.cli", "serve", "--replicas", replicas, "--port", str(port)]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_ready(url: str, replicas: int | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = httpx.get(url + "/health", timeout=5).json()
            if health["status"] == "ok" and (replicas is None or health.get("replicas") == replicas):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def measure(url: str, out: Path, users: int, step_time: float, settle: float, max_tokens: int) -> dict:
    from loadtest.report import build_report
    from loadtest.run import LOCUST_CONF, LOCUSTFILE

    prefix = out / "locust"
    command = [sys.executable, "-m", "locust", "--config", str(LOCUST_CONF), "-f", str(LOCUSTFILE), "--headless", "-H",
               url, "--csv", str(prefix), "--csv-full-history", "--html", str(out / "locust.html"), "--load-shape",
               "steps", "--step-users", str(users), "--step-time", f"{step_time:g}", "--step-settle", f"{settle:g}",
               "--max-tokens", str(max_tokens), "--wait-max", "0", "CompletionUser"]
    with (out / "locust.log").open("w") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=step_time + 120, check=False)
    step = build_report(prefix)["steps"][-1]
    return {"rps": step["requests_per_s"], "p95_ms": step["latency_p95_ms"], "failures": step["failures"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from verl.utils.net import free_port

    modes = ["uvicorn", "serve x1", "serve x2"]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start(mode, port, args.model)
                try:
                    wait_ready(url, None if mode == "uvicorn" else int(mode.split("x")[-1]))
                    out = Path(tmp) / f"{mode.replace(' ', '_')}_{repeat}"
                    out.mkdir()
                    result = measure(url, out, args.users, args.step_time, args.settle, args.max_tokens)
                finally:
                    stop(proc)
                results[mode].append(result)
                print(f"{mode}: {result}", flush=True)
                time.sleep(3)  # let the previous cluster's processes go

    print("=== summary")
    print(f"{args.model}, /v1/completions max_tokens={args.max_tokens}, {args.users} closed-loop Locust users, "
          f"{args.step_time:g} s per run ({args.settle:g} s settle left out), one torch thread per process/replica, "
          f"{os.cpu_count()} cores; medians of {args.repeats}")
    rps = {mode: statistics.median(r["rps"] for r in results[mode]) for mode in modes}
    print(f"{'mode':<12} {'req/s':>8} {'runs':>24}")
    for mode in modes:
        runs = ", ".join(f"{r['rps']:.1f}" for r in results[mode])
        print(f"{mode:<12} {rps[mode]:>8.1f} {runs:>24}")
    print(f"scaling 1 -> 2 replicas: {rps['serve x2'] / rps['serve x1']:.2f}x (target 1.7x); Ray Serve overhead at "
          f"1 replica: {rps['serve x1'] / rps['uvicorn']:.2f}x plain uvicorn's throughput")


if __name__ == "__main__":
    main()
