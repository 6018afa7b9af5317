"""Why the transformers engine has its own scheduler: transformers' continuous batching vs ours, on this CPU.

    python benchmarks/serve_cb_probe.py            # ~2 minutes

Same model (``builtin:small-arith-base``), 32 prompts x 32 greedy tokens, one torch thread, no HTTP:

- ``generate``: one left-padded batch through ``model.generate`` (the throughput ceiling for a fixed batch);
- ``transformers CB``: ``model.generate_batch`` (transformers' ``ContinuousBatchingManager``, paged attention);
- ``ours``: ``serve.engines.hf_engine.TransformersEngine`` with all 32 requests submitted at once.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
    import torch
    from transformers import GenerationConfig

    torch.set_num_threads(1)
    from serve.engines import create_engine
    from serve.engines.base import EngineRequest, SamplingOptions
    from serve.settings import load_settings

    engine = create_engine(load_settings(model="builtin:small-arith-base", engine="transformers", max_batch_size=32))
    tok = engine.tokenizer
    ids = [tok(f"What is {(i * 37) % 900 + 10}+{(i * 53) % 90 + 5}? Answer:")["input_ids"] for i in range(32)]
    new_tokens = 32
    rows = []

    async def ours() -> float:
        await engine.start()

        async def one(i: int) -> int:
            count = 0
            sampling = SamplingOptions(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            async for out in engine.generate(EngineRequest(f"r{i}", ids[i], sampling)):
                count += len(out.token_ids)
            return count

        await asyncio.gather(*[one(i) for i in range(4)])  # warm-up
        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*[one(i) for i in range(32)]))
        elapsed = time.perf_counter() - t0
        await engine.shutdown(1)
        return total / elapsed

    rows.append(("ours (serve transformers engine)", asyncio.run(ours())))
    model = engine.model
    batch = tok.pad({"input_ids": ids}, return_tensors="pt")
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        rows.append(("model.generate, one batch of 32", 32 * new_tokens / (time.perf_counter() - t0)))
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    out = model.generate_batch(ids, generation_config=config, max_new_tokens=new_tokens)
    produced = sum(len(r.generated_tokens) for r in out.values())
    rows.append(("model.generate_batch (transformers CB)", produced / (time.perf_counter() - t0)))
    print("| path | tokens/s |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.0f} |")


if __name__ == "__main__":
    main()
