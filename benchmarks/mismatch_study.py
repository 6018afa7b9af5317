"""Does a mismatched rollout hurt, and does verl's correction help? The tiny default (`verl train`, 60 GRPO steps)
three ways, each over seeds: fp32 rollouts (matched to the fp32 trainer), bf16 rollouts uncorrected
(`rollout.dtype=bfloat16`), and bf16 rollouts with token-level truncated IS (`algorithm.rollout_correction.preset=
decoupled_token_is`). Reported per arm: the final held-out accuracy (strict, greedy, the run's validation), the
mean `rollout_corr/k3_kl` over steps, and the wall time. Runs go two at a time, one torch thread each.

    .venv/bin/python benchmarks/mismatch_study.py                  # 3 seeds x 3 arms (~15 min on 2 cores)
    .venv/bin/python benchmarks/mismatch_study.py --seeds 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERL = str(Path(sys.executable).parent / "verl")
ARMS = {
    "fp32 rollout (matched)": [],
    "bf16 rollout, uncorrected": ["rollout.dtype=bfloat16"],
    "bf16 rollout + decoupled_token_is": ["rollout.dtype=bfloat16",
                                          "algorithm.rollout_correction.preset=decoupled_token_is"],
}


def run(arm: str, seed: int, steps: int, root: Path) -> dict:
    name = f"{arm.split()[0]}-{len(ARMS[arm])}-s{seed}"
    start = time.perf_counter()
    done = subprocess.run([VERL, "train", f"trainer.seed={seed}", f"trainer.total_steps={steps}",
                           f"trainer.test_freq={steps}", "trainer.save_freq=0", f"trainer.output_dir={root}",
                           f"trainer.experiment_name={name}", "--quiet", *ARMS[arm]],
                          capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (root / "verl" / name / "verl_logs.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["scope"] == "eval"]
    k3 = [r["k3_kl"] for r in rows if r["scope"] == "rollout_corr" and "k3_kl" in r]
    return {"arm": arm, "seed": seed, "accuracy_before": evals[0]["accuracy"], "accuracy": evals[-1]["accuracy"],
            "k3_kl_mean": statistics.mean(k3), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "mismatch_study.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        jobs = [pool.submit(run, arm, seed, args.steps, Path(tmp)) for seed in range(1, args.seeds + 1) for arm in ARMS]
        results = [job.result() for job in jobs]
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("| arm | held-out accuracy per seed | median | mean rollout_corr/k3_kl | median wall |")
    print("|---|---|---|---|---|")
    for arm in ARMS:
        rows = [r for r in results if r["arm"] == arm]
        accs = [r["accuracy"] for r in rows]
        print(f"| {arm} | {' / '.join(f'{a:.1%}' for a in accs)} | {statistics.median(accs):.1%} | "
              f"{statistics.mean(r['k3_kl_mean'] for r in rows):.2e} | "
              f"{statistics.median(r['seconds'] for r in rows):.0f} s |")


if __name__ == "__main__":
    main()
