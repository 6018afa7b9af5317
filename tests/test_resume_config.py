"""Resume runs with the run's own config.yaml: the README's PPO resume line keeps PPO, lists what it changes,
and refuses changes a checkpoint cannot take."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer_utils import rows, run_cli
from verl.errors import ConfigError
from verl.trainer.local import LocalPPOTrainer
from verl.trainer.resume import load_train_config

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

# ppo_tiny.yaml shrunk to seconds: 4 prompts, one mini-batch, no validation.
SMALL_PPO = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "trainer.test_freq=0",
             "trainer.val_before_train=false", "trainer.save_freq=1"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    first = run_cli(["train", "--config", "configs/ppo_tiny.yaml", f"trainer.output_dir={out}",
                     "trainer.experiment_name=ppo-a", "trainer.total_steps=1", *SMALL_PPO])
    assert first.returncode == 0, first.stderr
    return out


def test_resume_line_from_the_readme_keeps_the_runs_algorithm_and_critic(ppo_run):
    # The README's line: no --config, only the experiment name. It must continue PPO, not start default GRPO.
    result = run_cli(["train", f"trainer.output_dir={ppo_run}", "trainer.experiment_name=ppo-a",
                      "trainer.resume=auto", "trainer.total_steps=2"])
    assert result.returncode == 0, result.stderr
    run_dir = ppo_run / "verl" / "ppo-a"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["algorithm"]["adv_estimator"] == "gae"  # not rewritten to grpo
    assert saved["data"]["train_batch_size"] == 4 and saved["trainer"]["total_steps"] == 2
    assert (run_dir / "checkpoints" / "global_step_2" / "critic").is_dir()  # the critic is still saved
    # One line lists what the command changed.
    line = [x for x in result.stderr.splitlines() if x.startswith("resuming ")]
    assert len(line) == 1 and "global_step_1" in line[0] and "trainer.total_steps 1 -> 2" in line[0]
    resumed = [r for r in rows(run_dir / "verl_logs.jsonl", "train") if r.get("status") == "resumed"]
    assert resumed[-1]["changed"] == {"trainer.total_steps": [1, 2]}
    critic = rows(run_dir / "verl_logs.jsonl", "critic")
    assert [r["step"] for r in critic] == [1, 2]


def test_a_change_a_checkpoint_cannot_take_is_refused_in_one_line(ppo_run):
    result = run_cli(["train", f"trainer.output_dir={ppo_run}", "trainer.experiment_name=ppo-a",
                      "algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.total_steps=5"])
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert "cannot resume" in message and "algorithm.adv_estimator ('gae' -> 'grpo')" in message
    assert "rollout.n (1 -> 2)" in message and "critic on -> off" in message
    assert "trainer.resume_allow_changes=true" in message
    saved = yaml.safe_load((ppo_run / "verl" / "ppo-a" / "config.yaml").read_text())
    assert saved["algorithm"]["adv_estimator"] == "gae"  # untouched


def test_allowed_changes_and_the_explicit_flag(ppo_run):
    run_dir = ppo_run / "verl" / "ppo-a"
    base = [f"trainer.output_dir={ppo_run}", "trainer.experiment_name=ppo-a"]
    cfg, info = load_train_config(None, [*base, "actor.optim.lr=5e-5"])
    assert cfg.algorithm.adv_estimator == "gae" and cfg.actor.optim.lr == 5e-5
    assert info is not None and info.changes == [("actor.optim.lr", 1e-4, 5e-5)]
    # The flag lets a refused change through, and is not carried into the next resume.
    cfg, info = load_train_config(None, [*base, "data.train_batch_size=2", "trainer.resume_allow_changes=true"])
    assert cfg.data.train_batch_size == 2 and cfg.trainer.resume_allow_changes
    # resume=disable starts over with the given config (the defaults here).
    cfg, info = load_train_config(None, [*base, "trainer.resume=disable"])
    assert info is None and cfg.algorithm.adv_estimator == "grpo"
    assert run_dir.is_dir()


def test_the_trainer_checks_configs_built_in_python_too(ppo_run):
    # A config dict handed to the trainer bypasses load_train_config; fit() runs the same check before any step.
    run_dir = ppo_run / "verl" / "ppo-a"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["path"] = "builtin:tiny-arith-base"
    before = (run_dir / "verl_logs.jsonl").read_text()
    trainer = LocalPPOTrainer(config, quiet=True)
    with pytest.raises(ConfigError, match=r"cannot resume .*model\.path \('builtin:tiny-arith' -> "):
        trainer.fit()
    assert (run_dir / "verl_logs.jsonl").read_text() == before  # nothing logged, nothing rewritten
