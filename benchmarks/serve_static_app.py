"""A simple static-batching service: the baseline a careful engineer writes in an afternoon, for ``serve_bench.py``.

    STATIC_MODEL=/path/to/model uvicorn benchmarks.serve_static_app:app --host 127.0.0.1 --port 8002

Requests wait in a queue; a worker collects up to ``STATIC_MAX_BATCH`` of them (waiting at most ``STATIC_WAIT_MS``
after the first), left-pads them into one batch and runs one greedy ``model.generate`` in a thread (the event loop
keeps accepting requests meanwhile); every request of the batch is answered when the whole batch is done. No
admission into a running batch, no per-request stopping (a finished row waits for the longest), no streaming —
what continuous batching adds on top. Same endpoint shape as the tutorial's app, plus ``completion_tokens``.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = os.environ.get("STATIC_MODEL", "verl/models/assets/tiny-arith")
MAX_NEW_TOKENS = int(os.environ.get("STATIC_MAX_NEW_TOKENS", "100"))
MAX_BATCH = int(os.environ.get("STATIC_MAX_BATCH", "32"))
WAIT_S = float(os.environ.get("STATIC_WAIT_MS", "20")) / 1000
torch.set_num_threads(int(os.environ.get("STATIC_TORCH_THREADS", "1")))

tokenizer = AutoTokenizer.from_pretrained(MODEL)
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
queue: asyncio.Queue[tuple[str, asyncio.Future]] = asyncio.Queue()


def generate_batch(prompts: list[str]) -> list[tuple[str, int]]:
    """One padded greedy ``generate`` for the batch: (completion text, completion tokens up to eos) per prompt."""
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        outputs = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
    completions = outputs[:, inputs["input_ids"].shape[1]:]
    answers = []
    for row in completions:
        ids = row.tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        answers.append((tokenizer.decode(ids, skip_special_tokens=True), len(ids)))
    return answers


async def batcher() -> None:
    loop = asyncio.get_running_loop()
    while True:
        batch = [await queue.get()]
        deadline = loop.time() + WAIT_S
        while len(batch) < MAX_BATCH:
            try:
                batch.append(await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0)))
            except TimeoutError:
                break
        try:
            answers = await loop.run_in_executor(None, generate_batch, [prompt for prompt, _ in batch])
        except Exception as exc:  # answer every waiting request, keep serving
            for _, future in batch:
                future.set_exception(exc)
            continue
        for (_, future), answer in zip(batch, answers, strict=True):
            future.set_result(answer)


@asynccontextmanager
async def lifespan(_app: FastAPI):
    task = asyncio.create_task(batcher())
    yield
    task.cancel()


app = FastAPI(lifespan=lifespan)


@app.post("/generate")
async def generate_text(prompt: str):
    future: asyncio.Future = asyncio.get_running_loop().create_future()
    await queue.put((prompt, future))
    text, tokens = await future
    return {"response": text, "completion_tokens": tokens}
