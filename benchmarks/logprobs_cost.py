"""What asking the rollout for its log-probs costs (``rollout.calculate_log_probs``, on by default since the
mismatch metrics): the transformers engine (``HFRollout``) generating the same prompts with the same seed, log-probs
off vs on, alternating which goes first in each repeat; medians over repeats, one torch thread.

The engine samples from the softmax of each step's logits; with log-probs on it also takes the log-softmax at the
sampling temperature and gathers the drawn token's entry, one more pass over the vocabulary per decoded token. Where
the model computes, its decode GFLOP/s is reported as a % of a ``rows x hidden x intermediate`` GEMM timed in the
same run (benchmarks/probes.py).

    .venv/bin/python benchmarks/logprobs_cost.py                       # tiny default step and SmolLM2
    .venv/bin/python benchmarks/logprobs_cost.py --models builtin:tiny-arith --shapes 16x8x16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from probes import decode_efficiency, decode_limits

REPO = Path(__file__).resolve().parents[1]
MODELS = ["builtin:tiny-arith", "builtin:smollm2-135m-instruct"]


def bench(path: str, shape: str, repeats: int) -> dict:
    from verl.data.dataset import RLHFDataset
    from verl.models.loader import load_causal_lm, load_tokenizer
    from verl.rollout.base import SamplingParams
    from verl.rollout.hf import HFRollout

    n_prompts, n, max_new = (int(x) for x in shape.split("x"))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32")
    model.eval().requires_grad_(False)
    engine = HFRollout(model, tokenizer)
    prompts = RLHFDataset(["builtin:arithmetic/val"], tokenizer).collate(list(range(n_prompts)))
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[int]] = {False: [], True: []}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for logprobs in ([False, True] if repeat % 2 == 0 else [True, False]):
            params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=repeat, logprobs=logprobs)
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            if repeat:
                times[logprobs].append(seconds)
                tokens[logprobs].append(int(out.batch["response_mask"].sum()))
    limits = decode_limits(model, n_prompts * n)
    result: dict = {"model": path, "shape": shape, "repeats": repeats}
    for logprobs, label in ((False, "off"), (True, "on")):
        rates = [t / s for t, s in zip(tokens[logprobs], times[logprobs], strict=True)]
        tok_s = statistics.median(rates)
        result[label] = {"seconds_median": statistics.median(times[logprobs]), "tok_s_median": tok_s,
                         "tokens_median": statistics.median(tokens[logprobs]),
                         "efficiency": decode_efficiency(tok_s, limits)}
    result["time_ratio_on_over_off"] = result["on"]["seconds_median"] / result["off"]["seconds_median"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--shapes", nargs="+", default=None, help="PROMPTSxNxMAX_NEW (default: one per model)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "logprobs_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    default_shapes = {"builtin:tiny-arith": ["16x8x16"], "builtin:smollm2-135m-instruct": ["4x4x32"]}
    results = []
    for model in args.models:
        for shape in args.shapes or default_shapes.get(model, ["16x8x16"]):
            result = bench(model, shape, args.repeats)
            print(json.dumps(result), flush=True)
            results.append(result)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n| model | shape | log-probs off | on | time on / off |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['shape']} | {r['off']['seconds_median'] * 1000:.0f} ms "
              f"({r['off']['efficiency']}) | {r['on']['seconds_median'] * 1000:.0f} ms | "
              f"{r['time_ratio_on_over_off']:.3f}x |")


if __name__ == "__main__":
    main()
