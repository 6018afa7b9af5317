"""Our GRPO vs TRL's GRPOTrainer, side by side in one run: seconds per step and accuracy at equal steps.

Same warm start (builtin:tiny-arith), same task (builtin:arithmetic), same batch (16 prompts x 8 completions),
lr 1e-4 constant, beta 0.04 (KL to a reference), epsilon 0.2, token-level loss (TRL "dapo" = our token-mean),
max 16 new tokens, temperature 1.0, one torch thread, CPU fp32. Each repeat runs both trainers in fresh
subprocesses, alternating order, so machine noise hits both alike; we report medians.

Accuracy for both is measured by the same code (our validation: greedy, strict `>> N`, 256 held-out prompts).

    python benchmarks/grpo_vs_trl.py --steps 30 --repeats 3
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
from pathlib import Path

PROMPTS_PER_STEP = 16
GROUP = 8
LR = 1e-4
BETA = 0.04
MAX_NEW = 16


def _setup() -> None:
    os.environ.setdefault("VERL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def evaluate(model, tokenizer) -> dict[str, float]:
    from verl.config import DataConfig
    from verl.data.dataset import RLHFDataset
    from verl.rollout.base import SamplingParams
    from verl.rollout.hf import HFRollout
    from verl.trainer.validation import generate_and_score, validation_metrics
    from verl.workers.reward import RewardManager

    val = RLHFDataset(["builtin:arithmetic/val"], tokenizer, DataConfig(), "data.val_files")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW)
    engine, reward = HFRollout(model, tokenizer), RewardManager(tokenizer)
    batch, scores, extras, _ = generate_and_score(engine, val, reward, params, 256)
    metrics = validation_metrics(batch, scores, extras)
    return {"accuracy": metrics["accuracy"], "accuracy_flexible": metrics["accuracy_flexible"]}


def run_ours(steps: int, seed: int, workdir: Path, model_path: str = "builtin:tiny-arith",
             evaluate_model: bool = True) -> dict:
    from verl.trainer.local import LocalPPOTrainer

    trainer = LocalPPOTrainer({
        "model": {"path": model_path},
        "data": {"train_batch_size": PROMPTS_PER_STEP, "max_response_length": MAX_NEW},
        "rollout": {"n": GROUP, "temperature": 1.0},
        "actor": {"optim": {"lr": LR}, "ppo_mini_batch_size": PROMPTS_PER_STEP, "use_kl_loss": True,
                  "kl_loss_coef": BETA, "kl_loss_type": "low_var_kl", "clip_ratio": 0.2, "loss_agg_mode": "token-mean"},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_steps": steps, "test_freq": 0, "val_before_train": False, "save_freq": 0, "seed": seed,
                    "logger": ["jsonl"], "output_dir": str(workdir), "experiment_name": "ours",
                    "num_samples_to_log": 0},
    }, quiet=True)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    step_seconds = [r["total"] for r in rows if r["scope"] == "timing"]
    scores = evaluate(trainer.model, trainer.tokenizer) if evaluate_model else {"accuracy": float("nan"),
                                                                                 "accuracy_flexible": float("nan")}
    return {"step_seconds": step_seconds, "wall": wall, **scores}


def run_trl(steps: int, seed: int, workdir: Path, model_path: str = "builtin:tiny-arith",
            evaluate_model: bool = True) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.data.dataset import read_rows
    from verl.models.loader import load_tokenizer, resolve_model_path
    from verl.rewards.registry import arithmetic

    path = resolve_model_path(model_path)
    tokenizer = load_tokenizer(model_path)
    rows = read_rows(["builtin:arithmetic/train"], "data.train_files")
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def strict_reward(prompts, completions, ground_truth, **_):
        return [arithmetic("arithmetic", c[-1]["content"], gt)["score"] for c, gt in zip(completions, ground_truth,
                                                                                         strict=True)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, args, state, control, **kw):
            self.marks.append(["begin", time.perf_counter()])

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(["end", time.perf_counter()])

    clock = StepClock()
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, seed=seed,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP, gradient_accumulation_steps=1,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=BETA, epsilon=0.2, loss_type="dapo", max_completion_length=MAX_NEW, temperature=1.0,
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = GRPOTrainer(model=model, reward_funcs=[strict_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its per-step dict prints would drown the table
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    begins = [t for kind, t in clock.marks if kind == "begin"]
    ends = [t for kind, t in clock.marks if kind == "end"]
    # A TRL "step" includes generation (done inside the step for the first micro-step).
    step_seconds = [e - b for b, e in zip(begins, ends, strict=False)]
    scores = evaluate(trainer.model, tokenizer) if evaluate_model else {"accuracy": float("nan"),
                                                                         "accuracy_flexible": float("nan")}
    return {"step_seconds": step_seconds, "wall": wall, **scores}


def worker(kind: str, steps: int, seed: int, out: Path, model_path: str, evaluate_model: bool) -> None:
    _setup()
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_ours if kind == "ours" else run_trl)(steps, seed, Path(tmp), model_path, evaluate_model)
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["ours", "trl"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="builtin:tiny-arith", help="worker mode: model to train")
    parser.add_argument("--no-eval", action="store_true", help="worker mode: skip the final accuracy evaluation")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.seed, args.out, args.model, not args.no_eval)
        return

    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ["ours", "trl"] if repeat % 2 == 0 else ["trl", "ours"]
            for kind in order:
                out = Path(tmp) / f"{kind}-{repeat}.json"
                subprocess.run([sys.executable, __file__, "--worker", kind, "--steps", str(args.steps),
                                "--seed", str(args.seed + repeat), "--out", str(out)], check=True)
                result = json.loads(out.read_text())
                results[kind].append(result)
                per_step = statistics.median(result["step_seconds"][1:])
                print(f"repeat {repeat} {kind:4s}: {per_step:.3f} s/step (median), wall {result['wall']:.1f} s, "
                      f"accuracy {result['accuracy']:.3f} (flexible {result['accuracy_flexible']:.3f})", flush=True)

    def summary(kind: str) -> dict[str, float]:
        per_step = [statistics.median(r["step_seconds"][1:]) for r in results[kind]]
        return {"s_per_step": statistics.median(per_step), "accuracy": statistics.median(r["accuracy"] for r in
                                                                                         results[kind]),
                "wall": statistics.median(r["wall"] for r in results[kind])}

    ours, trl = summary("ours"), summary("trl")
    print()
    print(f"| trainer | s/step (median of {args.repeats} medians) | accuracy after {args.steps} steps | wall s |")
    print("|---|---|---|---|")
    print(f"| verl suite GRPO | {ours['s_per_step']:.3f} | {ours['accuracy']:.3f} | {ours['wall']:.1f} |")
    print(f"| TRL GRPOTrainer | {trl['s_per_step']:.3f} | {trl['accuracy']:.3f} | {trl['wall']:.1f} |")
    print(f"\nthroughput ratio (TRL s/step / ours s/step): {trl['s_per_step'] / ours['s_per_step']:.2f}x")


if __name__ == "__main__":
    main()
