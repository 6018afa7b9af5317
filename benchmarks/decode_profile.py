"""Where a batch-16 decode step of the serving engine goes, per operator (issue 17, item 2: profile first).

Runs the transformers engine's decode path — the model's forward over one new token per row with the engine's own
KV cache (``GrowingLayer``: append in place, right-aligned rows), packed weights and fused decoder layers — at
``--rows`` rows and ``--context`` cached tokens, one torch thread, and reports:

- the step time (median of ``--repeats``) and tokens/s;
- torch.profiler's CPU time per operator over ``--profile-steps`` steps, as a share of the step;
- two machine limits timed in the same run: a plain fp32 GEMM of the decode's widest shape (rows x hidden x
  intermediate) and a weight-read probe (summing a buffer the size of the model's weights), with the step's
  achieved GFLOP/s (2 x parameters x rows / step) and its implied weight-read bandwidth against them.

    python benchmarks/decode_profile.py --model builtin:smollm2-135m-instruct --rows 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
from probes import gemm_gflops, median_time, read_gbs
from torch.profiler import ProfilerActivity, profile

from verl.models.attention import use_cpu_attention
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.kv_cache import new_growing_cache
from verl.models.loader import load_causal_lm, resolve_model_path
from verl.models.packed_linear import packed_weights
from verl.utils.allocator import keep_freed_memory
from verl.utils.profiling import matmul_flops


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--attn", default="engine", help="attention: engine (what the serving engine uses: "
                        "verl_cpu_sdpa: grouped K/V without copies and the decode kernel), sdpa, eager")
    parser.add_argument("--packed", choices=["on", "off"], default="on", help="on: frozen linear layers multiply by "
                        "oneDNN-packed weights, as both engines decode (verl/models/packed_linear.py); off: F.linear")
    parser.add_argument("--fused", choices=["on", "off"], default="on", help="on: decoder layers run their norms, "
                        "RoPE and SiLU as fused calls, as both engines decode (verl/models/fused_decoder.py); off: "
                        "Hugging Face's layer forward")
    parser.add_argument("--compare-fused", type=int, default=0, metavar="ROUNDS",
                        help="Instead of the profile: ROUNDS rounds alternating fused decoder layers off and on in "
                        "this process (--repeats steps each), and the median step of each side.")
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the serving engine's and the trainer's processes do: no page faults per temporary
    model = load_causal_lm(resolve_model_path(args.model), dtype="float32", device=torch.device("cpu")).eval()
    model.requires_grad_(False)  # as the serving engine holds it
    if args.attn == "engine":
        use_cpu_attention(model)
    else:
        model.set_attn_implementation(args.attn)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.compare_fused:
        compare_fused(model, args)
        return
    step = decode_step_at_fixed_length(model, args.rows, args.context, packed=args.packed == "on",
                                       fused=args.fused == "on")
    seconds = median_time(step, args.repeats)
    table, gemms = profile_step_operators(step, args.profile_steps, args.top)
    config = model.config
    gemm = gemm_gflops(args.rows, config.hidden_size, config.intermediate_size, args.repeats * 20)
    read = read_gbs(weight_bytes, max(5, args.repeats // 2))
    achieved = 2 * params * args.rows / seconds / 1e9
    summary = {"model": args.model, "params": params, "rows": args.rows, "context": args.context,
               "step_ms": seconds * 1000, "tokens_per_s": args.rows / seconds, "achieved_gflops": achieved,
               "gemm_gflops": gemm, "pct_of_gemm": 100 * achieved / gemm, "read_gbs": read,
               "weight_read_floor_ms": weight_bytes / (read * 1e9) * 1000, "ops": table, "gemms": gemms}
    print_summary(args, config, summary, weight_bytes)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


def compare_fused(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """The decode step with fused decoder layers off and on, alternating in one process (so load on a shared box
    falls on both sides alike): each round times ``--repeats`` steps of each side; medians of the round medians."""
    steps = {fused: decode_step_at_fixed_length(model, args.rows, args.context, packed=args.packed == "on",
                                                fused=fused) for fused in (False, True)}
    rounds: dict[bool, list[float]] = {False: [], True: []}
    for number in range(args.compare_fused):
        for fused in ((False, True) if number % 2 == 0 else (True, False)):
            rounds[fused].append(median_time(steps[fused], args.repeats) * 1000)
    off, on = statistics.median(rounds[False]), statistics.median(rounds[True])
    print(f"{args.model}, batch {args.rows}, context {args.context}, one thread, {args.compare_fused} rounds of "
          f"{args.repeats} steps per side, alternating")
    print(f"fused decoder layers off: {off:.1f} ms per step (rounds {', '.join(f'{t:.1f}' for t in rounds[False])})")
    print(f"fused decoder layers on:  {on:.1f} ms per step (rounds {', '.join(f'{t:.1f}' for t in rounds[True])})")
    print(f"on / off: {on / off:.2f}x")


def decode_step_at_fixed_length(model: torch.nn.Module, rows: int, context: int, packed: bool, fused: bool = True):
    """A function running one decode step of ``rows`` rows after ``context`` cached tokens in the engine's KV cache,
    dropping the appended column afterwards so every call decodes at the same length."""
    config = model.config
    vocab = min(1000, config.vocab_size)
    ids = torch.randint(3, vocab, (rows, context))
    # Rows of different lengths, as in the engine's batch (right-aligned, padding on the left): row i is i tokens
    # shorter, so the attention mask is a real one (an all-ones mask lets transformers drop it).
    mask = torch.ones(rows, context + 1, dtype=torch.long)
    for row in range(rows):
        mask[row, :min(row, context - 1)] = 0
    token = torch.randint(3, vocab, (rows, 1))
    with torch.inference_mode():
        cache = new_growing_cache(config)
        prefill_positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask[:, :-1], position_ids=prefill_positions, past_key_values=cache,
              use_cache=True)
    positions = mask[:, :-1].sum(-1, keepdim=True)
    packing = packed_weights if packed else contextlib.nullcontext
    fusing = fused_decoder_layers if fused else contextlib.nullcontext

    def step() -> None:
        with torch.inference_mode(), packing(), fusing():
            model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
            for layer in cache.layers:  # drop the appended column: every step decodes at the same length
                layer._len -= 1
                layer.keys, layer.values = layer._kbuf[:, :, :layer._len], layer._vbuf[:, :, :layer._len]

    return step


def profile_step_operators(step, profile_steps: int, top: int) -> tuple[list[dict], list[dict]]:
    """torch.profiler over ``profile_steps`` calls of ``step``: the ``top`` operators by CPU time (share of the
    step), and the matrix products by shape (which GEMMs take the time, and at what rate)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(profile_steps):
            step()
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    table = [{"op": e.key, "calls_per_step": e.count / profile_steps,
              "ms_per_step": e.self_cpu_time_total / 1000 / profile_steps,
              "share": e.self_cpu_time_total / total_us} for e in ops[:top]]
    gemms = []
    for e in prof.key_averages(group_by_input_shape=True):
        flops = matmul_flops(e.key, e.input_shapes or [])
        if flops:
            k = e.input_shapes[0][-1]
            m = flops // (2 * k * (e.input_shapes[1][0] if e.key.startswith("mkldnn") else e.input_shapes[1][-1]))
            n = flops // (2 * m * k)
            ms = e.self_cpu_time_total / 1000 / profile_steps
            gemms.append({"shape": f"{m}x{k}x{n}", "calls_per_step": e.count / profile_steps,
                          "ms_per_step": ms, "gflops": flops * e.count / profile_steps / ms / 1e6})
    gemms.sort(key=lambda g: g["ms_per_step"], reverse=True)
    return table, gemms


def print_summary(args: argparse.Namespace, config, summary: dict, weight_bytes: int) -> None:
    seconds, gemm, read = summary["step_ms"] / 1000, summary["gemm_gflops"], summary["read_gbs"]
    print("=== summary")
    print(f"{args.model} ({summary['params'] / 1e6:.1f}M params, {weight_bytes / 1e6:.0f} MB fp32), batch "
          f"{args.rows}, context {args.context}, one thread, attention {config._attn_implementation}, packed linear "
          f"{args.packed}, fused decoder layers {args.fused}")
    print(f"decode step {seconds * 1000:.1f} ms = {args.rows / seconds:.0f} tok/s; {summary['achieved_gflops']:.1f} "
          f"GFLOP/s = {summary['pct_of_gemm']:.0f}% of a {args.rows}x{config.hidden_size}x{config.intermediate_size} "
          f"GEMM ({gemm:.1f} GFLOP/s); reading the weights once takes {summary['weight_read_floor_ms']:.1f} ms "
          f"at {read:.1f} GB/s")
    print("| op | calls/step | ms/step | share of profiled time |")
    print("|---|---|---|---|")
    for row in summary["ops"]:
        print(f"| {row['op']} | {row['calls_per_step']:.0f} | {row['ms_per_step']:.2f} | {row['share']:.1%} |")
    print("| matrix product (rows x in x out) | calls/step | ms/step | GFLOP/s |")
    print("|---|---|---|---|")
    for g in summary["gemms"]:
        print(f"| {g['shape']} | {g['calls_per_step']:.0f} | {g['ms_per_step']:.2f} | {g['gflops']:.1f} |")


if __name__ == "__main__":
    main()
