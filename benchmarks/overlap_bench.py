"""One-step off-policy vs synchronous GRPO on SmolLM2: seconds per step, side by side in one run (issue 17 item 1).

Both sides run ``verl train --config configs/grpo_smollm2.yaml`` (LoRA r16, 4 prompts x 4 samples x 32 tokens)
with one torch thread per process, in fresh subprocesses one after the other (order alternating per repeat), on
an otherwise idle machine:

- ``sync``: the default; one process does generate, reference and update in turn (one core works).
- ``one_step_off_policy``: ``trainer.one_step_off_policy=true``; the rollout (and, with LoRA, the reference) runs in
  a second process on the other core while the trainer updates.

Same measured span: ``timing/total`` of each step (the trainer's wall time from taking its batch to the end of
the update), steps 2.. (step 1 is warm-up and, off-policy, has nothing to overlap), median per run, then the
median over repeats. Validation and checkpoints are off.

How close to the machine's limit: the model FLOPs of one forward over a step's tokens, F = 2 x (non-embedding
parameters) x (prompt tokens, once per prompt: shared prefill and prefix + response tokens) + 2 x (LM head
parameters) x (response tokens: logits are only taken there); a LoRA step does four of them: generation, the
reference, the update's forward and its backward (input gradients through the frozen base; LoRA's own rank-16
products neglected). Step GFLOP/s = 4F / step time, held against a plain one-thread fp32 GEMM timed in this run
(512x576x1536, a training shape) times the cores the side keeps busy (1 or 2); the update's own GFLOP/s = 2F /
update time against one such GEMM (issue 17 item 3: >= 75%). The GEMM is timed just before each run (this box's
speed drifts by ~10% over minutes) and each run's % is against its own probe; the table gives medians over runs.
And the time to read the weights once at the one-thread read bandwidth, the floor of a decode step.

    python benchmarks/overlap_bench.py --steps 7 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from probes import gemm_gflops, read_gbs
from smollm2_recipe import CONFIG, PLAIN_GRPO

REPO = Path(__file__).resolve().parents[1]
VERL = str(Path(sys.executable).parent / "verl")
SIDES = {"sync": [], "one_step_off_policy": ["trainer.one_step_off_policy=true"]}


def run_side(side: str, steps: int, out: Path, repeat: int, config: Path = CONFIG,
             overrides: list[str] | None = None) -> list[dict]:
    """The per-step timing and rollout rows of steps 2.. of one ``verl train`` run (validation and checkpoints
    off); ``overrides`` default to ``SIDES[side]``."""
    name = f"{side}-{repeat}"
    args = [VERL, "train", "--config", str(config), f"trainer.total_steps={steps}", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.save_freq=0", f"trainer.output_dir={out}",
            f"trainer.experiment_name={name}", "trainer.logger=[jsonl]", *(PLAIN_GRPO if config == CONFIG else []),
            *(SIDES[side] if overrides is None else overrides)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "verl" / name / "verl_logs.jsonl").read_text().splitlines()]
    by_step: dict[int, dict] = {}
    for row in rows:
        if row.get("scope") in ("timing", "rollout"):
            by_step.setdefault(row["step"], {}).update({f"{row['scope']}/{k}": v for k, v in row.items()
                                                        if isinstance(v, float | int) and k != "step"})
    return [by_step[s] for s in sorted(by_step) if s >= 2]


NON_EMBEDDING = 134_515_008 - 49_152 * 576  # SmolLM2-135M minus its (tied) embedding / LM head matrix
LM_HEAD = 49_152 * 576


def forward_gflop(row: dict, prompts: int, n: int) -> float:
    """GFLOP of one forward over a step's tokens, from its logged token counts (see the module docstring)."""
    prompt_tokens = row["rollout/prompt_length_mean"] * prompts  # each prompt once (shared prefill / prefix)
    response_tokens = row["rollout/response_length_mean"] * prompts * n
    return (2 * NON_EMBEDDING * (prompt_tokens + response_tokens) + 2 * LM_HEAD * response_tokens) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/overlap_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gemm = gemm_gflops(512, 576, 1536)  # a training-shaped product of SmolLM2 (rows x hidden x intermediate)
    weights_gb = 134.5e6 * 4 / 1e9
    read = read_gbs(int(weights_gb * 1e9))
    per_side: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            for side in order:
                # The box's speed drifts over a run of minutes: each run is held against a GEMM timed just before it
                probe = gemm_gflops(512, 576, 1536)
                steps = run_side(side, args.steps, Path(tmp), repeat)
                per_side[side].append({
                    "gemm_gflops": probe,
                    "step_s": statistics.median(r["timing/total"] for r in steps),
                    "gen_s": statistics.median(r.get("timing/gen", 0.0) for r in steps),
                    "ref_s": statistics.median(r.get("timing/ref", 0.0) for r in steps),
                    "update_s": statistics.median(r.get("timing/update_actor", 0.0) for r in steps),
                    "wait_rollout_s": statistics.median(r.get("timing/wait_rollout", 0.0) for r in steps),
                    "forward_gflop": statistics.median(forward_gflop(r, 4, 4) for r in steps),
                })
                print(side, repeat, {k: round(v, 2) for k, v in per_side[side][-1].items()}, flush=True)
    probes = [r["gemm_gflops"] for runs in per_side.values() for r in runs]
    summary: dict = {"gemm_gflops_1thread": gemm, "gemm_gflops_per_run": probes, "read_gbs_1thread": read,
                     "steps": args.steps, "repeats": args.repeats, "sides": {}}
    for side, runs in per_side.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        cores = 2 if side == "one_step_off_policy" else 1
        med["gflops"] = 4 * med["forward_gflop"] / med["step_s"]
        med["update_gflops"] = 2 * med["forward_gflop"] / med["update_s"]
        # % of the GEMM: per run against the probe timed just before that run, then the median over runs
        med["pct_of_gemm"] = statistics.median(400 * r["forward_gflop"] / r["step_s"] / (r["gemm_gflops"] * cores)
                                               for r in runs)
        med["update_pct_of_gemm"] = statistics.median(200 * r["forward_gflop"] / r["update_s"] / r["gemm_gflops"]
                                                      for r in runs)
        med["cores_busy"] = cores
        med["runs_step_s"] = [r["step_s"] for r in runs]
        summary["sides"][side] = med
    sync, overlap = summary["sides"]["sync"], summary["sides"]["one_step_off_policy"]
    summary["ratio"] = overlap["step_s"] / sync["step_s"]
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print("=== summary")
    print(f"GRPO on SmolLM2 (configs/grpo_smollm2.yaml, LoRA r16, 4x4x32), one torch thread per process, median of "
          f"steps 2-{args.steps} per run, median of {args.repeats} runs per side:\n")
    print("| side | s/step | gen | ref | update | update waited | step GFLOP/s | % of GEMM x cores | update GFLOP/s "
          "| update % of GEMM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side, med in summary["sides"].items():
        print(f"| {side} ({med['cores_busy']} core{'s' if med['cores_busy'] > 1 else ''}) | {med['step_s']:.2f} | "
              f"{med['gen_s']:.2f} | {med['ref_s']:.2f} | {med['update_s']:.2f} | {med['wait_rollout_s']:.2f} | "
              f"{med['gflops']:.1f} | {med['pct_of_gemm']:.0f}% | {med['update_gflops']:.1f} | "
              f"{med['update_pct_of_gemm']:.0f}% |")
    print(f"\n**one-step off-policy / sync = {summary['ratio']:.2f}x** per step (target <= 0.65x; verl's recipe "
          f"reports 0.71-0.81x on GPUs). Runs (s/step): sync {', '.join(f'{v:.2f}' for v in sync['runs_step_s'])}; "
          f"off-policy {', '.join(f'{v:.2f}' for v in overlap['runs_step_s'])}. Probes in this run: one-thread fp32 "
          f"GEMM 512x576x1536 {gemm:.1f} GFLOP/s at the start, {min(probes):.1f}-{max(probes):.1f} just before "
          f"each run (each run's % is against its own); reading the {weights_gb:.2f} GB of weights once "
          f"{weights_gb / read * 1e3:.0f} ms at {read:.1f} GB/s. In the off-policy rows gen and ref are the rollout "
          "process's times (concurrent with the update); 'update waited' is the trainer's wait for the rollout.")


if __name__ == "__main__":
    main()
