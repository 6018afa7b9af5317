"""The price of isolation: runs per second of a trivial program in the sandbox against plain ``subprocess``.

    python benchmarks/sandbox_throughput.py --runs 200 --concurrency 2 --repeats 3

Both sides run the same interpreter on the same program (``print(1)``) the same number of times, ``--concurrency``
at once from a thread pool, in alternating rounds; the ratio is of the medians of their runs/s. The sandbox side is
the code reward's path: ``Sandbox.run`` (bubblewrap namespaces, the limits' launcher, a pids cgroup as root, files
in and out); the peer is ``subprocess.run([python, -I, -c, code])`` with a pipe for its output and nothing else.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import time

from verl.sandbox import Limits, RunCodeRequest, Sandbox, mechanism
from verl.sandbox.isolation import interpreter, process_limit_holds

CODE = "print(1)"


def plain(_: int) -> bool:
    out = subprocess.run([interpreter(), "-I", "-c", CODE], capture_output=True, text=True, check=False)
    return out.stdout == "1\n"


def timed(fn, runs: int, concurrency: int) -> float:
    """Runs per second of ``fn`` called ``runs`` times, ``concurrency`` at once; every run must succeed."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        ok = list(pool.map(fn, range(runs)))
    elapsed = time.perf_counter() - start
    assert all(ok), f"{ok.count(False)} of {runs} runs failed"
    return runs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sandbox = Sandbox(Limits(), max_concurrent=args.concurrency)

    def isolated(_: int) -> bool:
        reply = sandbox.run(RunCodeRequest(code=CODE))
        return reply.status == "Success" and reply.run_result.stdout == "1\n"

    rates: dict[str, list[float]] = {"sandbox": [], "subprocess": []}
    timed(isolated, 10, args.concurrency)  # warm both: the interpreter's files in the page cache
    timed(plain, 10, args.concurrency)
    for repeat in range(args.repeats):
        order = [("sandbox", isolated), ("subprocess", plain)]
        for name, fn in order if repeat % 2 == 0 else order[::-1]:
            rates[name].append(timed(fn, args.runs, args.concurrency))
            print(f"repeat {repeat + 1} {name}: {rates[name][-1]:.1f} runs/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print("=== summary")
    print(f"{args.runs} runs of `{CODE}` x {args.repeats} repeats, {args.concurrency} at once, "
          f"{os.cpu_count()} cores; isolation: {mechanism()} (process limit held: {process_limit_holds()}, "
          f"as {'root' if os.geteuid() == 0 else 'a user'})\n")
    print("| side | runs/s (median) | all repeats |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {medians[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    print(f"\nsubprocess / sandbox (the price of isolation): **{medians['subprocess'] / medians['sandbox']:.2f}x** "
          "(goal <= 2x)")


if __name__ == "__main__":
    main()
