"""Rollout tokens/s: the vLLM engine (``VLLMRollout``) vs the transformers engine (``HFRollout``), one run.

Same prompts (``builtin:arithmetic/val``), same sampling (temperature 1, ``n`` samples per prompt, the same seed
for both engines in a repeat), same dtype, at several batch shapes (the default GRPO step's rollout, a large
batch, long generations), on two model sizes:

- ``builtin:tiny-arith``        ~1M parameters, the shipped warm start (answers end at eos after a few tokens)
- ``builtin:small-arith-base``  ~25M parameters, randomly initialised (never emits eos: every row runs to max)

The transformers engine runs in this process on one torch thread; the vLLM worker runs in its own process on
one OpenMP thread (``VERL_VLLM_CPU_THREADS``, default 1), so each engine computes on one core. Each repeat times
both engines back to back (alternating which goes first) so load from other processes hits both alike; tokens/s
= generated tokens (``response_mask`` sum) / wall time of one ``generate`` call; medians over repeats.
Engine start-up (vLLM: 15-60 s) is reported separately, not counted.

How close to the machine's limit (timed in the same run, one thread): each engine's decode GFLOP/s (generated
tokens/s x 2 x the linear weights; prefill not counted) as a % of a ``rows x hidden x intermediate`` fp32 GEMM
(rows = prompts x samples, the decode batch), and tokens/s as a % of the read floor (every decode step reading the
linear weights once at the measured one-thread read bandwidth).

Run from the vLLM environment (scripts/vllm_env.sh builds it):

    .venv-vllm/bin/python benchmarks/rollout_bench.py                      # both sizes, three shapes
    .venv-vllm/bin/python benchmarks/rollout_bench.py --models builtin:tiny-arith --shapes 16x8x16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from grpo_vs_trl import _setup
from probes import decode_efficiency, decode_limits

REPO = Path(__file__).resolve().parents[1]
MODELS = ["builtin:tiny-arith", "builtin:small-arith-base"]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"16x8x16"`` -> (prompts, samples per prompt, max new tokens)."""
    prompts, n, max_new = (int(x) for x in text.lower().split("x"))
    return prompts, n, max_new


def bench_model(path: str, args: argparse.Namespace) -> list[dict]:
    """Time both engines on ``path`` for every shape (one vLLM engine start); one result dict per shape."""
    from verl.data.dataset import RLHFDataset
    from verl.models.loader import load_causal_lm, load_tokenizer
    from verl.rollout.base import SamplingParams
    from verl.rollout.hf import HFRollout
    from verl.rollout.vllm_rollout import VLLMRollout

    shapes = [parse_shape(s) for s in args.shapes]
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, args.dtype)
    # Frozen, as a LoRA run's base weights are (configs/grpo_smollm2.yaml): the transformers engine then decodes
    # through oneDNN-packed weights (verl/models/packed_linear.py). A full fine-tuning rollout decodes unpacked.
    model.eval().requires_grad_(False)
    dataset = RLHFDataset(["builtin:arithmetic/val"], tokenizer)
    start = time.perf_counter()
    vllm_engine = VLLMRollout(path, tokenizer, max_model_len=64 + max(s[2] for s in shapes), seed=0,
                              actor_model=model, engine_kwargs=json.loads(args.engine_kwargs))
    start_s = time.perf_counter() - start
    engines = {"hf": HFRollout(model, tokenizer), "vllm": vllm_engine}
    results = []
    try:
        sync_times = []
        for _ in range(3):  # the in-memory weight push the trainer does after every update
            t0 = time.perf_counter()
            vllm_engine.sync_weights(model)
            sync_times.append(time.perf_counter() - t0)
        for n_prompts, n, max_new in shapes:
            prompts = dataset.collate(list(range(n_prompts)))
            times: dict[str, list[float]] = {"hf": [], "vllm": []}
            tokens: dict[str, list[int]] = {"hf": [], "vllm": []}
            for repeat in range(args.warmup + args.repeats):
                params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=repeat)
                for name in (["hf", "vllm"] if repeat % 2 == 0 else ["vllm", "hf"]):
                    t0 = time.perf_counter()
                    out = engines[name].generate(prompts, params)
                    seconds = time.perf_counter() - t0
                    if repeat >= args.warmup:
                        times[name].append(seconds)
                        tokens[name].append(int(out.batch["response_mask"].sum()))
                    # Let vLLM's worker leave its post-request busy-wait (~1 s) before the next timed call.
                    time.sleep(1.5)
            params_m = sum(p.numel() for p in model.parameters()) / 1e6
            result: dict = {"model": path, "params_m": params_m, "dtype": args.dtype,
                            "shape": f"{n_prompts}x{n}x{max_new}", "vllm_start_s": start_s,
                            "sync_s_median": statistics.median(sync_times),
                            "limits": decode_limits(model, n_prompts * n)}
            for name in ("hf", "vllm"):
                rates = [t / s for t, s in zip(tokens[name], times[name], strict=True)]
                result[name] = {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates),
                                "tok_s_max": max(rates), "seconds_median": statistics.median(times[name]),
                                "tokens_median": statistics.median(tokens[name])}
            result["ratio"] = result["vllm"]["tok_s_median"] / result["hf"]["tok_s_median"]
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        vllm_engine.shutdown()
    return results


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"temperature 1.0, {args.dtype}, medians of {args.repeats} (after {args.warmup} warm-up); "
        "shape = prompts x samples x max new tokens",
        "",
        "| model | params | shape | transformers tok/s (min–max) | vLLM tok/s (min–max) | vLLM / transformers | "
        "tokens per call (hf / vllm) | vLLM start | weight sync | transformers decode GFLOP/s | vLLM decode GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hf, vl = r["hf"], r["vllm"]
        lines.append(
            f"| {r['model']} | {r['params_m']:.1f}M | {r['shape']} | {hf['tok_s_median']:,.0f} "
            f"({hf['tok_s_min']:,.0f}–{hf['tok_s_max']:,.0f}) | {vl['tok_s_median']:,.0f} ({vl['tok_s_min']:,.0f}–"
            f"{vl['tok_s_max']:,.0f}) | {r['ratio']:.2f}× | {hf['tokens_median']:.0f} / {vl['tokens_median']:.0f} | "
            f"{r['vllm_start_s']:.0f} s | {r['sync_s_median']:.2f} s | "
            f"{decode_efficiency(hf['tok_s_median'], r['limits'])} | "
            f"{decode_efficiency(vl['tok_s_median'], r['limits'])} |"
        )
    if results:
        limits = results[-1]["limits"]
        lines += ["", f"Probes in this run (one thread): {limits['gemm_shape']} fp32 GEMM "
                  f"{limits['gemm_gflops']:.1f} GFLOP/s; read bandwidth {limits['read_gbs']:.1f} GB/s, a read floor of "
                  f"{limits['read_floor_tok_s']:,.0f} tok/s for the last row's model and shape (each row's own limits "
                  "are in the JSON)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--shapes", nargs="+", default=["16x8x16", "64x8x32", "16x8x128"],
                        help="prompts x samples x max new tokens; 16x8x16 is the default GRPO step's rollout")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--engine-kwargs", default="{}", help='JSON for vllm.LLM, e.g. \'{"block_size": 16}\'')
    args = parser.parse_args()
    _setup(1)
    results = []
    for path in args.models:
        results.extend(bench_model(path, args))
    print("=== summary")
    print(table(results, args))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":  # vLLM spawns its engine processes: keep the top level guarded
    main()
