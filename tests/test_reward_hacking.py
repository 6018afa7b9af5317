"""The divergence rule on real runs (verl/trainer/health.py, ``RewardDivergence``): a deliberately gameable reward
(longer answers score more, whatever they say) is learnt while the held-out accuracy, which the data's answers give
and the reward does not, falls; the rule says so, by default and as a `when: diverges` rule against another
held-out metric. The same tiny run on the task's own reward learns the task and stays silent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LENGTH_REWARD = '''
def longer_is_better(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return min(len(solution_str), 40) / 40
'''


def train(tmp_path: Path, name: str, steps: int, reward: dict | None, rules: list[dict]) -> list[dict]:
    config = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    config["trainer"].update(total_steps=steps, test_freq=5, save_freq=0, output_dir=str(tmp_path),
                             experiment_name=name, logger=["jsonl"], health={"add_rules": rules})
    if reward is not None:
        config["reward"] = reward
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([str(Path(sys.executable).with_name("verl")), "train", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    log = tmp_path / "verl" / name / "verl_logs.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.budget(100)
def test_a_gamed_reward_fires_the_divergence_rule_and_a_learnt_task_does_not(tmp_path):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    flexible = {"name": "flexible_divergence", "metric": "rollout/reward_mean", "when": "diverges",
                "against": "eval/accuracy_flexible", "threshold": 2.0, "window": 5}
    rows = train(tmp_path, "gamed", 45, {"custom_reward": {"path": str(tmp_path / "length_reward.py"),
                                                           "name": "longer_is_better"}}, [flexible])
    rollout = {r["step"]: r for r in rows if r.get("scope") == "rollout"}
    evals = {r["step"]: r for r in rows if r.get("scope") == "eval"}
    # The reward was gamed: it rose while both held-out accuracies ended below their best.
    assert rollout[45]["response_length_mean"] > rollout[1]["response_length_mean"] + 3
    assert evals[45]["accuracy_flexible"] < evals[0]["accuracy_flexible"] - 0.5
    assert evals[45]["accuracy"] < max(r["accuracy"] for r in evals.values()) - 0.1
    alerts = [r for r in rows if r.get("rule") in ("reward_divergence", "flexible_divergence")]
    fired = {r["rule"]: r for r in reversed(alerts)}  # each rule's first alert
    assert set(fired) == {"reward_divergence", "flexible_divergence"}, [r.get("rule") for r in rows if "rule" in r]
    for alert in fired.values():
        assert alert["metric"] == "rollout/reward_mean" and alert["value"] >= 2.0
        assert "gaming the reward" in alert["message"]
        assert alert["step"] < 45  # before the end of the run
    assert "eval/accuracy_flexible" in fired["flexible_divergence"]["message"]

    # The task's own reward, the same run: the accuracy rises with the reward, and neither rule speaks.
    rows = train(tmp_path, "learnt", 40, None, [flexible])
    evals = {r["step"]: r for r in rows if r.get("scope") == "eval"}
    assert evals[40]["accuracy"] > evals[0]["accuracy"] + 0.5
    assert not [r for r in rows if r.get("rule") in ("reward_divergence", "flexible_divergence")]
