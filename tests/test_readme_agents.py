"""The README's agent story, run as written (slow group): train with the calculator, evaluate every checkpoint,
export the best, serve it, run the official openai client's tool loop against it, and load-test agent sessions —
the README's own commands, with only the output paths, the port and the server's lifetime adapted to a test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.serve.helpers import REPO, healthy_server_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Agents: tool use"):]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.budget(230)
def test_readme_agent_story_runs_as_written(tmp_path: Path) -> None:
    commands = readme_commands()
    assert [c.split()[0:2] for c in commands] == [["verl", "train"], ["verl", "eval"], ["verl", "export"],
                                                  ["VERL_SERVE_MODEL=exports/agent-a", "uvicorn"],
                                                  ["python", "examples/agent_client.py"], ["verl", "loadtest"]]
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def run(command: str) -> subprocess.CompletedProcess:
        command = command.replace("outputs/", f"{tmp_path}/outputs/").replace("exports/", f"{tmp_path}/exports/")
        if command.startswith("verl train"):
            command += f" trainer.output_dir={tmp_path}/outputs"
        if command.startswith("verl loadtest"):
            command += f" --out {tmp_path}/loadtest --step-users 1,2 --step-time 6 --step-settle 2"
        result = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return result

    for command in commands[:3]:
        run(command)
    run_dir = tmp_path / "outputs" / "verl" / "agent-a"
    logged = [json.loads(line) for line in (run_dir / "verl_logs.jsonl").read_text().splitlines()]
    evals = [r for r in logged if r["scope"] == "eval"]
    # The learning claim (this is also the tiny agent's learning test: configs/agent_tiny.yaml, trained once): the
    # warm start rarely calls the tool and never greedily; GRPO on multi-turn rollouts makes it call the calculator
    # and answer with the result (held-out products, greedy).
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and first["tool_call_rate"] < 0.2 and first["accuracy"] < 0.2
    assert last["accuracy"] >= 0.6 and last["accuracy"] - first["accuracy"] >= 0.4
    assert last["tool_call_rate"] >= 0.8 and last["valid_call_rate"] >= 0.9
    training = [r for r in logged if r["scope"] == "rollout"]
    early = sum(r["tool_call_rate"] for r in training[:5]) / 5
    late = sum(r["tool_call_rate"] for r in training[-5:]) / 5
    assert late - early >= 0.3, (early, late)
    # --n 4 --temperature 1 are not the run's validation settings: their results get their own directory.
    results = json.loads(next(run_dir.glob("eval/*/global_step_30/results.json")).read_text())
    assert results["metrics"]["eval/tool_call_rate"]["value"] > 0.8
    export = tmp_path / "exports" / "agent-a"
    assert (export / "model.safetensors").is_file()

    port = free_port()
    serve_env = {**env, "VERL_SERVE_MODEL": str(export), "VERL_SERVE_PORT": str(port)}
    with healthy_server_process(serve_env, timeout=120) as url:
        client = subprocess.run([sys.executable, "examples/agent_client.py", "What is 37*412?", "--base-url",
                                 f"{url}/v1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert "assistant calls calculator({'expression': '37*412'}) -> 15244" in client.stdout
        assert "assistant: >> 15244" in client.stdout
    report = run(commands[5])
    summary = report.stderr + report.stdout
    capacity = json.loads((tmp_path / "loadtest" / "capacity_report.json").read_text())
    # The steps measured whole agent sessions. The capacity line counts them when a level meets the README's 2 s
    # session SLO; on a busy box (CI runs the other slow tests beside this one) none may, and the report then says
    # so and why (a CI run missed the line) — a latency, not something this test can hold.
    assert any((step["sessions_per_s"] or 0) > 0 and step["session_latency_p95_ms"] for step in capacity["steps"])
    if capacity["capacity"]["max_users_within_slo"] is None:
        assert "No tested level meets the SLO" in summary and "session" in summary, summary
    else:
        assert "agent sessions/s" in summary, summary
    # The line as written measures agents (its default budget fits a call and the answer: at 32 tokens every answer
    # was cut before the call closed, and 522 "sessions" made 0 calls in silence).
    calls = next(e for e in capacity["llm"] if e["name"] == "session_tool_calls")
    # Greedy, on the task's held-out prompts: sessions call as often as the run's last validation did (100% greedy
    # accuracy on products means a call in every answer: >= 1 call per session, the bar).
    assert calls["mean"] >= min(1.0, last["tool_call_rate"]) - 0.1, (calls, last["tool_call_rate"])
    assert capacity["warnings"] == [] and capacity["source"]["run"]["max_tokens"] == 128
    assert capacity["answers"]["sessions_without_tool_call"]["share"] < 0.25
