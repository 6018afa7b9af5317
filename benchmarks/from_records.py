"""``verl data from-records`` at scale (issue 44's target: 100,000 records in <= 30 s, peak memory <= 1 GB).

A records file as a busy service writes it: ``--records`` request rows with their texts (chat messages and the
answer), a third of them with a user's feedback row, a few marked not-for-training, failed or aborted; prompts
drawn from a pool so that many are asked more than once (exact duplicates after normalisation, and near duplicates
that differ by a word). The command runs in a subprocess, as a user runs it (the CLI, one process); reported: wall
seconds (median of ``--repeats``), the process's peak RSS, and what it wrote.

    python benchmarks/from_records.py --records 100000 --repeats 3     # make bench BENCH=from-records
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERL = str(Path(sys.executable).parent / "verl")
WORDS = ["add", "subtract", "multiply", "the", "numbers", "please", "then", "write", "result", "after", "answer",
         "quickly", "carefully", "show", "your", "work", "briefly", "and", "explain", "each", "step", "of", "it", "for",
         "me"]


def write_records(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    pool = []
    for p in range(n // 4):  # ~4 requests per prompt
        words = rng.sample(WORDS, 8)
        pool.append(f"{' '.join(words)}: what is {rng.randint(1, 999)} + {rng.randint(1, 999)}? (item {p})")
    with path.open("w") as fh:
        for i in range(n):
            question = rng.choice(pool)
            if rng.random() < 0.05:  # a near duplicate: one word more
                question = question.replace(":", " now:", 1)
            row = {"kind": "request", "id": f"cmpl-{i}", "index": 0, "time": 1.7e9 + i * 0.01,
                   "model": rng.choice(["a", "b"]), "route": "default", "prompt_id": "", "prompt_tokens": 30,
                   "completion_tokens": 8, "ttft_s": 0.01, "e2e_s": 0.05, "finish_reason": "stop",
                   "error": "boom" if rng.random() < 0.01 else None, "user": f"u{rng.randint(0, n // 20)}",
                   "not_for_training": rng.random() < 0.02, "prompt": [{"role": "user", "content": question}],
                   "answer": f">> {rng.randint(1, 2000)}", "run": "grpo-a", "step": 20, "weights": "abc"}
            fh.write(json.dumps(row) + "\n")
            if rng.random() < 0.34:
                fh.write(json.dumps({"kind": "reward", "id": f"cmpl-{i}", "index": 0, "time": 1.7e9 + i * 0.01 + 5,
                                     "reward": float(rng.random() < 0.5), "reward_source": "feedback",
                                     "model": row["model"]}) + "\n")


def run_once(records: Path, out: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one `verl data from-records` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run([VERL, "data", "from-records", str(records), "--out", str(out)], capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(" ".join(done.stderr.split()), file=sys.stderr)
    return seconds, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("from_records.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.jsonl"
        write_records(records, args.records)
        size_mb = records.stat().st_size / 1e6
        runs = [run_once(records, Path(tmp) / f"out{k}") for k in range(args.repeats)]
        summary = json.loads((Path(tmp) / "out0" / "summary.json").read_text())
    seconds = [s for s, _ in runs]
    result = {"records": args.records, "file_mb": round(size_mb, 1), "seconds": seconds,
              "median_seconds": statistics.median(seconds), "peak_rss_mib": max(m for _, m in runs),
              "counts": summary["counts"], "written": summary["written"]}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
