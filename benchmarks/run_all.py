"""Run every benchmark and rewrite its block in benchmarks/RESULTS.md (``make bench``).

    python benchmarks/run_all.py                     # all of them (about 2.5 hours on the 2-core box)
    python benchmarks/run_all.py grpo-smollm2 eval-smollm2   # some, by name
    python benchmarks/run_all.py --list

Each benchmark runs as the command shown in its block (the main venv, or ``.venv-vllm`` where vLLM is needed),
one after another on an otherwise idle machine; nothing else should run meanwhile (every comparison inside gives
both sides the same cores and threads). What a benchmark prints after its ``=== summary`` line replaces the text
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in RESULTS.md, with the date, the command and the load
average; the prose around the blocks (how to read them) is written by hand. A block that does not exist yet is
appended under "Latest make bench output". RESULTS.md is rewritten atomically after each benchmark, so an
interrupted run keeps what finished.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
PY = str(REPO / ".venv" / "bin" / "python")
VLLM_PY = str(REPO / ".venv-vllm" / "bin" / "python")
SMOLLM2 = "builtin:smollm2-135m-instruct"

BENCHES: dict[str, list[str]] = {
    "grpo-tiny": [PY, "benchmarks/grpo_vs_trl.py", "--preset", "tiny", "--steps", "30", "--repeats", "3"],
    "grpo-smollm2": [PY, "benchmarks/grpo_vs_trl.py", "--preset", "smollm2", "--steps", "6", "--repeats", "3"],
    "grpo-engines": [VLLM_PY, "benchmarks/grpo_engines_bench.py", "--executors", "local", "ray", "trl", "trl2",
                     "--engines", "hf", "vllm", "--steps", "10"],
    "eval-tiny": [PY, "benchmarks/eval_vs_lm_eval.py"],
    "eval-smollm2": [PY, "benchmarks/eval_vs_lm_eval.py", "--ckpt", SMOLLM2, "--data", "builtin:word_problems/val",
                     "--prompts", "64", "--max-new-tokens", "32", "--max-prompt-length", "96", "--repeats", "3",
                     "--cli-repeats", "2"],
    "serve": [PY, "benchmarks/serve_bench.py", "--requests-per-client", "1"],
    "serve-smollm2": [PY, "benchmarks/serve_bench.py", "--model", SMOLLM2, "--chat", "--only",
                      "ours-hf,ours-vllm,static", "--concurrency", "1", "16", "--max-tokens", "128", "--batch", "16",
                      "--requests-per-client", "1", "--min-requests", "8", "--rounds", "3",
                      "--out", "benchmarks/serve_bench_smollm2.json"],
    "rollout-smollm2": [VLLM_PY, "benchmarks/rollout_bench.py", "--models", SMOLLM2, "--shapes", "4x4x64",
                        "16x1x128", "--repeats", "3"],
    "rollout-small": [VLLM_PY, "benchmarks/rollout_bench.py", "--repeats", "3"],
    "lora-memory": [PY, "benchmarks/lora_memory.py"],
    "overlap-smollm2": [PY, "benchmarks/overlap_bench.py", "--steps", "7", "--repeats", "3"],
    "update-packed": [PY, "benchmarks/update_bench.py", "--steps", "7", "--repeats", "3"],
    "update-packed-agent": [PY, "benchmarks/update_bench.py", "--preset", "agent-tiny", "--steps", "10", "--repeats",
                            "3"],
    "decode-profile": [PY, "benchmarks/decode_profile.py", "--model", SMOLLM2, "--rows", "16"],
    "adapter-batching": [PY, "benchmarks/adapter_batching.py", "--model", SMOLLM2, "--rows", "16", "--adapters", "4"],
    # The shipped warm start calls the tool in a quarter of its answers; the RL-trained agent (configs/agent_tiny.yaml)
    # in nearly all: pass --model <its checkpoint> for the all-calls case recorded in RESULTS.md.
    "agent-rollout": [PY, "benchmarks/agent_rollout.py"],
    "time-to-target": [PY, "benchmarks/time_to_target.py", "--seeds", "1", "2", "3"],
    "rm-smollm2": [PY, "benchmarks/rm_smollm2.py", "--seeds", "1", "2", "3"],
    "canary-matrix": [PY, "benchmarks/canary_matrix.py", "--sims", "2000", "--workers", "2"],
    "from-records": [PY, "benchmarks/from_records.py", "--records", "100000", "--repeats", "3"],
    "open-vs-closed": [PY, "benchmarks/open_vs_closed.py"],
    "open-vs-closed-smollm2": [PY, "benchmarks/open_vs_closed.py", "--model", SMOLLM2, "--step-users", "2,8",
                               "--step-time", "30"],
    "open-loop-generator": [PY, "benchmarks/open_loop_generator.py", "--rate", "200", "--duration", "20",
                            "--repeats", "3"],
    "open-loop-crosscheck": [PY, "benchmarks/open_loop_crosscheck.py", "--rate", "20", "--duration", "20",
                             "--repeats", "3"],
    "open-loop-crosscheck-smollm2": [PY, "benchmarks/open_loop_crosscheck.py", "--model", SMOLLM2, "--rate", "2",
                                     "--duration", "30", "--repeats", "3"],
    "humaneval-smollm2": [PY, "benchmarks/humaneval_smollm2.py", "--n", "10"],
    "code-learning-smollm2": [PY, "benchmarks/code_learning_smollm2.py", "--steps", "30", "--seed", "1"],
    "sandbox-throughput": [PY, "benchmarks/sandbox_throughput.py", "--runs", "200", "--concurrency", "2",
                           "--repeats", "3"],
    "open-loop-engines": [PY, "benchmarks/open_loop_engines.py", "--rates", "2,4,6", "--duration", "30", "--slo",
                          "ttft:1000,tpot:150"],
}


def summary_of(stdout: str) -> str:
    """What the benchmark printed after its last ``=== summary`` line (everything, if it printed none)."""
    marker = stdout.rfind("=== summary")
    text = stdout[stdout.index("\n", marker) + 1:] if marker >= 0 else stdout
    return text.strip("\n")


def rewrite_block(markdown: str, name: str, body: str) -> str:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(markdown):
        return pattern.sub(lambda _: block, markdown)
    heading = "## Latest `make bench` output"
    if heading not in markdown:
        markdown = markdown.rstrip("\n") + f"\n\n{heading}\n"
    return markdown.rstrip("\n") + f"\n\n### {name}\n\n{block}\n"


def run(name: str) -> str:
    command = BENCHES[name]
    shown = " ".join(Path(command[0]).relative_to(REPO).as_posix() if i == 0 else part
                     for i, part in enumerate(command))
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    print(f"[{name}] {shown}", flush=True)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "VERL_CACHE_DIR": os.environ.get("VERL_CACHE_DIR", str(REPO / ".cache"))})
    minutes = (time.perf_counter() - started) / 60
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed ({proc.returncode}) after {minutes:.1f} min:\n{proc.stderr[-4000:]}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"Last run {when} ({minutes:.0f} min, 1-minute load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after):\n\n    {shown}\n")
    return f"{head}\n```\n{summary_of(proc.stdout)}\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for name, command in BENCHES.items():
            print(f"{name:16s} {' '.join(command[1:])}")
        return
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    for name in args.names or list(BENCHES):
        if BENCHES[name][0] == VLLM_PY and not Path(VLLM_PY).exists():
            raise SystemExit(f"[{name}] needs {VLLM_PY}: bash scripts/vllm_env.sh")
        body = run(name)
        text = rewrite_block(RESULTS.read_text(), name, body)
        tmp = RESULTS.with_suffix(".md.tmp")
        tmp.write_text(text)
        tmp.replace(RESULTS)
        print(body, flush=True)


if __name__ == "__main__":
    sys.exit(main())
