"""Our GRPO vs TRL's GRPOTrainer, side by side in one run: seconds per step and (tiny preset) accuracy at equal steps.

Two presets, each the same settings on both sides:
- ``tiny``: warm start builtin:tiny-arith on builtin:arithmetic, 16 prompts x 8 completions, lr 1e-4, beta 0.04,
  max 16 new tokens, temperature 1.0, full fine-tuning.
- ``smollm2``: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct) on builtin:word_problems with
  configs/grpo_smollm2.yaml's shape: 4 prompts x 4 completions, 32 new tokens, temperature 0.7, lr 2e-4, beta 0.01,
  LoRA r16 / alpha 32 on all linear layers (peft on both sides; the reference is the base with adapters disabled).
Both: epsilon 0.2, token-level loss (TRL "dapo" = our token-mean), group-std advantages, one optimizer step per
batch, CPU fp32, no gradient checkpointing.

Equal compute: each trainer runs in its own fresh subprocess with ONE torch thread, one after the other (never
together), order alternating per repeat. Our local executor is one process, so both sides use one core.
Same measured span: seconds per step = wall time between the ends of consecutive optimizer steps, taken by a
step-end callback on both sides — generation, reward, reference, update and each side's own per-step logging all
fall inside it; the first step (warm-up) is left out. Accuracy (tiny preset) is measured by the same code for both
(our validation: greedy, strict answer format, held-out prompts).

    python benchmarks/grpo_vs_trl.py --preset tiny --steps 30 --repeats 3
    python benchmarks/grpo_vs_trl.py --preset smollm2 --steps 6 --repeats 3
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    model: str
    train: str
    val: str
    prompts_per_step: int
    group: int
    lr: float
    beta: float
    max_new: int
    temperature: float
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    max_prompt_length: int = 64
    eval_prompts: int = 256


PRESETS = {
    "tiny": Preset("builtin:tiny-arith", "builtin:arithmetic/train", "builtin:arithmetic/val", 16, 8, 1e-4, 0.04,
                   16, 1.0),
    "smollm2": Preset("builtin:smollm2-135m-instruct", "builtin:word_problems/train", "builtin:word_problems/val",
                      4, 4, 2e-4, 0.01, 32, 0.7, lora_rank=16, lora_alpha=32, max_prompt_length=96, eval_prompts=64),
}


def _setup(threads: int) -> None:
    os.environ.setdefault("VERL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def evaluate(model, tokenizer, preset: Preset) -> dict[str, float]:
    from verl.config import DataConfig
    from verl.data.dataset import RLHFDataset
    from verl.rollout.base import SamplingParams
    from verl.rollout.hf import HFRollout
    from verl.trainer.validation import generate_and_score, validation_metrics
    from verl.workers.reward import RewardManager

    data = DataConfig(max_prompt_length=preset.max_prompt_length)
    val = RLHFDataset([preset.val], tokenizer, data, "data.val_files")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=preset.max_new)
    engine, reward = HFRollout(model, tokenizer), RewardManager(tokenizer)
    batch, scores, extras, _ = generate_and_score(engine, val, reward, params, preset.eval_prompts)
    metrics = validation_metrics(batch, scores, extras)
    return {"accuracy": metrics["accuracy"], "accuracy_flexible": metrics["accuracy_flexible"]}


def _no_scores() -> dict[str, float]:
    return {"accuracy": float("nan"), "accuracy_flexible": float("nan")}


def _intervals(marks: list[float]) -> list[float]:
    """Seconds per step: wall time between consecutive step ends (the first step, from start-up, has none)."""
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def run_ours(preset: Preset, steps: int, seed: int, workdir: Path, evaluate_model: bool) -> dict:
    from verl.trainer.local import LocalPPOTrainer

    class StepClock:
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_end(self, trainer, step, metrics) -> None:
            self.marks.append(time.perf_counter())

    model: dict = {"path": preset.model}
    if preset.lora_rank:
        model["lora"] = {"rank": preset.lora_rank, "alpha": preset.lora_alpha, "target_modules": "all-linear"}
    trainer = LocalPPOTrainer({
        "model": model,
        "data": {"train_files": [preset.train], "val_files": [preset.val], "train_batch_size": preset.prompts_per_step,
                 "max_prompt_length": preset.max_prompt_length, "max_response_length": preset.max_new},
        "rollout": {"n": preset.group, "temperature": preset.temperature},
        "actor": {"optim": {"lr": preset.lr}, "ppo_mini_batch_size": preset.prompts_per_step, "use_kl_loss": True,
                  "kl_loss_coef": preset.beta, "kl_loss_type": "low_var_kl", "clip_ratio": 0.2,
                  "loss_agg_mode": "token-mean"},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_steps": steps, "test_freq": 0, "val_before_train": False, "save_freq": 0, "seed": seed,
                    "logger": ["jsonl"], "output_dir": str(workdir), "experiment_name": "ours",
                    "num_samples_to_log": 0, "num_threads": 1},
    }, quiet=True)
    clock = StepClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    stages = [{k: r[k] for k in ("gen", "ref", "update", "total") if k in r} for r in rows if r["scope"] == "timing"]
    scores = evaluate(trainer.model, trainer.tokenizer, preset) if evaluate_model else _no_scores()
    return {"step_seconds": _intervals(clock.marks), "stages": stages, "wall": wall, **scores}


def run_trl(preset: Preset, steps: int, seed: int, workdir: Path, evaluate_model: bool) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.data.dataset import read_rows
    from verl.models.loader import load_tokenizer, resolve_model_path
    from verl.rewards.registry import reward_for_data_source

    path = resolve_model_path(preset.model)
    tokenizer = load_tokenizer(preset.model)
    rows = read_rows([preset.train], "data.train_files")
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                                           "data_source": r["data_source"]} for r in rows])

    def strict_reward(prompts, completions, ground_truth, data_source, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_for_data_source(src)(src, text, gt)["score"]
                for text, gt, src in zip(texts, ground_truth, data_source, strict=True)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    clock = StepClock()
    config = GRPOConfig(output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, seed=seed,
                        per_device_train_batch_size=preset.prompts_per_step * preset.group,
                        num_generations=preset.group, gradient_accumulation_steps=1, gradient_checkpointing=False,
                        learning_rate=preset.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        max_grad_norm=1.0, beta=preset.beta, epsilon=0.2, loss_type="dapo",
                        max_completion_length=preset.max_new, temperature=preset.temperature, max_steps=steps,
                        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    peft_config = None
    if preset.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=preset.lora_rank, lora_alpha=preset.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = GRPOTrainer(model=model, reward_funcs=[strict_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)  # its per-step dict prints would drown the table
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    scores = evaluate(trainer.model, tokenizer, preset) if evaluate_model else _no_scores()
    return {"step_seconds": _intervals(clock.marks), "wall": wall, **scores}


def worker(kind: str, preset: Preset, steps: int, seed: int, out: Path, evaluate_model: bool, threads: int = 1) -> None:
    _setup(threads)
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_ours if kind == "ours" else run_trl)(preset, steps, seed, Path(tmp), evaluate_model)
    out.write_text(json.dumps(result))


def _load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["ours", "trl"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="worker: result file; driver: JSON with every run")
    parser.add_argument("--model", help="worker: train this model instead of the preset's")
    parser.add_argument("--threads", type=int, default=1, help="worker: torch threads (TRL given two cores when "
                                                               "our side uses two processes)")
    parser.add_argument("--no-eval", action="store_true", help="skip the final accuracy evaluation "
                                                                 "(the default for the smollm2 preset)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.model:
        preset = replace(preset, model=args.model)
    evaluate_model = not args.no_eval and args.preset == "tiny"
    if args.worker:
        worker(args.worker, preset, args.steps, args.seed, args.out, evaluate_model, args.threads)
        return

    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ["ours", "trl"] if repeat % 2 == 0 else ["trl", "ours"]
            for kind in order:
                out = Path(tmp) / f"{kind}-{repeat}.json"
                command = [sys.executable, __file__, "--worker", kind, "--preset", args.preset, "--steps",
                           str(args.steps), "--seed", str(args.seed + repeat), "--out", str(out)]
                load_before = _load()
                subprocess.run(command + (["--no-eval"] if not evaluate_model else []), check=True)
                result = json.loads(out.read_text())
                result["load"] = [load_before, _load()]
                results[kind].append(result)
                print(f"repeat {repeat} {kind:4s}: {statistics.median(result['step_seconds']):.3f} s/step (median "
                      f"of {len(result['step_seconds'])}), wall {result['wall']:.1f} s, accuracy "
                      f"{result['accuracy']:.3f}, load {result['load'][0]} -> {result['load'][1]}", flush=True)

    def summary(kind: str) -> dict[str, float]:
        per_run = [statistics.median(r["step_seconds"]) for r in results[kind]]
        return {"per_run": per_run, "s_per_step": statistics.median(per_run),
                "accuracy": statistics.median(r["accuracy"] for r in results[kind])}

    ours, trl = summary("ours"), summary("trl")
    print("\n=== summary")
    print(f"preset {args.preset}: {asdict(preset)}")
    print("| trainer | s/step per run | s/step (median) | accuracy (median) |")
    print("|---|---|---|---|")
    for name, s in (("verl suite GRPO", ours), ("TRL GRPOTrainer", trl)):
        runs = " / ".join(f"{x:.3f}" for x in s["per_run"])
        print(f"| {name} | {runs} | {s['s_per_step']:.3f} | {s['accuracy']:.3f} |")
    ratio = trl["s_per_step"] / ours["s_per_step"]
    print(f"\nthroughput ratio (TRL s/step / ours s/step), one core each: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "settings": asdict(preset), "steps": args.steps,
                                        "results": results, "ratio": ratio},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
