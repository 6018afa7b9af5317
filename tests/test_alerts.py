"""Health rules: the conditions, the monitor, the legacy sections, and real runs (a KL blow-up, a NaN loss, rules
that skip updates and add checkpoints)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from verl.algos.losses import clipped_policy_loss, register_policy_loss
from verl.config import build_config
from verl.errors import ConfigError
from verl.trainer.health import HealthMonitor, MetricRule, build_health_rules
from verl.trainer.step_metrics import ngram_repetition_rate
from verl.utils.log import RunLogger, read_jsonl

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

TINY = {"data": {"train_batch_size": 4, "val_max_samples": 8}, "actor": {"ppo_mini_batch_size": 4},
        "rollout": {"n": 4}}


# ---------------------------------------------------------------------------------------------- repetition metric


def seq_rep_reference(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def test_repetition_rate_matches_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 2, (16, 24), generator=generator)  # two tokens: 4-grams repeat often
    lengths = torch.randint(0, 25, (16,), generator=generator)
    mask = (torch.arange(24)[None, :] < lengths[:, None]).long()
    expected = sum(seq_rep_reference(responses[i, : lengths[i]].tolist(), 4) for i in range(16)) / 16
    assert ngram_repetition_rate(responses, mask, n=4) == pytest.approx(expected, abs=1e-12)
    assert expected > 0.1  # the check is not vacuous


def test_repetition_rate_is_zero_for_varied_and_high_for_looping_text():
    varied = torch.arange(40).reshape(2, 20)
    loop = torch.tensor([[7, 8, 9] * 6 + [0, 0]])  # "a b c a b c ..." then padding
    loop_mask = torch.tensor([[1] * 18 + [0, 0]])
    assert ngram_repetition_rate(varied, torch.ones_like(varied)) == 0.0
    assert ngram_repetition_rate(loop, loop_mask) == pytest.approx(seq_rep_reference([7, 8, 9] * 6, 4))
    assert ngram_repetition_rate(loop, loop_mask) > 0.7
    with pytest.raises(ValueError, match="must be equal 2-D shapes"):
        ngram_repetition_rate(varied, torch.ones(3))


# ---------------------------------------------------------------------------------------------- rules


def default_rules(target_kl: float = 0.1) -> dict[str, list[MetricRule]]:
    """The shipped rules, by name (their KL bound scales with ``algorithm.kl_ctrl.target_kl``)."""
    rules: dict[str, list[MetricRule]] = {}
    for rule in build_health_rules(build_config({"algorithm": {"kl_ctrl": {"target_kl": target_kl}}})):
        rules.setdefault(rule.name, []).append(rule)
    return rules


def test_default_rules_fire_on_their_conditions():
    rules = default_rules(target_kl=0.1)
    [kl] = rules["kl_far_above_target"]
    assert kl.check(1, {"ppo/kl_div": 0.4}) is None
    alert = kl.check(2, {"ppo/kl_div": 2.0})
    assert alert.rule == "kl_far_above_target" and alert.threshold == pytest.approx(0.5) and alert.action == "warn"
    assert "ppo/kl_div 2 > 0.5" in alert.message and "5x the KL target 0.1" in alert.message
    assert "actor.optim.lr" in alert.message

    [collapse] = rules["reward_collapse"]
    rewards = [1.0] * 5 + [0.8, 0.3, 0.1, 0.1]
    fired = [collapse.check(s, {"rollout/reward_mean": r}) for s, r in enumerate(rewards, 1)]
    assert [a is not None for a in fired] == [False] * 8 + [True]  # the mean of the last five, 0.46 < 0.5
    [entropy] = rules["entropy_collapse"]
    fired = [entropy.check(s, {"ppo/entropy": e}) for s, e in enumerate([1.0, 0.8, 1.0, 0.8, 0.9, 0.5, 0.05], 1)]
    assert [a is not None for a in fired] == [False] * 6 + [True]  # 0.05 < 0.1 x the mean of the first five
    [clip] = rules["length_clip_high"]
    assert clip.check(1, {"rollout/response_length_clip_ratio": 0.9}).value == 0.9
    assert clip.check(1, {}) is None  # a metric this run does not log is not an alert


def test_conditions_patience_and_actions_from_rule_specs():
    below = MetricRule.of(name="short", metric="rollout/response_length_mean", when="below", threshold=2.0,
                          patience=2, action="checkpoint", advice="look at the samples")
    assert below.check(1, {"rollout/response_length_mean": 1.0}) is None  # 1 of 2
    assert below.check(2, {"rollout/response_length_mean": 3.0}) is None  # cleared: the streak restarts
    assert below.check(3, {"rollout/response_length_mean": 1.0}) is None
    alert = below.check(4, {"rollout/response_length_mean": 1.5})
    assert alert.action == "checkpoint" and alert.severity == "warning"
    assert alert.message == ("rollout/response_length_mean 1.5 < 2 for 2 consecutive step(s); checkpointing step 4; "
                             "look at the samples")
    skip = MetricRule.of(name="no_signal", metric="rollout/reward_std", when="below", threshold=1e-6,
                         action="skip_step")
    assert skip.before_update and skip.check(1, {"rollout/reward_std": 0.0}).action == "skip_step"
    with pytest.raises(ConfigError, match="skip_step is decided before the update.*'ppo/kl_div' is not one"):
        MetricRule.of(name="bad", metric="ppo/kl_div", when="above", threshold=1.0, action="skip_step")
    with pytest.raises(ConfigError, match="when=above needs a threshold"):
        MetricRule.of(name="bad", metric="ppo/kl_div", when="above")
    with pytest.raises(ConfigError, match="trainer.health.rules"):
        build_config({"trainer": {"health": {"rules": [{"name": "x", "when": "sideways", "metric": "a/b"}]}}})


def test_non_finite_reports_every_step_and_stops_after_patience():
    rules = default_rules()
    monitor = HealthMonitor(rules["non_finite"], cooldown_steps=10)
    host = Host(None, [])
    monitor.on_step_end(host, 1, {"ppo/nan_skipped": 0.0, "ppo/policy_loss": 0.1})
    monitor.on_step_end(host, 2, {"ppo/nan_skipped": 1.0, "ppo/policy_loss": float("nan")})
    monitor.on_step_end(host, 3, {"ppo/nan_skipped": 0.0})  # a good step resets the streak
    monitor.on_step_end(host, 4, {"ppo/nan_skipped": 1.0})
    monitor.on_step_end(host, 5, {"ppo/nan_skipped": 1.0})
    assert host.stop_reason is None
    monitor.on_step_end(host, 6, {"ppo/grad_norm": float("inf"), "ppo/nan_skipped": 1.0})
    fired = [(a["rule"], a["action"]) for a in monitor.fired]
    assert fired == [("non_finite", "warn")] * 3 + [("non_finite", "stop")]  # one row per step
    assert "ppo/policy_loss" in monitor.fired[0]["message"]
    assert "for 3 consecutive step(s), stopping at step 6" in host.stop_reason


def test_the_removed_sections_name_their_replacement_and_rules_replace_the_defaults():
    """trainer.alerts and trainer.callbacks.early_stop are gone: a value is refused naming trainer.health; the
    sections at their old defaults (every config.yaml written before) still load, so those runs resume."""
    with pytest.raises(ConfigError, match=r"trainer.alerts was removed; use trainer.health.rules .*"
                                          r"trainer.alerts.kl_factor"):
        build_config({"trainer": {"alerts": {"kl_factor": 7}}})
    with pytest.raises(ConfigError, match=r"trainer.callbacks.early_stop was removed; use "
                                          r"trainer.health.add_rules with action: stop"):
        build_config({"trainer": {"callbacks": {"early_stop": {"enable": True}}}})
    old = build_config({"trainer": {"alerts": {"enable": True, "kl_factor": 5.0},
                                    "callbacks": {"early_stop": {"enable": False, "patience": 5}}}})
    assert [r.name for r in build_health_rules(old)] == [r.name for r in build_health_rules(build_config({}))]
    own = build_config({"trainer": {"health": {"rules": [{"name": "kl", "metric": "ppo/kl_div", "when": "above",
                                                          "threshold": 1.0, "action": "stop"}],
                                               "add_rules": [{"name": "nan", "when": "non_finite"}]}}})
    assert [r.name for r in build_health_rules(own)] == ["kl", "nan"]


class Host:
    """What a callback needs from a trainer: the run logger, trackers, quiet flag, request_stop."""

    def __init__(self, logger, trackers):
        self.logger, self.trackers, self.quiet, self.stop_reason = logger, trackers, True, None
        self.config = None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason


def test_monitor_writes_rows_tracker_events_and_rate_limits(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verl.tracking.tensorboard_tracker import TensorBoardTracker

    logger = RunLogger(tmp_path / "verl_logs.jsonl")
    tracker = TensorBoardTracker(log_dir=tmp_path / "tb")
    host = Host(logger, [tracker])
    rules = default_rules(target_kl=0.1)
    stop = MetricRule.of(name="non_finite", when="non_finite", patience=2, action="stop")
    monitor = HealthMonitor([*rules["kl_far_above_target"], rules["non_finite"][0], stop], cooldown_steps=3)
    kl = [2.0, 2.0, 2.0, 2.0, 0.0, 2.0]  # violating, cleared at step 5, violating again
    for step, value in enumerate(kl, 1):
        monitor.on_step_end(host, step, {"ppo/kl_div": value, "ppo/nan_skipped": 0.0})
    monitor.on_step_end(host, 7, {"ppo/kl_div": 0.0, "ppo/nan_skipped": 1.0})
    monitor.on_step_end(host, 8, {"ppo/kl_div": 0.0, "ppo/nan_skipped": 1.0})
    logger.close()
    tracker.finish()
    rows = [r for r in read_jsonl(tmp_path / "verl_logs.jsonl") if r["scope"] == "alert"]
    assert [(r["step"], r["rule"]) for r in rows] == [
        (1, "kl_far_above_target"), (4, "kl_far_above_target"), (6, "kl_far_above_target"),
        (7, "non_finite"), (8, "non_finite")]
    assert rows[0]["level"] == "WARNING" and rows[-1]["level"] == "ERROR" and rows[-1]["action"] == "stop"
    assert host.stop_reason.startswith("non_finite: ")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Tensors("alerts/text_summary")] == [1, 4, 6, 7, 8]


# ---------------------------------------------------------------------------------------------- real runs


def test_kl_blow_up_alerts_and_stops_early_with_a_checkpoint(tmp_path):
    config = {**TINY, "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": 0.05}},  # a far too large step size
              "trainer": {"total_steps": 8, "test_freq": -1, "val_before_train": False, "save_freq": -1,
                          "output_dir": str(tmp_path), "experiment_name": "kl-blowup",
                          "health": {"add_rules": [{"name": "early_stop", "metric": "ppo/kl_div", "when": "above",
                                                    "threshold": 1.0, "patience": 2, "action": "stop"}]}}}
    path = tmp_path / "kl_blowup.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "train", "--config", str(path)], cwd=tmp_path,
                          env=os.environ, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "verl" / "kl-blowup"
    rows = read_jsonl(run_dir / "verl_logs.jsonl")
    alerts = [r for r in rows if r["scope"] == "alert"]
    kl_alert = next(r for r in alerts if r["rule"] == "kl_far_above_target")
    assert kl_alert["value"] > 10 * 0.1 and kl_alert["level"] == "WARNING"
    stop = next(r for r in alerts if r["rule"] == "early_stop")
    finished = next(r for r in rows if r.get("status") == "finished")
    assert finished["reason"].startswith("early_stop: ppo/kl_div") and "for 2 consecutive step(s)" in finished["reason"]
    assert stop["step"] == finished["step"] < 8
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"global_step_{stop['step']}"
    meta = json.loads((run_dir / "checkpoints" / f"global_step_{stop['step']}" / "meta.json").read_text())
    assert meta["step"] == stop["step"]
    assert "ALERT" in proc.stderr and "kl_far_above_target" in proc.stderr


CALLS = {"n": 0}


@register_policy_loss("test_nan_after_first_step")
def nan_after_first_step(*args, **kwargs):
    """The vanilla loss, poisoned with NaN from the second call (= step) on."""
    loss, metrics = clipped_policy_loss(*args, **kwargs)
    CALLS["n"] += 1
    return (loss * float("nan") if CALLS["n"] > 1 else loss), metrics


def test_nan_loss_is_skipped_reported_and_stops_after_patience(tmp_path):
    from safetensors.torch import load_file

    from verl.trainer.local import LocalPPOTrainer

    CALLS["n"] = 0
    config = {**TINY, "actor": {"ppo_mini_batch_size": 4, "policy_loss": "test_nan_after_first_step"},
              "trainer": {"total_steps": 6, "test_freq": -1, "val_before_train": False, "save_freq": 1,
                          "output_dir": str(tmp_path), "experiment_name": "nan", "logger": ["jsonl"],
                          "health": {"add_rules": [{"name": "non_finite", "when": "non_finite", "patience": 2,
                                                    "action": "stop"}]}}}
    trainer = LocalPPOTrainer(config, quiet=True)
    trainer.fit()
    run_dir = tmp_path / "verl" / "nan"
    rows = read_jsonl(run_dir / "verl_logs.jsonl")
    ppo = {r["step"]: r for r in rows if r["scope"] == "ppo"}
    assert sorted(ppo) == [1, 2, 3]  # stopped after two NaN steps in a row
    assert [ppo[s]["nan_skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert ppo[2]["policy_loss"] == "nan" and math.isnan(float(ppo[2]["grad_norm"]))
    alerts = [r for r in rows if r["scope"] == "alert"]
    assert [(r["step"], r["rule"], r.get("action")) for r in alerts] == [(2, "non_finite", "warn"),
                                                                         (3, "non_finite", "stop")]
    finished = next(r for r in rows if r.get("status") == "finished")
    assert finished["reason"].startswith("non_finite: ") and finished["step"] == 3
    # The skipped steps did not touch the weights: the checkpoints of steps 1 and 3 are identical and finite.
    after_1 = load_file(run_dir / "checkpoints" / "global_step_1" / "model.safetensors")
    after_3 = load_file(run_dir / "checkpoints" / "global_step_3" / "model.safetensors")
    assert after_1.keys() == after_3.keys()
    assert all(torch.equal(after_1[k], after_3[k]) and torch.isfinite(after_3[k]).all() for k in after_1)


def test_rules_skip_updates_and_add_checkpoints_in_a_real_run(tmp_path):
    """skip_step: no update at all (the checkpoints of steps 1 and 3 hold the same weights); checkpoint: step 1 is
    saved though save_freq saves only the end; both are alert rows; ppo/update_skipped says which steps skipped."""
    from safetensors.torch import load_file

    from verl.trainer.local import LocalPPOTrainer

    rules = [{"name": "always_skip", "metric": "rollout/num_responses", "when": "above", "threshold": 0,
              "action": "skip_step"},
             {"name": "keep_one", "metric": "rollout/response_length_mean", "when": "above", "threshold": 0,
              "action": "checkpoint", "cooldown_steps": 5}]
    config = {**TINY, "trainer": {"total_steps": 3, "test_freq": -1, "val_before_train": False, "save_freq": -1,
                                  "output_dir": str(tmp_path), "experiment_name": "rules", "logger": ["jsonl"],
                                  "health": {"rules": rules}}}
    LocalPPOTrainer(config, quiet=True).fit()
    run_dir = tmp_path / "verl" / "rules"
    rows = read_jsonl(run_dir / "verl_logs.jsonl")
    assert [r["update_skipped"] for r in rows if r["scope"] == "ppo"] == [1.0, 1.0, 1.0]
    alerts = [(r["step"], r["rule"], r["action"]) for r in rows if r["scope"] == "alert"]
    assert alerts == [(1, "always_skip", "skip_step"), (1, "keep_one", "checkpoint"), (2, "always_skip", "skip_step"),
                      (3, "always_skip", "skip_step")]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*"))
    assert saved == ["global_step_1", "global_step_3"]
    first = load_file(run_dir / "checkpoints" / "global_step_1" / "model.safetensors")
    last = load_file(run_dir / "checkpoints" / "global_step_3" / "model.safetensors")
    assert all(torch.equal(first[k], last[k]) for k in first)


def test_reward_model_gaming_fires_when_the_rm_score_rises_and_the_rule_accuracy_does_not():
    """``rollout/rm_score`` up by >= 2 starting spreads while ``rollout/acc`` stays: the training-time tripwire."""
    config = build_config({"reward": {"model": {"url": "http://127.0.0.1:1"}}})
    [gaming] = [r for r in build_health_rules(config) if r.name == "reward_model_gaming"]
    assert not [r for r in build_health_rules(build_config({})) if r.name == "reward_model_gaming"]  # rule reward

    def run(scores, accuracy, spread=0.1):
        rule = type(gaming)(window=2)
        return [rule.check(s, {"rollout/rm_score": r, "rollout/acc": a, "rollout/reward_std": spread})
                for s, (r, a) in enumerate(zip(scores, accuracy, strict=True), 1)]

    # start: mean(0.2, 0.2) = 0.2, spread 0.1; at step 4: mean(0.3, 0.35) -> z = 1.25; at 5: mean(0.35, 0.45) ->
    # z = 2.0 with accuracy flat at 0.1: it fires there (not before: two windows are needed)
    fired = run([0.2, 0.2, 0.3, 0.35, 0.45], [0.1] * 5)
    assert [a is not None for a in fired] == [False, False, False, False, True]
    assert fired[-1].value == pytest.approx(2.0) and "gaming the reward model" in fired[-1].message
    assert "0.100 -> 0.100" in fired[-1].message
    # the same rise with the accuracy rising by more than 0.05: learning, not gaming
    assert all(a is None for a in run([0.2, 0.2, 0.3, 0.35, 0.45], [0.1, 0.1, 0.2, 0.3, 0.4]))
    # the accuracy rose then fell from its peak while the score kept rising: gaming again
    late = run([0.2, 0.2, 0.3, 0.4, 0.5, 0.6], [0.1, 0.1, 0.5, 0.5, 0.3, 0.2])
    assert late[-1] is not None and "peak 0.500" in late[-1].message
    assert all(a is None for a in run([0.2] * 6, [0.1] * 6))  # nothing rose
    assert gaming.check(1, {"rollout/rm_score": 0.5}) is None  # no rule accuracy logged: nothing to compare


def test_reward_divergence_against_a_metric_logged_only_on_validation_steps():
    """The training reward every step, the held-out accuracy every second step (validation, step 0 before training);
    window 2, spread 0.1. Numbers by hand in the comments."""
    from verl.trainer.health import RewardDivergence

    def run(accuracy: dict[int, float]) -> dict[int, object]:
        rule = RewardDivergence(window=2)
        fired = {0: rule.check(0, {"eval/accuracy": accuracy[0]})}
        for step, reward in enumerate([0.2, 0.2, 0.3, 0.4, 0.5, 0.6], 1):
            fired[step] = rule.check(step, {"rollout/reward_mean": reward, "rollout/reward_std": 0.1})
            if step in accuracy:  # the validation row comes after the step's (HealthMonitor.on_evaluate)
                fired[step] = rule.check(step, {"eval/accuracy": accuracy[step]}) or fired[step]
        return fired

    # start (steps 1-2): reward 0.2, accuracy mean(step 0, step 2) = 0.8. Step 4: reward mean(0.3, 0.4) -> z = 1.5,
    # no fire. Step 5: mean(0.4, 0.5) -> z = 2.5 against the accuracy at 4 (0.6), 0.2 below its peak 0.8: fires.
    fired = run({0: 0.8, 2: 0.8, 4: 0.6, 6: 0.4})
    assert [s for s, a in fired.items() if a is not None] == [5, 6]
    assert fired[5].value == pytest.approx(2.5) and "eval/accuracy" in fired[5].message
    assert "0.800 -> 0.600 (peak 0.800)" in fired[5].message
    # The accuracy rising with the reward (0.8 -> 0.9 -> 1.0): learning, silent.
    assert all(a is None for a in run({0: 0.8, 2: 0.8, 4: 0.9, 6: 1.0}).values())
    # Before any held-out value after the start there is nothing to compare: silent however the reward rises.
    rule = RewardDivergence(window=2)
    rule.check(0, {"eval/accuracy": 0.8})
    assert all(rule.check(s, {"rollout/reward_mean": 0.2 * s, "rollout/reward_std": 0.1}) is None for s in range(1, 7))


def test_the_divergence_rule_is_a_default_when_the_run_validates_and_a_rule_anyone_can_write():
    names = [r.name for r in build_health_rules(build_config({}))]
    assert "reward_divergence" in names
    assert "reward_divergence" not in [r.name for r in build_health_rules(build_config({"trainer": {"test_freq": 0}}))]
    config = build_config({"trainer": {"health": {"add_rules": [
        {"name": "code_gaming", "metric": "rollout/rm_score", "when": "diverges", "against": "eval/solved",
         "threshold": 3.0, "window": 4, "action": "checkpoint"}]}}})
    [rule] = [r for r in build_health_rules(config) if r.name == "code_gaming"]
    assert (rule.reward, rule.task, rule.z, rule.window, rule.action) == ("rollout/rm_score", "eval/solved", 3.0, 4,
                                                                          "checkpoint")
    for bad, expected in (({"against": ""}, "needs `against`"), ({"action": "skip_step"}, "skip_step")):
        spec = {"name": "x", "metric": "rollout/reward_mean", "when": "diverges", "against": "eval/accuracy",
                "threshold": 2.0, **bad}
        with pytest.raises(ConfigError, match=expected):
            build_config({"trainer": {"health": {"add_rules": [spec]}}})
