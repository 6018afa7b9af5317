"""HumanEval on SmolLM2-135M-Instruct: pass@1 greedy and pass@10 from n = 10 samples, every program run in the
sandbox (``verl eval -e code`` on ``builtin:humaneval``).

    python benchmarks/humaneval_smollm2.py [--problems 164] [--n 10] [--temperature 0.8]

Two ``verl eval`` runs of the real CLI: greedy (n = 1) for pass@1, and n samples at ``--temperature`` (top-p 0.95,
the Codex paper's pass@10 setting) for pass@k up to n. Each metric is printed with its 95% CI (clustered by
problem). Nothing here was tuned on the results: the prompt is ``builtin:humaneval``'s one instruction, the
temperature the paper's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERL = str(Path(sys.executable).parent / "verl")


def evaluate(out: Path, problems: int, n: int, temperature: float, max_new_tokens: int) -> tuple[dict, float]:
    command = [VERL, "eval", "--ckpt", "builtin:smollm2-135m-instruct", "--data", "builtin:humaneval", "-e", "code",
               "--max-samples", str(problems), "--n", str(n), "--temperature", str(temperature), "--top-p",
               "0.95" if temperature else "1.0", "--max-new-tokens", str(max_new_tokens), "--max-prompt-length",
               "1024", "--batch-size", "16", "--seed", "0", "--out", str(out)]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads((out / "results.json").read_text())["metrics"], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--out", type=Path, default=REPO / ".cache" / "bench" / "humaneval_smollm2")
    args = parser.parse_args()
    rows = []
    greedy, greedy_s = evaluate(args.out / "greedy", args.problems, 1, 0.0, args.max_new_tokens)
    rows.append(("greedy, n=1", "pass@1", greedy["eval/pass@1"], greedy_s))
    rows.append(("greedy, n=1", "tests_passed", greedy["eval/tests_passed"], greedy_s))
    if args.n > 1:
        sampled, sampled_s = evaluate(args.out / f"n{args.n}", args.problems, args.n, args.temperature,
                                      args.max_new_tokens)
        for k in sorted({1, min(10, args.n), args.n}):
            rows.append((f"T={args.temperature:g}, top-p 0.95, n={args.n}", f"pass@{k}", sampled[f"eval/pass@{k}"],
                         sampled_s))
    print("=== summary")
    print(f"SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct) on HumanEval, {args.problems} problems, "
          f"{args.max_new_tokens} new tokens at most; programs run in the sandbox (bubblewrap)\n")
    print("| sampling | metric | value | 95% CI | eval wall time |")
    print("|---|---|---|---|---|")
    for sampling, name, metric, seconds in rows:
        print(f"| {sampling} | {name} | {metric['value']:.3f} | [{metric['ci_low']:.3f}, {metric['ci_high']:.3f}] "
              f"| {seconds / 60:.1f} min |")


if __name__ == "__main__":
    main()
