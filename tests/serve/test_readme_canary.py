"""The README's canary loop, run as written (slow group): two LoRA runs, one service with both adapters behind a
90/10 route, a Locust run with rewards, the online A/B report, and a promote — on the README's own commands, with
only the port, the repo paths and the server's lifetime adapted to a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.readme import REPO, readme_block

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.serial]  # timed load


@pytest.mark.budget(145)
def test_readme_canary_loop_runs_as_written(tmp_path: Path) -> None:
    """The canary block, then on the same service the `verl ship` block: a third run promoted through the gates and
    the canary under a rewarded load, and run-b refused."""
    script = readme_block("### Two checkpoints behind one route") + readme_block("### Shipping on evidence")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = script.replace("http://127.0.0.1:8000", url)
    script = script.replace("-f loadtest/ --config loadtest/locust.conf",
                            f"-f {REPO}/loadtest/ --config {REPO}/loadtest/locust.conf -H {url}")
    script = script.replace("-f loadtest/ --headless", f"-f {REPO}/loadtest/ --headless")
    script = script.replace("verl serve &", f"verl serve --port {port} > serve.log 2>&1 & SERVER=$!\n"
                            f"trap 'kill $SERVER; [ -z \"${{LOAD:-}}\" ] || kill $LOAD' EXIT\n"
                            f"for i in $(seq 120); do python -c \"import urllib.request; urllib.request.urlopen("
                            f"'{url}/health')\" 2> /dev/null && break; sleep 1; done")
    bin_dir = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "VERL_CACHE_DIR": os.environ.get("VERL_CACHE_DIR", str(REPO / ".cache"))}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=1100)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads((tmp_path / "outputs/compare/online/online.json").read_text())
    assert set(report["models"]) == {"run-a", "run-b"}
    shares = {m: s["requests"] for m, s in report["models"].items()}
    assert shares["run-a"] > 3 * shares["run-b"] > 0  # the 90/10 split
    assert all(s["errors"] == 0 and s["rewarded"] > 0 for s in report["models"].values())
    assert '"run-a": 1.0' in result.stdout  # the promote's final state
    assert (tmp_path / "outputs/loadtest/route_stats.csv").is_file()
    # verl ship on route chat (run-b's): lora-c promoted (every gate and the canary), then lora-b refused against it.
    [promoted] = [json.loads(line) for line in next((tmp_path / "outputs/verl/lora-c/ship").glob("*/audit.jsonl"))
                  .read_text().splitlines()][-1:]
    assert promoted["decision"] == "promote", promoted
    assert "not shipped: exit 10" in result.stdout
    [refused] = [json.loads(line) for line in next((tmp_path / "outputs/verl/lora-b/ship").glob("*/audit.jsonl"))
                 .read_text().splitlines()][-1:]
    assert refused["decision"] == "refused" and "gate" in refused["reason"]
