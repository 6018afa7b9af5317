"""Run the real app under uvicorn on a loopback port (in a thread, or in a subprocess for signal tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from serve.api import create_app
from serve.cli import uvicorn_options
from serve.settings import load_settings
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# Small, quick defaults for tests: the shipped 1M-parameter warm start, short generations.
TEST_SETTINGS = {"model": "builtin:tiny-arith", "max_batch_size": 8, "max_queue_size": 16, "default_max_tokens": 16,
                 "max_output_tokens": 128, "engine": "transformers"}


@dataclass
class Server:
    url: str
    app: object
    server: uvicorn.Server | None = None

    @property
    def service(self):
        return self.app.state.service


def wait_healthy(url: str, timeout: float = 120.0) -> httpx.Response:
    """Poll /health until 200; fail with the last answer (the service says why it is not ready)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url + "/health", timeout=5)
            if last.status_code == 200:
                return last
            if last.json().get("status") == "dead":
                raise AssertionError(f"server failed to start: {last.text}")
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not healthy after {timeout}s: {last.text if last is not None else 'no answer'}")


@contextlib.contextmanager
def run_server(wait: bool = True, as_verl_serve: bool = False, **overrides) -> Iterator[Server]:
    """Start ``create_app`` under uvicorn in a background thread on a free loopback port (with ``as_verl_serve``,
    under the options ``verl serve`` gives uvicorn: header deadline, keep-alive timeout)."""
    settings = load_settings(**{**TEST_SETTINGS, **overrides})
    app = create_app(settings)
    port = free_port()
    options = {"timeout_graceful_shutdown": 10}
    if as_verl_serve:
        options = {**uvicorn_options(settings), **options}
    options.update(host="127.0.0.1", port=port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if wait:
            wait_healthy(url)
        yield Server(url, app, server)
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def run_server_process(env: dict[str, str], python: str | None = None,
                       uvicorn_args: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m uvicorn serve.api:app`` in a subprocess (real signals, real startup), configured by env."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.Popen(
        [python or sys.executable, "-m", "uvicorn", "serve.api:app", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--timeout-graceful-shutdown", "30", *uvicorn_args],
        cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextlib.contextmanager
def healthy_server_process(env: dict[str, str], timeout: float) -> Iterator[str]:
    """``run_server_process`` once ``/health`` answers 200; a server that never gets there fails the caller with
    the tail of its own output (why it did not start), not just a timeout."""
    with run_server_process(env) as (url, proc):
        try:
            wait_healthy(url, timeout=timeout)
        except AssertionError:
            proc.terminate()
            raise AssertionError(proc.stdout.read()[-3000:]) from None
        yield url


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when the series does not exist yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def make_lora_adapters(root: Path, names: tuple[str, ...] = ("a", "b"), rank: int = 4) -> dict[str, str]:
    """Real PEFT LoRA adapters over the tiny model, saved under ``root``; B is random (not PEFT's zero init), so
    each adapter really changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl.models.loader import resolve_model_path

    base_path = resolve_model_path("builtin:tiny-arith")
    out = {}
    for seed, name in enumerate(names):
        torch.manual_seed(100 + seed)
        model = AutoModelForCausalLM.from_pretrained(base_path)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=4 * rank, target_modules="all-linear",
                                                init_lora_weights=False))
        peft.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


class BackgroundClients:
    """``clients`` threads, each running ``self.client(index)`` until the ``with`` block ends (``self.stop`` is set);
    subclasses send the requests and append what failed to ``self.failures``."""

    def __init__(self, url: str, clients: int):
        self.url, self.stop, self.failures = url, threading.Event(), []
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def client(self, index: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def replica_states(url: str, headers: dict[str, str], key: Callable[[dict], object], replicas: int = 2,
                   timeout_s: float = 90.0) -> list[dict]:
    """``GET /admin/state`` read by every replica of a fleet: batches of eight concurrent reads on fresh connections,
    a second apart, until ``replicas`` distinct values of ``key(state)`` answered (or ``timeout_s`` passed; the
    caller asserts). Two CI runs read one node 20 and 40 times in a row right after /health said two; the likely
    cause (unconfirmed) is that a replica counts in ``/health`` once it has joined the control plane, while Ray
    Serve's proxy routes to it only after its first health check and the controller's next update of the proxy's
    replica set — on a saturated CI box, seconds later. One read at a time can also go to the same replica every
    time (the router picks the shorter queue)."""
    def read(_: int) -> dict:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            return client.get("/admin/state").json()

    reads: list[dict] = []
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(8) as pool:
        while True:
            reads.extend(pool.map(read, range(8)))
            if len({key(r) for r in reads}) >= replicas or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    return reads
