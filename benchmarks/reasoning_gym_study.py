"""The reasoning-gym RL study (issue 62): SmolLM2-135M-Instruct after the format cold start, trained with
configs/reasoning_gym_smollm2.yaml, one run per seed; per task the held-out accuracy before (the run's step-0
validation) and after (its last), the gain with a 95% interval, the mix's gain (median over seeds) and the transfer
task (spell_backward, never trained on).

Validation items are the config's (moved past the training items by the trainer; nothing was chosen on them). The
gain's interval is the normal one of a difference of two proportions over the task's items, taken as independent
samples: the same items are scored before and after, so a paired interval would be narrower; this one is
conservative.

    .venv/bin/python benchmarks/reasoning_gym_study.py --ckpt COLD_START [--seeds 1,2,3] [--set actor.optim.lr=5e-5]
    .venv/bin/python benchmarks/reasoning_gym_study.py --from-runs RUN_DIR [RUN_DIR ...]   # summarise finished runs
        -> benchmarks/reasoning_gym_study.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "reasoning_gym_smollm2.yaml"
TRANSFER = "spell_backward"
Z95 = 1.959963984540054


def evaluations(run_dir: Path) -> tuple[dict, dict]:
    """The run's first and last validation rows (``scope == eval``)."""
    rows = [json.loads(line) for line in (run_dir / "verl_logs.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("scope") == "eval"]
    if len(evals) < 2:
        raise SystemExit(f"{run_dir}: needs validation before and after training (got {len(evals)} eval rows)")
    return evals[0], evals[-1]


def per_task(before: dict, after: dict) -> dict[str, dict]:
    """task -> accuracy before and after, items, gain and its 95% interval."""
    tasks = sorted(k.split("/")[1] for k in before if k.startswith("kind/") and k.endswith("/accuracy"))
    out = {}
    for task in tasks:
        p0, p1 = before[f"kind/{task}/accuracy"], after[f"kind/{task}/accuracy"]
        n = int(after[f"kind/{task}/num_samples"])
        half = Z95 * math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / n)
        out[task] = {"before": p0, "after": p1, "items": n, "gain": p1 - p0,
                     "ci": [p1 - p0 - half, p1 - p0 + half]}
    return out


def mix_gain(tasks: dict[str, dict]) -> tuple[float, float]:
    """Item-weighted accuracy of the trained tasks (the transfer task aside), before and after."""
    trained = [t for name, t in tasks.items() if name != TRANSFER]
    items = sum(t["items"] for t in trained)
    return (sum(t["before"] * t["items"] for t in trained) / items,
            sum(t["after"] * t["items"] for t in trained) / items)


def summarise(run_dirs: list[Path], seconds: dict[str, float]) -> dict:
    runs = []
    for run_dir in run_dirs:
        before, after = evaluations(run_dir)
        tasks = per_task(before, after)
        mix_before, mix_after = mix_gain(tasks)
        runs.append({"run_dir": str(run_dir), "tasks": tasks, "mix_before": mix_before, "mix_after": mix_after,
                     "mix_gain": mix_after - mix_before, "seconds": seconds.get(str(run_dir))})
    return {"runs": runs, "median_mix_gain": statistics.median(r["mix_gain"] for r in runs)}


def train(ckpt: str, seed: int, sets: list[str], out: Path) -> tuple[Path, float]:
    name = f"rg_study_seed{seed}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "verl.cli", "train", "--config", str(CONFIG), f"model.path={ckpt}",
                    f"trainer.seed={seed}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}", *sets],
                   cwd=REPO, check=True)
    return out / "verl" / name, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", help="the cold-start checkpoint (verl sft --config "
                        "configs/sft_reasoning_gym_smollm2.yaml)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--set", action="append", default=[], help="a config override for every run")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/rg_study"), help="where the runs go")
    parser.add_argument("--from-runs", nargs="+", type=Path, help="summarise these finished run directories")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "reasoning_gym_study.json")
    args = parser.parse_args()
    seconds: dict[str, float] = {}
    if args.from_runs:
        run_dirs = list(args.from_runs)
    else:
        if not args.ckpt:
            parser.error("--ckpt (the cold start) or --from-runs")
        run_dirs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir, took = train(args.ckpt, seed, args.set, args.runs)
            run_dirs.append(run_dir)
            seconds[str(run_dir)] = round(took, 1)
    summary = summarise(run_dirs, seconds)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for run in summary["runs"]:
        print(f"{run['run_dir']}: mix {run['mix_before']:.1%} -> {run['mix_after']:.1%} ({run['mix_gain']:+.1%})")
        for task, t in run["tasks"].items():
            print(f"  {task:24s} {t['before']:.1%} -> {t['after']:.1%}  gain {t['gain']:+.1%} "
                  f"[{t['ci'][0]:+.1%}, {t['ci'][1]:+.1%}]  ({t['items']} items)")
    print(f"median mix gain over {len(summary['runs'])} runs: {summary['median_mix_gain']:+.1%}")


if __name__ == "__main__":
    main()
