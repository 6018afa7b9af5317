"""Callbacks: EarlyStopper (the early-stop health rules), BestCheckpointSaver in a real run (YAML + Python),
custom callbacks from YAML."""

from __future__ import annotations

import json

import pytest

from verl.config import build_config
from verl.errors import ConfigError
from verl.trainer.callbacks import BestCheckpointSaver, TrainerCallback, load_callback
from verl.trainer.health import EarlyStopper, callbacks_from_config
from verl.utils.log import RunLogger, read_jsonl


class Host:
    """What a callback needs from a trainer: the run logger, trackers, quiet flag, request_stop."""

    def __init__(self, logger):
        self.logger, self.trackers, self.quiet, self.stop_reason = logger, [], True, None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason


def feed(stopper: EarlyStopper, host: Host, series: list[dict]) -> int | None:
    """Step through ``series``; the step at which the stopper asked to stop (None if it never did)."""
    for step, metrics in enumerate(series, 1):
        stopper.on_step_end(host, step, metrics)
        if host.stop_reason:
            return step
    return None


@pytest.fixture
def host(tmp_path):
    logger = RunLogger(tmp_path / "verl_logs.jsonl")
    yield Host(logger)
    logger.close()


def test_early_stopper_kl_needs_patience_consecutive_steps(host, tmp_path):
    stopper = EarlyStopper(patience=3, kl_threshold=0.2, reward_drop=None, min_response_length=None)
    kl = [0.3, 0.3, 0.1, 0.3, 0.3, 0.3, 0.3]  # a dip at step 3 restarts the count
    assert feed(stopper, host, [{"ppo/kl_div": v} for v in kl]) == 6
    assert host.stop_reason.startswith("early_stop: ppo/kl_div 0.3 > 0.2 for 3 consecutive step(s)")
    alert = next(r for r in read_jsonl(tmp_path / "verl_logs.jsonl") if r["scope"] == "alert")
    assert alert["rule"] == "early_stop" and alert["step"] == 6 and alert["level"] == "ERROR"


def test_early_stopper_reward_drop_and_response_collapse(host):
    stopper = EarlyStopper(patience=2, kl_threshold=None, reward_drop=0.2, reward_window=2, min_response_length=None)
    rewards = [1.0, 1.0, 0.9, 0.7, 0.5, 0.5]  # 2-step means: 1.0, 0.95, 0.8 (20% down, not more), 0.6, 0.5
    assert feed(stopper, host, [{"rollout/reward_mean": r} for r in rewards]) == 6
    assert "more than 20% below its peak 1" in host.stop_reason

    host.stop_reason = None
    stopper = EarlyStopper(patience=2, kl_threshold=None, reward_drop=None, min_response_length=1.0,
                           max_repetition_rate=0.9)
    series = [{"rollout/response_length_mean": 5.0}, {"rollout/response_length_mean": 0.5},
              {"rollout/response_length_mean": 0.2}]
    assert feed(stopper, host, series) == 3 and "response collapse" in host.stop_reason
    host.stop_reason = None
    loops = [{"rollout/repetition_rate": 0.95}] * 2
    stopper = EarlyStopper(patience=2, kl_threshold=None, reward_drop=None, min_response_length=None)
    assert feed(stopper, host, loops) == 2 and "loops" in host.stop_reason


def test_callbacks_reject_bad_settings():
    with pytest.raises(ConfigError, match="mode must be 'max' or 'min'"):
        BestCheckpointSaver("eval/accuracy", mode="best")
    with pytest.raises(ConfigError, match="patience must be >= 1"):
        EarlyStopper(patience=0)
    with pytest.raises(ConfigError, match="trainer.health.add_rules.0.patience"):
        build_config({"trainer": {"health": {"add_rules": [{"name": "s", "when": "non_finite", "patience": 0}]}}})


def test_custom_callbacks_load_from_yaml_specs(tmp_path):
    source = tmp_path / "my_callbacks.py"
    source.write_text("from verl.trainer.callbacks import TrainerCallback\n"
                      "class Counter(TrainerCallback):\n"
                      "    def __init__(self):\n        self.steps = 0\n"
                      "class NotACallback:\n    pass\n")
    config = build_config({"trainer": {"callbacks": {"custom": [f"{source}:Counter"]},
                                       "health": {"add_rules": [{"name": "early_stop", "when": "non_finite",
                                                                 "action": "stop"}]}}})
    callbacks = callbacks_from_config(config)
    assert [type(c).__name__ for c in callbacks] == ["HealthMonitor", "Counter"]
    assert "early_stop" in {rule.name for rule in callbacks[0].rules}
    assert isinstance(callbacks[-1], TrainerCallback)
    with pytest.raises(ConfigError, match="not a verl TrainerCallback"):
        load_callback(f"{source}:NotACallback")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        load_callback(f"{source}:Missing")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        load_callback("no_such_module_xyz:Thing")
    with pytest.raises(ConfigError, match="is not 'package.module:Class'"):
        load_callback("just_a_name")
    assert callbacks_from_config(build_config({"trainer": {"health": {"rules": []}}})) == []
    assert callbacks_from_config(build_config({"trainer": {"health": {"enable": False}}})) == []


def test_best_checkpoint_kept_through_retention_and_early_stop_from_python(tmp_path):
    """YAML turns on BestCheckpointSaver; Python adds an EarlyStopper that stops at step 4 of 6.

    The ranking metric is train/progress in "min" mode, whose best step is known in advance (step 1): the saver
    checkpoints step 1 at once (save_freq=-1 would not), and retention (max_ckpt_to_keep=1) must keep it.
    """
    from verl.trainer.checkpoint import list_checkpoints, read_pointer
    from verl.trainer.local import LocalPPOTrainer

    config = {"data": {"train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4}, "rollout": {"n": 4},
              "trainer": {"total_steps": 6, "test_freq": -1, "val_before_train": False, "save_freq": -1,
                          "max_ckpt_to_keep": 1, "output_dir": str(tmp_path), "experiment_name": "best",
                          "logger": ["jsonl"],
                          "callbacks": {"best_checkpoint": {"enable": True, "metric": "train/progress",
                                                            "mode": "min"}}}}
    trainer = LocalPPOTrainer(config, quiet=True)
    # Mean response length is ~5 tokens here: "below 100" holds every step, so it stops after patience=4 steps.
    trainer.add_callback(EarlyStopper(patience=4, kl_threshold=None, reward_drop=None, min_response_length=100))
    trainer.fit()
    run_dir = tmp_path / "verl" / "best"
    rows = read_jsonl(run_dir / "verl_logs.jsonl")
    assert sorted(r["step"] for r in rows if r["scope"] == "rollout") == [1, 2, 3, 4]
    finished = next(r for r in rows if r.get("status") == "finished")
    assert finished["step"] == 4 and finished["reason"].startswith("early_stop: rollout/response_length_mean")
    assert [r["step"] for r in rows if "checkpoint" in r] == [1, 4]  # the new best at once, then the stop

    marker = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert marker == {"metric": "train/progress", "mode": "min", "value": pytest.approx(1 / 6), "step": 1,
                      "checkpoint": "global_step_1"}
    best = read_pointer(run_dir, "best")
    assert best == run_dir / "checkpoints" / "global_step_1"
    assert json.loads((best / "meta.json").read_text())["metrics"]["train/progress"] == pytest.approx(1 / 6)
    # max_ckpt_to_keep=1 keeps the latest (the stop step) and, protected, the best.
    assert [step for step, _ in list_checkpoints(run_dir)] == [1, 4]
    assert read_pointer(run_dir, "latest") == run_dir / "checkpoints" / "global_step_4"
    assert [r["step"] for r in rows if "best_checkpoint" in r] == [1]

    # A resumed saver knows the best so far and does not replace it with a worse value.
    resumed = BestCheckpointSaver("train/progress", "min")
    resumed.on_train_start(trainer)
    assert (resumed.best_value, resumed.best_step) == (pytest.approx(1 / 6), 1)
    assert not resumed.better(0.5) and resumed.better(0.1)


def test_plain_objects_with_some_hooks_are_callbacks_and_others_are_refused_at_add(tmp_path):
    from verl.trainer.local import LocalPPOTrainer

    class CountSteps:  # no base class, only one hook: the others are no-ops
        def __init__(self):
            self.steps = []

        def on_step_end(self, trainer, step, metrics):
            self.steps.append(step)

    config = {"data": {"train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4}, "rollout": {"n": 4},
              "trainer": {"total_steps": 2, "test_freq": 1, "output_dir": str(tmp_path), "experiment_name": "duck",
                          "logger": ["jsonl"]}}
    trainer = LocalPPOTrainer(config, quiet=True)
    counter = CountSteps()
    trainer.add_callback(counter)
    with pytest.raises(ConfigError, match="none of the hooks on_train_start.*subclass .*TrainerCallback"):
        trainer.add_callback(object())
    with pytest.raises(ConfigError, match=r"pass an instance: add_callback\(CountSteps\(...\)\)"):
        trainer.add_callback(CountSteps)
    trainer.fit()  # validation (on_evaluate), checkpoints (on_save): hooks the object lacks are skipped
    assert counter.steps == [1, 2]
