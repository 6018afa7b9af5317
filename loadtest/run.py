"""One command for a capacity run: ``verl loadtest`` (``make loadtest``).

1. start ``uvicorn serve.api:app`` on a free loopback port (one torch thread) and wait for ``/health``;
2. run the stepped test headless: ``locust --config loadtest/locust.conf`` with our overrides, as a subprocess
   with a hard time limit (the plan's length plus a margin);
3. save the service's ``/metrics`` (a cross-check the report shows), stop the service (SIGINT: it drains);
4. write the capacity report from Locust's CSVs.

With ``url`` (``verl loadtest --url``) steps 1 and 3's stop are skipped: the test runs against a service that is
already up, e.g. ``verl serve --replicas 2`` on Ray Serve; ``/metrics`` is saved before and after, so the report's
cross-check counts this run only, and the replicas it reports in ``/health`` feed the per-replica planning line.
``processes`` > 1 runs Locust's load generation in that many worker processes (``--processes``).

Without ``url``, traffic goes to 127.0.0.1 only. Everything lands in ``out_dir``: ``locust_*.csv``, ``locust.html``
(Locust's own report), ``locust.log``, ``server.log``, ``server_metrics.prom`` and the capacity report with its
plots.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest.checks import ABORT_EXIT_CODE, abort_reason
from loadtest.render import make_report
from loadtest.report import FleetPlan
from loadtest.settings import AGENT_PROMPTS, LoadTestConfig
from loadtest.shapes import StepPlan
from verl.errors import VerlError
from verl.utils.fs import atomic_write_text, ensure_writable_dir
from verl.utils.net import LOOPBACK, reserved_port

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
LOCUST_CONF = HERE / "locust.conf"
CSV_STEM = "locust"
# A fleet's /metrics shows the other replicas' series as of their last shipment to the control plane (every 1 s,
# serve/fleet.py METRICS_EVERY_S): wait this long after the test before the final scrape.
FLEET_METRICS_LAG_S = 1.5


class LoadTestError(VerlError):
    """The service or Locust did not start or finish as expected (the message points at the log)."""


def http_get(url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback only)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Poll ``/health`` until 200; fail early if the process exits or the service reports itself dead."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoadTestError(f"the service exited with code {proc.returncode} while starting; see {log_path}")
        try:
            status, body = http_get(url + "/health", timeout=2)
            if status == 200:
                return
            last = f"HTTP {status}: {body.decode(errors='replace')[:200]}"
            if b'"dead"' in body:
                raise LoadTestError(f"the service failed to start ({last}); see {log_path}")
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise LoadTestError(f"the service was not healthy after {timeout_s:g} s (last: {last}); see {log_path}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> None:
    """Signal the process (group) and wait; kill it if it does not stop in time."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def local_service(log_path: Path, env: dict[str, str] | None = None, startup_timeout_s: float = 180.0,
                  cwd: Path | None = None) -> Iterator[str]:
    """``python -m uvicorn serve.api:app`` on a free loopback port; yields its URL once ``/health`` is 200."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "VERL_SERVE_TORCH_THREADS": "1", **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The port stays reserved while the server imports its model and binds it (uvicorn binds with SO_REUSEADDR).
    with reserved_port() as port, log_path.open("w") as log:
        url = f"http://{LOOPBACK}:{port}"
        # Its own process group: stopping it never signals us, and a stuck worker is killed with it.
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve.api:app", "--host", LOOPBACK, "--port",
                                 str(port), "--log-level", "warning", "--timeout-graceful-shutdown", "20"],
                                cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, proc, startup_timeout_s, log_path)
            yield url
        finally:
            _stop(proc)


def locust_command(url: str, csv_prefix: Path, plan: StepPlan, config: LoadTestConfig) -> list[str]:
    """The headless Locust command line: locust.conf's defaults, then our overrides (CLI wins)."""
    command = [sys.executable, "-m", "locust", "--config", str(LOCUST_CONF), "-f", str(LOCUSTFILE), "--headless", "-H",
               url, "--csv", str(csv_prefix), "--csv-full-history", "--html", f"{csv_prefix}.html", "--load-shape",
               "steps", "--step-users", ",".join(str(u) for u in plan.levels), "--step-time", f"{plan.step_time_s:g}",
               "--step-settle", f"{plan.settle_s:g}", "--user-mix", config.user_mix, "--max-tokens",
               str(config.max_tokens), *config.extra_locust_args, *config.user_classes]
    if config.processes > 1:
        command += ["--processes", str(config.processes)]
    if config.user_mix == "agent" and not any(a.startswith("--prompt-file") for a in config.extra_locust_args):
        command += ["--prompt-file", AGENT_PROMPTS]  # questions that need the tool (products for a calculator)
    return command


def run_locust(command: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> int:
    """Run Locust to completion (or kill it after ``timeout_s``); returns its exit code."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc, signal.SIGTERM, 15)
            raise LoadTestError(f"Locust did not finish within {timeout_s:g} s; see {log_path}") from None
        finally:
            _stop(proc, signal.SIGTERM, 15)


def _health(url: str, api_key: str | None) -> dict[str, Any]:
    """The running service's ``/health`` (``--url``): it must answer 200 before any load is sent."""
    try:
        status, body = http_get(url + "/health", timeout=10, api_key=api_key)
    except (OSError, urllib.error.URLError) as exc:
        raise LoadTestError(f"no service answers at {url} ({exc}); start it first (verl serve, or verl serve "
                            f"--replicas N) or drop --url to let verl loadtest start one") from None
    if status != 200:
        raise LoadTestError(f"{url}/health answered HTTP {status}: {body.decode(errors='replace')[:200]}")
    return json.loads(body)


@contextlib.contextmanager
def _service(config: LoadTestConfig, out: Path, say: Any) -> Iterator[tuple[str, int]]:
    """The service under test, as (URL, replicas): the one at ``config.url``, or a local one started here."""
    if config.url is not None:
        health = _health(config.url, config.api_key)
        replicas = int(health.get("replicas") or 1)
        say(f"testing the running service at {config.url} ({replicas} replica{'s' if replicas > 1 else ''})")
        yield config.url, replicas
        return
    env = dict(config.server_env)
    if config.model:
        env["VERL_SERVE_MODEL"] = config.model
    if config.engine:
        env["VERL_SERVE_ENGINE"] = config.engine
    say(f"starting the service on {LOOPBACK} (log: {out / 'server.log'})")
    with local_service(out / "server.log", env, config.startup_timeout_s) as url:
        yield url, 1
        say("stopping the service")


def _save_metrics(url: str, api_key: str | None, path: Path) -> Path | None:
    status, page = http_get(url + "/metrics", timeout=30, api_key=api_key)
    if status != 200:
        return None
    atomic_write_text(path, page.decode())
    return path


def run_loadtest(config: LoadTestConfig, echo: Any = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Service up (or ``config.url``) -> stepped Locust run -> service down -> report. ``echo(str)`` reports
    progress."""
    say = echo or (lambda _msg: None)
    out = ensure_writable_dir(config.out_dir, "the load test output dir (--out)")
    plan = config.plan()
    csv_prefix = out / CSV_STEM
    locust_env = {"LOCUST_API_KEY": config.api_key} if config.api_key else None  # not on the command line
    with _service(config, out, say) as (url, replicas):
        # A service that was up before the test has counted other traffic: the report counts the difference.
        baseline = _save_metrics(url, config.api_key, out / "server_metrics_before.prom") if config.url else None
        say(f"service ready at {url}; Locust: levels {list(plan.levels)} x {plan.step_time_s:g} s "
            f"(about {plan.duration_s:g} s)" + (f", {config.processes} processes" if config.processes > 1 else ""))
        command = locust_command(url, csv_prefix, plan, config)
        # Margin: Locust start-up, prompt preparation and stopping users.
        code = run_locust(command, plan.duration_s + 90, out / "locust.log", env=locust_env)
        if replicas > 1:
            time.sleep(FLEET_METRICS_LAG_S)  # the other replicas' series have caught up on the page
        metrics_file = _save_metrics(url, config.api_key, out / "server_metrics.prom")
    if code == ABORT_EXIT_CODE:
        reason = abort_reason((out / "locust.log").read_text(errors="replace"))
        raise LoadTestError(f"the load test stopped early: {reason or 'every request failed'}; "
                            f"see {out / 'locust.log'}")
    if code not in (0, 1) or not Path(f"{csv_prefix}_stats.csv").is_file():
        raise LoadTestError(f"Locust exited with code {code} without complete CSVs; see {out / 'locust.log'}")
    return make_report(csv_prefix, out, config.slo, server_metrics=metrics_file,
                       plan=FleetPlan(replicas, config.target_rps),
                       server_baseline=baseline if metrics_file is not None else None)
