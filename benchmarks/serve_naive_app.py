"""The service users write today (the tutorial's section 5.2), kept as written, for ``serve_bench.py`` to compare.

    NAIVE_MODEL=/path/to/model uvicorn benchmarks.serve_naive_app:app --host 127.0.0.1 --port 8001

One request at a time: ``async def`` + a blocking ``model.generate`` holds the event loop for the whole
generation, so concurrent clients simply queue. Only the device (CPU here, "cuda" in the tutorial), the model
path, the thread count and ``max_new_tokens`` (tutorial: 100) are parameters; the endpoint is the tutorial's,
including ``prompt`` as a query parameter and a response that repeats the prompt (plus ``completion_tokens``, so the
benchmark can count tokens of any tokenizer).
"""

from __future__ import annotations

import os

import torch
from fastapi import FastAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = os.environ.get("NAIVE_MODEL", "verl/models/assets/tiny-arith")
MAX_NEW_TOKENS = int(os.environ.get("NAIVE_MAX_NEW_TOKENS", "100"))
torch.set_num_threads(int(os.environ.get("NAIVE_TORCH_THREADS", "1")))

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL)
app = FastAPI()


@app.post("/generate")
async def generate_text(prompt: str):
    inputs = tokenizer(prompt, return_tensors="pt").to("cpu")
    with torch.no_grad():
        outputs = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS)
    response = tokenizer.decode(outputs[0], skip_special_tokens=True)
    return {"response": response, "completion_tokens": outputs.shape[1] - inputs["input_ids"].shape[1]}
