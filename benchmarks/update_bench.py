"""The GRPO update on packed sequences against the padded update, held against the machine's GEMM (issue 29 item 2).

Both sides run ``verl train --config configs/grpo_smollm2.yaml`` (LoRA r16, 4 prompts x 4 samples x 32 tokens,
synchronous, one torch thread) in fresh subprocesses, one after the other (order alternating per repeat):

- ``padded``: ``model.use_remove_padding=false``: the update's forward and backward run the rows as the rollout
  padded them (prompts on the left to the longest prompt, responses on the right to the longest response);
- ``packed``: the default, ``model.use_remove_padding=true``: the real tokens only, each prompt once per group
  (``verl/models/packed_sequences.py``).

Same measured span: ``timing/update_actor`` (forward, backward and optimizer step of the whole batch) of steps
2.. (step 1 warms up), median per run, median of the runs. Both sides see the same batches (same seed; the
packed log-probs equal the padded ones bit for bit, so the runs stay on the same trajectory up to the gradients'
rounding).

How close to the machine: the update's FLOPs count real tokens only, F = 2 x (non-embedding parameters) x (prompt
tokens, once per prompt + response tokens) + 2 x (LM head parameters) x (response tokens); forward + input
gradients = 2F (LoRA's rank-16 products neglected). Held against two one-thread fp32 GEMMs timed just before each
run: the update's own shape (its packed tokens x 576 x 1536, SmolLM2's hidden x intermediate) and the machine's
peak shape 2048^3; each GEMM is the faster of MKL and oneDNN (``probes.library_gemm_gflops``; the frozen layers
multiply by oneDNN-packed weights, so MKL alone would understate the machine on CPUs where it is slower).

    python benchmarks/update_bench.py --steps 7 --repeats 3
    python benchmarks/update_bench.py --preset agent-tiny --steps 10 --repeats 3

``--preset agent-tiny``: ``configs/agent_tiny.yaml`` instead (the tiny agent, 16 prompts x 8 multi-turn
trajectories of up to 128 tokens with tool turns, whose lengths spread widely): the same two sides, the update's
and the reference's times (no GEMM columns: the FLOP count above is SmolLM2's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from overlap_bench import forward_gflop, run_side
from probes import library_gemm_gflops

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"smollm2": REPO / "configs" / "grpo_smollm2.yaml", "agent-tiny": REPO / "configs" / "agent_tiny.yaml"}
SIDES = {"padded": ["model.use_remove_padding=false"], "packed": ["model.use_remove_padding=true"]}
PROMPTS, N = 4, 4


def packed_tokens(row: dict) -> float:
    """Tokens the packed update computes: each prompt once, each response (its inputs)."""
    return row["rollout/prompt_length_mean"] * PROMPTS + row["rollout/response_length_mean"] * PROMPTS * N


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", choices=list(PRESETS), default="smollm2")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/update_bench[_PRESET].json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.preset != "smollm2":
        agent_tiny(args)
        return
    per_side: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for side in (list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))):
                # The box's speed drifts over minutes: each run against GEMMs timed just before it. The shape's rows
                # are the packed update's tokens of the previous run (720 before the first: 4 x 60 + 16 x 30).
                tokens = round(statistics.median(r["tokens"] for runs in per_side.values() for r in runs)) \
                    if any(per_side.values()) else 720
                shape = library_gemm_gflops(tokens, 576, 1536)
                peak = library_gemm_gflops(2048, 2048, 2048, repeats=5)
                steps = run_side(side, args.steps, Path(tmp), repeat, PRESETS["smollm2"], SIDES[side])
                update_s = statistics.median(r["timing/update_actor"] for r in steps)
                flop = 2 * statistics.median(forward_gflop(r, PROMPTS, N) for r in steps)
                per_side[side].append({"update_s": update_s, "update_gflop": flop, "gflops": flop / update_s,
                                       "tokens": statistics.median(packed_tokens(r) for r in steps),
                                       "gemm_rows": tokens, "shape_gemm": shape, "peak_gemm": peak,
                                       "pct_of_shape_gemm": 100 * flop / update_s / shape["best"],
                                       "pct_of_peak_gemm": 100 * flop / update_s / peak["best"]})
                print(side, repeat, json.dumps(per_side[side][-1]), flush=True)
    summary: dict = {"steps": args.steps, "repeats": args.repeats, "sides": {}}
    for side, runs in per_side.items():
        summary["sides"][side] = {"update_s": statistics.median(r["update_s"] for r in runs),
                                  "gflops": statistics.median(r["gflops"] for r in runs),
                                  "pct_of_shape_gemm": statistics.median(r["pct_of_shape_gemm"] for r in runs),
                                  "pct_of_peak_gemm": statistics.median(r["pct_of_peak_gemm"] for r in runs),
                                  "runs": runs}
    padded, packed = summary["sides"]["padded"], summary["sides"]["packed"]
    summary["ratio"] = packed["update_s"] / padded["update_s"]
    Path(args.out or "benchmarks/update_bench.json").write_text(json.dumps(summary, indent=1))
    print("=== summary")
    print("GRPO update on SmolLM2 (configs/grpo_smollm2.yaml, LoRA r16, 4x4x32, synchronous), one torch thread, "
          f"timing/update_actor median of steps 2-{args.steps} per run, median of {args.repeats} runs per side:")
    print("| side | update s | GFLOP/s (real tokens) | % of same-shape GEMM | % of peak GEMM (2048^3) | runs (s) |")
    print("|---|---|---|---|---|---|")
    for side, med in summary["sides"].items():
        runs = ", ".join(f"{r['update_s']:.2f}" for r in med["runs"])
        print(f"| {side} | {med['update_s']:.2f} | {med['gflops']:.1f} | {med['pct_of_shape_gemm']:.0f}% | "
              f"{med['pct_of_peak_gemm']:.0f}% | {runs} |")
    shapes = [r["shape_gemm"] for runs in per_side.values() for r in runs]
    peaks = [r["peak_gemm"] for runs in per_side.values() for r in runs]
    rows = sorted({r["gemm_rows"] for runs in per_side.values() for r in runs})
    print(f"**packed / padded update time = {summary['ratio']:.2f}x**; packed update at "
          f"{packed['pct_of_shape_gemm']:.0f}% of the same-shape GEMM (goal >= 75%). GEMMs timed before each run "
          f"(one thread, fp32, best of MKL / oneDNN): {'/'.join(map(str, rows))}x576x1536 "
          f"{min(s['best'] for s in shapes):.0f}-{max(s['best'] for s in shapes):.0f} GFLOP/s (MKL alone "
          f"{min(s['mkl'] for s in shapes):.0f}-{max(s['mkl'] for s in shapes):.0f}); 2048^3 "
          f"{min(p['best'] for p in peaks):.0f}-{max(p['best'] for p in peaks):.0f} GFLOP/s (MKL alone "
          f"{min(p['mkl'] for p in peaks):.0f}-{max(p['mkl'] for p in peaks):.0f}).")


def agent_tiny(args: argparse.Namespace) -> None:
    """The tiny agent's multi-turn GRPO: update and reference seconds, padded vs packed, alternating runs."""
    per_side: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for side in (list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))):
                steps = run_side(side, args.steps, Path(tmp), repeat, PRESETS[args.preset], SIDES[side])
                per_side[side].append({key: statistics.median(r[f"timing/{key}"] for r in steps)
                                       for key in ("update_actor", "ref", "total")}
                                      | {"response_length": statistics.median(r["rollout/response_length_mean"]
                                                                              for r in steps)})
                print(side, repeat, json.dumps(per_side[side][-1]), flush=True)
    summary = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"runs": runs}
               for side, runs in per_side.items()}
    Path(args.out or f"benchmarks/update_bench_{args.preset}.json").write_text(json.dumps(summary, indent=1))
    print("=== summary")
    print(f"{PRESETS[args.preset].name} (the tiny agent, 16 prompts x 8 multi-turn trajectories, <= 128 tokens), one "
          f"torch thread, median of steps 2-{args.steps} per run, median of {args.repeats} runs per side:")
    print("| side | update s | reference s | step s | response tokens (mean) | update runs (s) |")
    print("|---|---|---|---|---|---|")
    for side, med in summary.items():
        runs = ", ".join(f"{r['update_actor']:.2f}" for r in med["runs"])
        print(f"| {side} | {med['update_actor']:.2f} | {med['ref']:.2f} | {med['total']:.2f} | "
              f"{med['response_length']:.1f} | {runs} |")
    padded, packed = summary["padded"], summary["packed"]
    print(f"**packed / padded: update {packed['update_actor'] / padded['update_actor']:.2f}x, reference "
          f"{packed['ref'] / padded['ref']:.2f}x, step {packed['total'] / padded['total']:.2f}x**")


if __name__ == "__main__":
    main()
