"""The README's reward-model story, run as written (slow group): pairs from the warm start's own answers, `verl rm
--config configs/rm_tiny.yaml` to >= 95% held-out pairwise accuracy, the RM served alone (`VERL_SERVE_MODEL` on its
checkpoint), GRPO whose only reward is that served RM raising the rule-checked held-out accuracy by >= 40 points;
then shipping on judged traffic: a service whose RM scores the live answers (`score_traffic`), Locust users that send
no answers and rate some answers later, `verl ship --reward-source rm:judge` promoting the GRPO run over the warm
start, and the online report on the users' feedback. Only the ports, the repo paths and the servers' lifetimes are
adapted to a test. The story's first two commands (pairs, `verl rm`) run as written once per session, or once per
`make test-slow` (tests/conftest.py `readme_reward_model`): the flywheel starts from the same reward model. Serial:
the canary reads live rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.readme import README_RM_HEADING, REPO, readme_block, readme_rm_commands
from tests.trainer_utils import rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.serial]


def wait_healthy(url: str) -> str:
    return (f"for i in $(seq 180); do python -c \"import urllib.request; urllib.request.urlopen('{url}/health')\" "
            "2> /dev/null && break; sleep 1; done")


@pytest.mark.budget(300)  # 110 s, and 190 s for the shared README reward model (whichever test uses it first)
def test_readme_reward_model_story_runs_as_written(tmp_path: Path, readme_reward_model: Path) -> None:
    script = readme_block(README_RM_HEADING) + readme_block("### Shipping on judged traffic")
    # The first two commands ran as written in the session's fixture: their outputs are linked in, the rest runs here.
    for command in readme_rm_commands():
        script = script.replace(command + "\n", "", 1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs-tiny").symlink_to(readme_reward_model / "data" / "pairs-tiny")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "verl-rm").symlink_to(readme_reward_model / "outputs" / "verl-rm")
    rm_port, port = free_port(), free_port()
    rm_url, url = f"http://127.0.0.1:{rm_port}", f"http://127.0.0.1:{port}"
    script = script.replace("uvicorn serve.api:app --port 8321 &",
                            f"uvicorn serve.api:app --port {rm_port} > rm.log 2>&1 & RM=$!\n{wait_healthy(rm_url)}")
    script = script.replace("http://127.0.0.1:8321", rm_url)
    script = script.replace("verl serve --config serve-judged.yaml &",
                            f"verl serve --config serve-judged.yaml --port {port} > serve.log 2>&1 & SERVER=$!\n"
                            f"{wait_healthy(url)}")
    script = script.replace("-f loadtest/ --headless", f"-f {REPO}/loadtest/ --headless")
    script = script.replace("http://127.0.0.1:8000", url)
    script = "trap 'kill ${RM:-} ${SERVER:-} ${LOAD:-} 2> /dev/null || true' EXIT\n" + script
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "VERL_CACHE_DIR": os.environ.get("VERL_CACHE_DIR", str(REPO / ".cache"))}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=1400)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])

    # verl rm: >= 95% held-out pairwise accuracy (from ~chance).
    evals = rows(tmp_path / "outputs/verl-rm/rm-a/verl_logs.jsonl", "eval")
    print(f"verl rm: held-out pairwise accuracy {evals[0]['pairwise_accuracy']:.3f} -> "
          f"{evals[-1]['pairwise_accuracy']:.3f}")
    assert evals[0]["pairwise_accuracy"] < 0.6 and evals[-1]["pairwise_accuracy"] >= 0.95

    # GRPO on the served RM alone: the rule-checked held-out accuracy up by >= 40 points, the RM's score logged
    # beside the rule's accuracy, no reward lost.
    log = tmp_path / "outputs/verl/grpo-rm/verl_logs.jsonl"
    evals = rows(log, "eval")
    print(f"GRPO on the RM alone: rule accuracy {evals[0]['accuracy']:.3f} -> {evals[-1]['accuracy']:.3f}")
    assert evals[-1]["accuracy"] - evals[0]["accuracy"] >= 0.40
    rollouts = rows(log, "rollout")
    assert all("rm_score" in r and "acc" in r for r in rollouts)  # what it is trained on, beside the rule
    assert all(r["failed"] == 0 for r in rows(log, "reward") if "failed" in r)
    assert not [r for r in rows(log, "alert") if r.get("rule") == "reward_model_gaming"]  # it learnt the task

    # Shipped on the RM's scores of answers whose requests carried no answer: promoted.
    [audit] = list((tmp_path / "outputs/verl/grpo-rm/ship").glob("*/audit.jsonl"))
    decision = json.loads(audit.read_text().splitlines()[-1])
    print("verl ship:", decision["decision"], decision["reason"])
    assert decision["decision"] == "promote" and decision["evidence"]["reward_source"] == "rm:judge"
    assert decision["evidence"]["reward"]["mean_candidate"] > decision["evidence"]["reward"]["mean_incumbent"]
    # The users' feedback on both models, read apart from the RM's scores.
    report = json.loads((tmp_path / "outputs/compare/online/online.json").read_text())
    assert report["reward_source"] == "feedback" and "base" in report["models"] and len(report["models"]) == 2
    assert all(s["rewarded"] > 0 for s in report["models"].values())
