"""GRPO seconds per step by executor + rollout engine: local+transformers vs local+vLLM, at two model sizes.

Each configuration is the real ``verl train`` (default GRPO config: 16 prompts x 8 samples, max 16 new tokens,
KL loss to a reference, one torch thread) in a fresh subprocess, with validation and intermediate checkpoints
off. Seconds/step are read from the run's own ``timing`` rows in verl_logs.jsonl (``total`` = the whole step:
generation, reward, reference log-probs, update and, for vLLM, the weight push into the engine); the first
``--skip`` steps are warm-up and left out; medians over the remaining steps. ``start`` is the process's wall
time to its first step (imports, model load, and for vLLM the engine start).

Sizes: ``builtin:tiny-arith`` (~1M parameters, the shipped warm start) and ``builtin:small-arith-base`` (~25M,
random init: it never emits eos, so every response is 16 tokens and rewards are ~0; the step does the same work).

Run from the vLLM environment (scripts/vllm_env.sh builds it); ``--engines hf`` works from any environment:

    .venv-vllm/bin/python benchmarks/grpo_engines_bench.py                    # both sizes, hf and vllm, 10 steps
    .venv-vllm/bin/python benchmarks/grpo_engines_bench.py --models builtin:tiny-arith --steps 20 --repeats 2

``--executors local ray trl trl2`` adds the Ray executor (``trainer.n_workers=2``) and TRL's ``GRPOTrainer`` on
the same settings (one process, transformers generation) with one torch thread (``trl``) and with two (``trl2``).
Equal compute: ``vs TRL`` compares one-process configurations with ``trl`` (one core each) and the two-worker Ray
executor with ``trl2`` (two cores each). Same span on every side: s/step is the wall time between the ends of
consecutive steps (our ``timing`` rows' timestamps; TRL's step-end callback), so logging and everything else a
step does is inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ["builtin:tiny-arith", "builtin:small-arith-base"]
VERL = str(Path(sys.executable).parent / "verl")


def run_trl(model: str, steps: int, skip: int, workdir: Path, threads: int = 1) -> dict:
    """TRL's GRPOTrainer on the same settings (benchmarks/grpo_vs_trl.py's worker); per-step wall times."""
    out_file = workdir / f"trl{threads}-{model.split(':')[-1]}.json"
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "grpo_vs_trl.py"), "--worker", "trl", "--steps",
                    str(steps), "--model", model, "--threads", str(threads), "--no-eval", "--out", str(out_file)],
                   check=True, timeout=7200)
    wall = time.perf_counter() - start
    # step_seconds[i] is the interval ending at step i + 2 (step 1 has none): leave out the same warm-up steps.
    seconds = json.loads(out_file.read_text())["step_seconds"][max(skip - 1, 0):]
    executor = "trl" if threads == 1 else f"trl{threads}"
    return {"model": model, "executor": executor, "engine": "hf", "steps": steps, "wall_s": wall,
            "start_s": float("nan"), "total": statistics.median(seconds), "gen": float("nan"),
            "ref": float("nan"), "update_actor": float("nan"), "total_min": min(seconds), "total_max": max(seconds)}


def run_one(model: str, executor: str, engine: str, steps: int, skip: int, workdir: Path) -> dict:
    """One ``verl train`` run; returns median step timings (seconds) from its verl_logs.jsonl."""
    if executor.startswith("trl"):
        return run_trl(model, steps, skip, workdir, threads=int(executor[3:] or 1))
    name = f"{model.split(':')[-1]}-{executor}-{engine}"
    args = [VERL, "train", "--quiet", f"model.path={model}", f"rollout.name={engine}", f"trainer.executor={executor}",
            f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
            "trainer.save_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={workdir}",
            f"trainer.experiment_name={name}", "trainer.resume=disable"]
    if executor == "ray":
        args.append("trainer.n_workers=2")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VERL_CACHE_DIR": os.environ.get("VERL_CACHE_DIR",
                                                                                    str(REPO / ".cache"))}
    launched = datetime.now()
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log = workdir / "verl" / name / "verl_logs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    timing = [r for r in rows if r["scope"] == "timing"]
    ends = [datetime.fromisoformat(r["timestamp"]) for r in timing]
    # Wall time between consecutive step ends (the same span as TRL's clock); the stage columns stay per stage.
    walls = [(b - a).total_seconds() for a, b in zip(ends, ends[1:], strict=False)][max(skip - 1, 0):]
    first = timing[0]
    timing = [r for r in timing if r["step"] > skip]
    # Start-up = launch until the first step began (its row is written when it ends, ``total`` seconds later).
    started = (datetime.fromisoformat(first["timestamp"]) - launched).total_seconds() - first["total"]
    out = {"model": model, "executor": executor, "engine": engine, "steps": steps, "wall_s": wall, "start_s": started}
    for key in ("gen", "ref", "update_actor"):
        values = [r[key] for r in timing if key in r]
        out[key] = statistics.median(values) if values else float("nan")
    out["total"], out["total_min"], out["total_max"] = statistics.median(walls), min(walls), max(walls)
    return out


def table(results: list[dict]) -> str:
    lines = ["| model | executor + engine | s/step (min–max) | gen | ref | update (+ sync) | start | vs local+hf | "
             "vs TRL |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r["total"] for r in results if r["executor"] == "local" and r["engine"] == "hf"}
    trl = {(r["model"], r["executor"]): r["total"] for r in results if r["executor"].startswith("trl")}
    for r in results:
        speedup = base.get(r["model"], float("nan")) / r["total"]
        # Equal cores: the two-worker Ray executor against TRL on two threads, one-process runs against one thread.
        peer = "trl2" if r["executor"] in ("ray", "trl2") else "trl"
        vs_trl = trl.get((r["model"], peer), float("nan")) / r["total"]
        lines.append(f"| {r['model']} | {r['executor']}+{r['engine']} | {r['total']:.2f} ({r['total_min']:.2f}–"
                     f"{r['total_max']:.2f}) | {r['gen']:.2f} | {r['ref']:.2f} | {r['update_actor']:.2f} | "
                     f"{r['start_s']:.0f} s | {speedup:.2f}× | {vs_trl:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--executors", nargs="+", default=["local"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (medians are pooled)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo_engines_") as tmp:
        for model in args.models:
            runs: dict[tuple[str, str], list[dict]] = {}
            for repeat in range(args.repeats):
                combos = [(x, e) for x in args.executors for e in args.engines
                          if not (x.startswith("trl") and e != "hf")]
                if repeat % 2:
                    combos.reverse()  # alternate the order so machine noise hits every configuration alike
                for executor, engine in combos:
                    workdir = Path(tmp) / f"r{repeat}"
                    result = run_one(model, executor, engine, args.steps, args.skip, workdir)
                    print(json.dumps(result), flush=True)
                    runs.setdefault((executor, engine), []).append(result)
            for group in runs.values():
                merged = dict(group[0])
                for key in ("total", "gen", "ref", "update_actor", "start_s", "wall_s"):
                    merged[key] = statistics.median(g[key] for g in group)
                merged["total_min"] = min(g["total_min"] for g in group)
                merged["total_max"] = max(g["total_max"] for g in group)
                results.append(merged)
    print("=== summary")
    print(f"GRPO, default config (16 prompts x 8, max 16 new tokens), {args.steps} steps, first {args.skip} "
          f"left out, {args.repeats} run(s) per configuration")
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
