"""SmolLM2-135M-Instruct learns to write one small function, rewarded by running it in the sandbox server.

    python benchmarks/code_learning_smollm2.py [--steps 30] [--seed 1] [--out DIR]

verl's way end to end: ``verl sandbox serve`` on a free port, ``verl train --config configs/code_smollm2.yaml
reward_model.sandbox_fusion.url=<it>/run_code`` (GRPO, LoRA, the ``code`` reward: the fraction of calls a
program answers right), then ``verl eval -e code`` on the base model and on the trained checkpoint over the val
split (64 functions whose (family, constant) pairs no training row has), greedy, and ``verl compare`` of the two:
paired differences with CIs and McNemar on ``solved``. ``--base-only`` measures the base model's pass rate alone
(on ``--split``: the train split chose the task's difficulty, not val).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VERL = str(Path(sys.executable).with_name("verl"))
MODEL = "builtin:smollm2-135m-instruct"


def evaluate(ckpt: str, split: str, out: Path, samples: int, sandbox: str = "local") -> dict:
    command = [VERL, "eval", "--ckpt", ckpt, "--data", f"builtin:code_functions/{split}", "-e", "code",
               "--max-samples", str(samples), "--temperature", "0", "--max-new-tokens", "64",
               "--max-prompt-length", "128", "--batch-size", "64", "--seed", "0", "--sandbox-url", sandbox,
               "--out", str(out), "--quiet"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads((out / "results.json").read_text())["metrics"]


def line(label: str, metrics: dict) -> str:
    parts = []
    for name in ("eval/solved", "eval/tests_passed"):
        m = metrics[name]
        parts.append(f"{name.split('/')[-1]} {m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]")
    return f"{label}: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64, help="val prompts evaluated (the split has 64)")
    parser.add_argument("--base-only", action="store_true")
    parser.add_argument("--split", default="train", help="with --base-only: the split to measure")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="code-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.base_only:
        print(line(f"base on {args.split}", evaluate(MODEL, args.split, work / f"base_{args.split}", args.samples)))
        return
    from tests.ports import serve  # the same helper the tests start servers with

    sandbox, url = serve("-m", "verl.cli", "sandbox", "serve", "--host", "127.0.0.1")
    try:
        start = time.perf_counter()
        command = [VERL, "train", "--config", "configs/code_smollm2.yaml", f"trainer.total_steps={args.steps}",
                   f"trainer.test_freq={args.steps}", f"trainer.save_freq={args.steps}", f"trainer.seed={args.seed}",
                   f"trainer.output_dir={work}", f"trainer.experiment_name=code_seed{args.seed}",
                   f"reward_model.sandbox_fusion.url={url}/run_code", "trainer.logger=[console,jsonl]"]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=REPO)
        minutes = (time.perf_counter() - start) / 60
        run = work / "verl" / f"code_seed{args.seed}"
        # Both models scored through the same served sandbox the run trained against.
        base = evaluate(MODEL, "val", work / "eval_base", args.samples, f"{url}/run_code")
        trained = evaluate(str(run / "checkpoints" / f"global_step_{args.steps}"), "val", work / "eval_trained",
                           args.samples, f"{url}/run_code")
    finally:
        sandbox.terminate()
        sandbox.wait(30)
    rows = [json.loads(x) for x in (run / "verl_logs.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if r.get("scope") == "rollout"]
    evals = {r["step"]: r["accuracy"] for r in rows if r.get("scope") == "eval"}
    compare = [VERL, "compare", str(work / "eval_base"), str(work / "eval_trained"), "--out", str(work / "compare")]
    subprocess.run(compare, check=True, cwd=REPO, capture_output=True)
    report = json.loads((work / "compare" / "compare.json").read_text())["comparisons"][0]["metrics"]
    print(f"\n=== summary: {args.steps} steps x 4 prompts x 4 samples, seed {args.seed}, {minutes:.1f} min")
    print(f"training reward (mean fraction of calls right): first 5 steps {sum(rewards[:5]) / 5:.3f}, "
          f"last 5 {sum(rewards[-5:]) / 5:.3f}")
    print(f"training validation (solved, val): step 0 {evals[0]:.3f}, step {args.steps} {evals[args.steps]:.3f}")
    print(line("base, val", base))
    print(line("trained, val", trained))
    for name in ("eval/solved", "eval/tests_passed"):
        r = report[name]
        print(f"{name}: diff {r['diff']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], p={r['p_value']:.3g} "
              f"({r['test']}): {r['verdict']}")


if __name__ == "__main__":
    main()
