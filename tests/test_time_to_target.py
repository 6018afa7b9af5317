"""Time to target (``trainer.target``): the clock by hand on a fake timer, then a real run through the CLI that
stops at its target, read back by ``verl compare``'s experiment row and the dashboard."""

from __future__ import annotations

import json

import pytest

from tests.trainer_utils import rows, run_cli
from verl.config import load_config
from verl.errors import ConfigError
from verl.trainer.target import Target, TargetClock, read_target


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_target_spelling():
    assert Target.parse("eval/accuracy:0.25") == Target("eval/accuracy", 0.25, "max")
    assert Target.parse("critic/vf_loss:0.1:min").mode == "min"
    assert Target("eval/accuracy", 0.25).reached(0.25) and not Target("eval/accuracy", 0.25).reached(0.2499)
    assert Target("l/x", 0.1, "min").reached(0.05) and not Target("l/x", 0.1, "min").reached(float("nan"))
    for bad, why in (("eval/accuracy", "METRIC:VALUE"), ("accuracy:0.2", "no scope"), ("eval/accuracy:high", "not a "
                     "number"), ("eval/accuracy:0.2:up", "max or min"), ("eval/accuracy:inf", "finite")):
        with pytest.raises(ValueError, match=why):
            Target.parse(bad)
    assert load_config(None, ["trainer.target=eval/accuracy:0.250"]).trainer.target == "eval/accuracy:0.25"
    with pytest.raises(ConfigError, match="trainer.target"):
        load_config(None, ["trainer.target=eval/accuracy"])
    with pytest.raises(ConfigError, match="stop_at_target=true needs trainer.target"):
        load_config(None, ["trainer.stop_at_target=true"])


def test_clock_counts_training_to_the_update_and_leaves_validation_out():
    """Start at t=100. Validation before training 5 s; step 1 trains 10 s; step 2 trains 10 s and is validated
    (4 s) at 0.3 >= 0.25: reached at step 2 with 20 s of training (its update), 9 s of validation apart, 29 s of
    wall time when found. Later steps never move the record."""
    now = FakeTime()
    clock = TargetClock(Target.parse("eval/accuracy:0.25"), now=now)
    clock.start()
    now.t += 5
    clock.add_validation(5)
    assert clock.check(0, {"eval/accuracy": 0.1}) is None
    now.t += 10
    assert clock.mark_update(1) == pytest.approx(10)
    assert clock.check(1, {"rollout/reward_mean": 0.9}) is None  # not the target's metric
    now.t += 10
    assert clock.mark_update(2) == pytest.approx(20)
    now.t += 4
    clock.add_validation(4)
    record = clock.check(2, {"eval/accuracy": 0.3})
    assert record["step"] == 2 and record["seconds"] == pytest.approx(20) and record["minutes"] == pytest.approx(0.333)
    assert record["validation_seconds"] == pytest.approx(9) and record["wall_seconds"] == pytest.approx(29)
    now.t += 10
    clock.mark_update(3)
    assert clock.check(3, {"eval/accuracy": 0.9}) is None and clock.reached["step"] == 2
    # A resume carries the time spent so far: 39 s of wall time, 9 s of it validation.
    resumed = TargetClock(Target.parse("eval/accuracy:0.95"), now=now)
    resumed.load_state_dict(clock.state_dict())
    resumed.start()
    now.t += 10
    assert resumed.mark_update(4) == pytest.approx(39 + 10 - 9)


@pytest.mark.e2e
def test_a_run_stops_at_its_target_and_compare_and_dashboard_show_it(tmp_path):
    """The tiny GRPO run with a target every validation reaches (accuracy >= 0): found at the first validation after
    training started (step 2, test_freq 2), the run stops there with a checkpoint, and the record is what the clock
    says: training time to step 2's update < wall time, validation apart."""
    out = tmp_path / "runs"
    result = run_cli(["train", "trainer.total_steps=6", "trainer.test_freq=2", "trainer.val_before_train=false",
                      "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                      "data.val_max_samples=8", "trainer.save_freq=100", "trainer.logger=[jsonl]",
                      "trainer.target=eval/accuracy:0", "trainer.stop_at_target=true",
                      f"trainer.output_dir={out}", "trainer.experiment_name=t"])
    assert result.returncode == 0, result.stderr
    run_dir = out / "verl" / "t"
    assert "target eval/accuracy:0 reached at step 2" in result.stderr
    record = read_target(run_dir)
    assert record["step"] == 2 and record["metric"] == "eval/accuracy" and record["value"] >= 0
    assert 0 < record["seconds"] < record["wall_seconds"] and record["validation_seconds"] > 0
    # Each of the three is rounded to the millisecond on its own, so the sum may exceed the wall by up to 1.5 ms.
    assert record["seconds"] + record["validation_seconds"] <= record["wall_seconds"] + 2e-3
    assert [r["step"] for r in rows(run_dir / "verl_logs.jsonl", "rollout")] == [1, 2]  # stopped at the target
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
    finished = [r for r in rows(run_dir / "verl_logs.jsonl", "train") if r.get("status") == "finished"]
    assert finished[-1]["reason"] == "target eval/accuracy:0 reached at step 2"

    compared = run_cli(["compare", str(run_dir), str(run_dir), "--out", str(tmp_path / "cmp")])
    assert compared.returncode == 0, compared.stderr
    experiment = json.loads((tmp_path / "cmp" / "compare.json").read_text())["experiments"][0]
    assert experiment["target"] == "eval/accuracy:0"
    assert experiment["time_to_target"] == f"{record['minutes']:.2f} min (step 2)"
    assert "time_to_target" in (tmp_path / "cmp" / "report.md").read_text()

    from verl.dashboard.runs import RunState

    state = RunState(0, "t", run_dir / "verl_logs.jsonl")
    state.refresh()
    shown = state.delta(0, 0)
    assert shown["status"]["target"]["step"] == 2 and shown["status"]["target"]["target"] == "eval/accuracy:0"
    assert not any(tag.startswith("target/") for tag in shown["points"])  # a status line, not a curve
    json.dumps(shown)
