"""Where code rewards and evaluators send programs: this process's ``Sandbox``, or a SandboxFusion-compatible
server (``verl sandbox serve``, a SandboxFusion deployment) at ``reward.sandbox.url`` — verl's
``reward_model.sandbox_fusion.url``.

``configure(url, max_concurrent, memory_limit_mb)`` is called by the reward worker from its config; ``runner()``
returns the configured runner, built at its first use (a local ``Sandbox`` with the defaults when nothing was
configured).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import httpx

from verl.sandbox.isolation import Limits
from verl.sandbox.runner import RunCodeRequest, RunCodeResponse, Sandbox, sandbox_error


class Runner(Protocol):
    max_concurrent: int

    def run(self, request: RunCodeRequest) -> RunCodeResponse: ...


RETRIES = 2  # a transport failure is tried again after 0.5 s and 1 s before the row gets no verdict


class RemoteSandbox:
    """SandboxFusion's ``POST /run_code`` at ``url`` (a base URL, or one ending in /run_code as verl writes it);
    at most ``max_concurrent`` requests in flight. A request that fails at the HTTP level comes back as a
    ``SandboxError`` response (a sample with no score from the sandbox), never an exception in the trainer."""

    def __init__(self, url: str, max_concurrent: int = 4, timeout_s: float = 60.0):
        self.url = url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def run(self, request: RunCodeRequest) -> RunCodeResponse:
        with self._slots:
            for attempt in range(RETRIES + 1):
                try:
                    reply = self._client.post(self.url, json=request.model_dump())
                    if reply.status_code in (502, 503, 504) and attempt < RETRIES:
                        raise httpx.TransportError(f"HTTP {reply.status_code}")
                    reply.raise_for_status()
                    return RunCodeResponse.model_validate(reply.json())
                except httpx.TransportError:  # refused, reset, a gateway's 5xx: the server may be restarting
                    if attempt == RETRIES:
                        return sandbox_error(f"{self.url}: no answer after {RETRIES + 1} tries")
                    time.sleep(0.5 * 2**attempt)
                except (httpx.HTTPError, ValueError) as exc:
                    return sandbox_error(f"{self.url}: {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")


_LOCK = threading.Lock()
_SETTINGS: dict = {"url": None, "max_concurrent": 4, "memory_limit_mb": 1024}
_RUNNER: Runner | None = None


def configure(url: str | None = None, max_concurrent: int = 4, memory_limit_mb: int = 1024) -> None:
    """Set the process's runner (built at its first use): remote when ``url`` is given, else a local sandbox with
    these limits."""
    global _RUNNER
    with _LOCK:
        _SETTINGS.update(url=url, max_concurrent=max_concurrent, memory_limit_mb=memory_limit_mb)
        _RUNNER = None


def runner() -> Runner:
    global _RUNNER
    with _LOCK:
        if _RUNNER is None:
            url, slots = _SETTINGS["url"], _SETTINGS["max_concurrent"]
            _RUNNER = (RemoteSandbox(url, slots) if url
                       else Sandbox(Limits(memory_mb=_SETTINGS["memory_limit_mb"]), max_concurrent=slots))
        return _RUNNER


def memory_limit_mb() -> int:
    """The configured per-run memory limit (verl's ``sandbox_fusion.memory_limit_mb``)."""
    return _SETTINGS["memory_limit_mb"]
