"""Health alerts: the rules, the monitor, and two real runs (a KL blow-up, a NaN loss)."""

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
from verl.trainer.alerts import (
    AboveThreshold,
    AlertMonitor,
    EntropyCollapse,
    KLAboveTarget,
    NonFinite,
    RewardCollapse,
    ngram_repetition_rate,
)
from verl.utils.log import RunLogger, read_jsonl

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


def test_rules_fire_on_their_conditions():
    kl = KLAboveTarget(target=0.1, factor=5)
    assert kl.check(1, {"ppo/kl_div": 0.4}) is None
    alert = kl.check(2, {"ppo/kl_div": 2.0})
    assert alert.rule == "kl_far_above_target" and alert.threshold == pytest.approx(0.5)
    assert "20.0x the KL target" in alert.message and "actor.optim.lr" in alert.message

    collapse = RewardCollapse(drop=0.5, window=2)
    fired = [collapse.check(s, {"rollout/reward_mean": r}) for s, r in enumerate([1.0, 1.0, 0.8, 0.3, 0.1], 1)]
    assert [a is not None for a in fired] == [False, False, False, False, True]  # mean(0.3, 0.1) < 0.5
    entropy = EntropyCollapse(ratio=0.1, window=2)
    fired = [entropy.check(s, {"ppo/entropy": e}) for s, e in enumerate([1.0, 0.8, 0.5, 0.05], 1)]
    assert [a is not None for a in fired] == [False, False, False, True]
    clip = AboveThreshold("length_clip_high", "rollout/response_length_clip_ratio", 0.5, "raise it")
    assert clip.check(1, {"rollout/response_length_clip_ratio": 0.9}).value == 0.9
    assert clip.check(1, {}) is None  # a metric this run does not log is not an alert


def test_non_finite_counts_a_streak_and_stops_after_patience():
    rule = NonFinite(patience=2)
    assert rule.check(1, {"ppo/nan_skipped": 0.0, "ppo/policy_loss": 0.1}) is None
    first = rule.check(2, {"ppo/nan_skipped": 1.0, "ppo/policy_loss": float("nan")})
    assert first.action == "warn" and "ppo/policy_loss" in first.message
    assert rule.check(3, {"ppo/nan_skipped": 0.0}) is None  # a good step resets the streak
    assert rule.check(4, {"ppo/nan_skipped": 1.0}).action == "warn"
    stop = rule.check(5, {"ppo/grad_norm": float("inf"), "ppo/nan_skipped": 1.0})
    assert stop.action == "stop" and stop.severity == "critical" and "2 in a row" in stop.message


class Host:
    """What a callback needs from a trainer: the run logger, trackers, quiet flag, request_stop."""

    def __init__(self, logger, trackers):
        self.logger, self.trackers, self.quiet, self.stop_reason = logger, trackers, True, None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason


def test_monitor_writes_rows_tracker_events_and_rate_limits(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verl.tracking.tensorboard_tracker import TensorBoardTracker

    logger = RunLogger(tmp_path / "verl_logs.jsonl")
    tracker = TensorBoardTracker(log_dir=tmp_path / "tb")
    host = Host(logger, [tracker])
    monitor = AlertMonitor([KLAboveTarget(0.1, 5), NonFinite(patience=2)], cooldown_steps=3)
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
                          "callbacks": {"early_stop": {"enable": True, "patience": 2, "kl_threshold": 1.0}}}}
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
                          "alerts": {"nan_patience": 2}}}
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
