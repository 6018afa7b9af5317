"""SmolLM2-135M-Instruct's scores on reasoning-gym tasks before any training: the table a training mix is chosen
from (issue 62: tasks where the model scores between 5% and 60%).

Each task is evaluated by `verl eval` on its own items, drawn from a *selection* seed range (1,000,000 on) that no
training or validation source of the study uses, so choosing tasks from this table tunes nothing on the items the
study reports. Scores are reasoning-gym's own: `score_answer(extract_answer(response))`; `format` is the share of
responses with an `<answer>` tag at all.

    .venv/bin/python benchmarks/reasoning_gym_base_scores.py [--items 32] [--prompt direct] [--tasks a,b,...]
        -> benchmarks/reasoning_gym_base_scores.json
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
MODEL = "builtin:smollm2-135m-instruct"
SELECTION_SEED = 1_000_000  # items no study source draws (training and validation seeds stay below 100,000)
CANDIDATES = ("chain_sum", "basic_arithmetic", "leg_counting", "coin_flip", "letter_counting", "spell_backward",
              "gcd", "lcm", "number_sorting", "simple_equations", "word_sorting", "base_conversion")


def score_task(task: str, items: int, prompt: str, max_new_tokens: int, model: str = MODEL) -> dict:
    with tempfile.TemporaryDirectory() as out:
        source = f"reasoning_gym:{task}?size={items}&seed={SELECTION_SEED}&system_prompt={prompt}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "verl.cli", "eval", "--ckpt", model, "--data", source,
                        "--max-prompt-length", "384", "--max-new-tokens", str(max_new_tokens), "--out", out,
                        "--threads", "1"], cwd=REPO, check=True, capture_output=True, text=True)
        results = json.loads((Path(out) / "results.json").read_text())
        samples = [json.loads(line) for line in (Path(out) / "samples.jsonl").read_text().splitlines()]
    accuracy = results["metrics"]["eval/accuracy"]
    # How many distinct questions the generator makes in 2,000 items: a task needs 200 validation questions none of
    # its training items asks (a small generator repeats: its validation items are dropped as training questions).
    import reasoning_gym  # noqa: PLC0415

    generated = reasoning_gym.create_dataset(task, size=2000, seed=SELECTION_SEED)
    distinct = len({generated[i]["question"] for i in range(2000)})
    tagged = sum("<answer>" in s["response"] and "</answer>" in s["response"] for s in samples) / len(samples)
    return {"task": task, "items": len(samples), "accuracy": accuracy["value"], "ci": [accuracy["ci_low"],
            accuracy["ci_high"]], "format": tagged, "distinct_of_2000": distinct,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=MODEL, help="the model: the base, or a cold-start checkpoint")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--prompt", default="direct", help="reasoning-gym SYSTEM_PROMPTS key (default, direct, ...)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tasks", default=",".join(CANDIDATES))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "reasoning_gym_base_scores.json")
    args = parser.parse_args()
    rows = []
    for task in args.tasks.split(","):
        rows.append(score_task(task, args.items, args.prompt, args.max_new_tokens, args.ckpt))
        print(json.dumps(rows[-1]), flush=True)
    report = {"model": args.ckpt, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
              "selection_seed": SELECTION_SEED, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| task | items | accuracy (95% CI) | answer tag | distinct questions of 2,000 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['items']} | {r['accuracy']:.1%} ({r['ci'][0]:.1%}-{r['ci'][1]:.1%}) | "
              f"{r['format']:.0%} | {r['distinct_of_2000']} |")


if __name__ == "__main__":
    main()
