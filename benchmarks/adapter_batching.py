"""Several LoRA adapters in one decode step vs one batch per adapter (issue 14), on the transformers engine's path.

The service's transformers engine runs requests for different adapters (and the base) in one decode step, passing
PEFT ``adapter_names`` per row. The alternative is to batch per adapter: one forward per adapter, each over its own
rows. This times one decode step (batch ``--rows``, KV cache of ``--context`` tokens, one torch thread) of:

- ``base``: the plain model, no PEFT (the floor);
- ``one adapter``: PEFT, every row on the same adapter;
- ``mixed``: PEFT, ``--adapters`` adapters, rows split evenly, one forward with ``adapter_names``;
- ``per adapter``: the same rows as one forward per adapter (the sum of the forwards' times).

and reports tokens/s (rows / step time), the ratio mixed / per-adapter, and each as a % of a plain fp32 GEMM of the
decode shape timed in the same run (achieved GFLOP/s = 2 x parameters x rows / step time).

    python benchmarks/adapter_batching.py --model builtin:smollm2-135m-instruct --rows 16 --adapters 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from probes import gemm_gflops, median_time
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from verl.models.loader import resolve_model_path


def make_adapters(path: str, root: Path, count: int, rank: int) -> list[str]:
    names = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(path)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                init_lora_weights=False))
        peft.save_pretrained(root / f"a{i}")
        names.append(f"a{i}")
    return names


def decode_step(model, rows: int, context: int, **kwargs):
    """A callable running one decode step for ``rows`` rows over a prefilled cache of ``context`` tokens."""
    vocab = min(1000, model.config.vocab_size)
    ids = torch.randint(3, vocab, (rows, context))
    names = kwargs.get("adapter_names")
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
    token = torch.randint(3, vocab, (rows, 1))

    def step() -> None:
        with torch.inference_mode():
            model(input_ids=token, past_key_values=cache, use_cache=True, **kwargs)
            cache.crop(-1)  # back to the prefilled length: every repeat decodes at the same position

    step.adapter_names = names
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="adapters-"))
    names = make_adapters(path, tmp, args.adapters, args.rank)

    base = AutoModelForCausalLM.from_pretrained(path).eval()
    params = sum(p.numel() for p in base.parameters())
    config = base.config
    results = {"base": median_time(decode_step(base, args.rows, args.context), args.repeats)}
    peft = PeftModel.from_pretrained(base, str(tmp / names[0]), adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(str(tmp / name), adapter_name=name)
    peft.eval()
    one = decode_step(peft, args.rows, args.context, adapter_names=[names[0]] * args.rows)
    results["one adapter"] = median_time(one, args.repeats)
    mixed = [names[i % len(names)] for i in range(args.rows)]
    results["mixed"] = median_time(decode_step(peft, args.rows, args.context, adapter_names=mixed), args.repeats)
    per = args.rows // len(names)
    steps = [decode_step(peft, per, args.context, adapter_names=[name] * per) for name in names]
    results["per adapter"] = median_time(lambda: [s() for s in steps], args.repeats)

    peak = gemm_gflops(args.rows, config.hidden_size, config.intermediate_size, args.repeats * 20)
    rows = []
    for label, seconds in results.items():
        gflops = 2 * params * args.rows / seconds / 1e9
        rows.append({"path": label, "step_ms": seconds * 1000, "tokens_per_s": args.rows / seconds,
                     "gflops": gflops, "pct_of_gemm": 100 * gflops / peak})
    summary = {"model": args.model, "params": params, "rows": args.rows, "adapters": args.adapters,
               "rank": args.rank, "context": args.context, "gemm_gflops": peak,
               "mixed_vs_per_adapter": results["per adapter"] / results["mixed"], "rows_detail": rows}
    print("=== summary")
    print(f"{args.model}: {params / 1e6:.1f}M params, batch {args.rows}, {args.adapters} adapters (r{args.rank}), "
          f"context {args.context}, one thread; GEMM {args.rows}x{config.hidden_size}x{config.intermediate_size}: "
          f"{peak:.1f} GFLOP/s")
    print("| decode step | ms | tokens/s | GFLOP/s | % of GEMM |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['gflops']:.1f} | "
              f"{r['pct_of_gemm']:.0f}% |")
    print(f"mixed (one step) is {summary['mixed_vs_per_adapter']:.2f}x the throughput of one step per adapter")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
