"""An outcome reward model for SmolLM2-135M-Instruct, and GRPO on it alone (issue 43's real-model claim).

Three stages, each timed apart, on an otherwise idle machine:

1. **samples**: ``verl data pairs`` — the base model answers ``builtin:word_problems/train`` stories ``--n`` times at
   the GRPO recipe's temperature; the task's strict rule (``#### N``) marks each answer; a correct answer is chosen
   over an incorrect one to the same story (held-out split by story);
2. **reward model**: ``verl rm`` from the same base model (LoRA, a one-output head) on those pairs; held-out pairwise
   accuracy from its log;
3. **GRPO**: ``verl train --config configs/grpo_smollm2.yaml`` with the RM as the only reward
   (``reward.model.path``; the rule is logged beside it, never trained on), per seed: strict held-out accuracy on
   the 64 validation stories before and after, wall minutes, the process's max RSS.

    python benchmarks/rm_smollm2.py --seeds 1 2 3              # make bench BENCH=rm-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from smollm2_recipe import CONFIG, PLAIN_GRPO

REPO = Path(__file__).resolve().parents[1]
VERL = str(Path(sys.executable).parent / "verl")
MODEL = "builtin:smollm2-135m-instruct"


def rows(path: Path, scope: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("scope") == scope]


def timed(command: list[str], what: str) -> tuple[float, float]:
    """Run ``command``; its wall seconds and the max RSS (GiB) of the children so far."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    return time.perf_counter() - start, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--prompts", type=int, default=1000, help="stories sampled for pairs")
    parser.add_argument("--n", type=int, default=8, help="answers per story")
    parser.add_argument("--rm-steps", type=int, default=100)
    parser.add_argument("--rm-batch", type=int, default=8, help="pairs per RM step")
    parser.add_argument("--rm-lr", type=float, default=2e-4)
    parser.add_argument("--grpo-args", nargs="*", default=[*PLAIN_GRPO, "trainer.one_step_off_policy=true",
                                                        "trainer.total_steps=48"],
                        help="extra verl train overrides for every seed")
    parser.add_argument("--out", default="outputs/bench/rm_smollm2")
    parser.add_argument("--json", default="benchmarks/rm_smollm2.json")
    parser.add_argument("--reuse", action="store_true", help="keep existing pairs and RM (rerun GRPO only)")
    args = parser.parse_args()
    out = Path(args.out)
    result: dict = {"model": MODEL, "load_average_start": os.getloadavg()}

    pairs = out / "pairs"
    if not (args.reuse and (pairs / "train.parquet").is_file()):
        shutil.rmtree(pairs, ignore_errors=True)
        seconds, _ = timed([VERL, "data", "pairs", "--model", MODEL, "--data", "builtin:word_problems/train",
                            "--out", str(pairs), "--n", str(args.n), "--temperature", "0.7", "--max-new-tokens", "32",
                            "--max-prompt-length", "96", "--max-prompts", str(args.prompts), "--pairs-per-prompt",
                            "2"], "verl data pairs")
        result["samples"] = {"seconds": seconds, "prompts": args.prompts, "n": args.n}
        print(json.dumps({"samples": result["samples"]}), flush=True)

    rm_run = out / "verl-rm" / "rm"
    checkpoint = rm_run / "checkpoints" / f"global_step_{args.rm_steps}"
    if not (args.reuse and checkpoint.is_dir()):
        shutil.rmtree(rm_run, ignore_errors=True)
        seconds, rss = timed([VERL, "rm", f"model.path={MODEL}", "model.lora.rank=16", "model.lora.alpha=32",
                              "model.lora.target_modules=all-linear", f"data.train_files=[{pairs / 'train.parquet'}]",
                              f"data.val_files=[{pairs / 'val.parquet'}]", "data.max_length=160",
                              f"data.batch_size={args.rm_batch}", f"optim.lr={args.rm_lr}",
                              f"trainer.total_steps={args.rm_steps}", f"trainer.test_freq={max(1, args.rm_steps // 4)}",
                              f"trainer.output_dir={out}", "trainer.experiment_name=rm", "trainer.logger=[jsonl]",
                              "--quiet"], "verl rm")
        evals = rows(rm_run / "verl_logs.jsonl", "eval")
        result["reward_model"] = {"seconds": seconds, "steps": args.rm_steps,
                                  "pairwise_accuracy": [e["pairwise_accuracy"] for e in evals],
                                  "held_out_pairs": evals[-1].get("pairs")}
        print(json.dumps({"reward_model": result["reward_model"]}), flush=True)

    result["grpo"] = []
    for seed in args.seeds:
        name = f"grpo-rm-seed{seed}"
        shutil.rmtree(out / "verl" / name, ignore_errors=True)
        seconds, rss = timed([VERL, "train", "--config", str(CONFIG),
                              f"reward.model.path={checkpoint}", f"trainer.seed={seed}", "trainer.resume=disable",
                              f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
                              "trainer.logger=[jsonl]", "--quiet", *args.grpo_args], name)
        log = out / "verl" / name / "verl_logs.jsonl"
        evals = rows(log, "eval")
        rollouts = rows(log, "rollout")
        run = {"seed": seed, "minutes": seconds / 60, "max_rss_gib_so_far": rss,
               "accuracy": [(e["step"], e["accuracy"]) for e in evals],
               "gain_points": 100 * (evals[-1]["accuracy"] - evals[0]["accuracy"]),
               "rm_score": [rollouts[0].get("rm_score"), rollouts[-1].get("rm_score")],
               "rollout_acc": [rollouts[0].get("acc"), rollouts[-1].get("acc")],
               "alerts": [a.get("rule") for a in rows(log, "alert")]}
        result["grpo"].append(run)
        print(json.dumps(run), flush=True)
    result["load_average_end"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(result, indent=1))
    print("=== summary")
    samples, rm = result.get("samples"), result.get("reward_model")
    if samples:
        print(f"samples: {samples['prompts']} stories x {samples['n']} answers in {samples['seconds'] / 60:.1f} min")
    if rm:
        print(f"reward model: {rm['steps']} steps in {rm['seconds'] / 60:.1f} min, held-out pairwise accuracy "
              f"{rm['pairwise_accuracy'][0]:.3f} -> {rm['pairwise_accuracy'][-1]:.3f}")
    print("| seed | strict held-out accuracy (64 stories) | gain | minutes | RM score first -> last | alerts |")
    print("|---|---|---|---|---|---|")
    for run in result["grpo"]:
        first, last = run["accuracy"][0][1], run["accuracy"][-1][1]
        print(f"| {run['seed']} | {first:.3f} -> {last:.3f} | {run['gain_points']:+.1f} | {run['minutes']:.1f} | "
              f"{run['rm_score'][0]:.3f} -> {run['rm_score'][1]:.3f} | {', '.join(run['alerts']) or '-'} |")


if __name__ == "__main__":
    main()
