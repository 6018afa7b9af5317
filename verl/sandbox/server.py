"""``verl sandbox serve``: the sandbox over HTTP with SandboxFusion's API, so verl's
``reward_model.sandbox_fusion.url`` (and any SandboxFusion client) can point at it.

``POST /run_code`` takes and returns SandboxFusion's bodies (``runner.py``); runs beyond ``max_concurrent`` wait
for a slot (verl's client bounds its own concurrency with ``sandbox_fusion.max_concurrent``). ``GET /health`` says
which isolation mechanism is in use, whether the process limit holds, and the runs so far by status.
"""

from __future__ import annotations

from collections import Counter

import anyio
from fastapi import FastAPI

from verl.sandbox.isolation import process_limit_holds
from verl.sandbox.runner import RunCodeRequest, RunCodeResponse, Sandbox


def build_app(sandbox: Sandbox) -> FastAPI:
    app = FastAPI(title="verl sandbox", description="SandboxFusion-compatible code execution (POST /run_code)")
    # Runs wait on a subprocess: worker threads, as many as the sandbox runs at once (anyio's default is 40).
    limiter = anyio.CapacityLimiter(sandbox.max_concurrent)
    runs: Counter[str] = Counter()  # responses by status, for /health

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(request: RunCodeRequest) -> RunCodeResponse:
        response = await anyio.to_thread.run_sync(sandbox.run, request, limiter=limiter)
        runs[response.status] += 1
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "isolation": sandbox.mechanism, "process_limit": process_limit_holds(),
                "max_concurrent": sandbox.max_concurrent, "runs": dict(runs)}

    return app
