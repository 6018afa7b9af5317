"""Tracker fan-out: registry errors, missing packages fail at start, helpers, the jsonl histogram rows, swanlab."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tests.trainer_utils import run_cli
from verl.errors import ConfigError, MissingDependencyError
from verl.tracking import create_trackers
from verl.tracking.backends import ConsoleTracker, JsonlTracker
from verl.tracking.common import RunIds, flatten_config, histogram_summary, samples_markdown
from verl.utils import log
from verl.utils.log import RunLogger, read_jsonl


def test_unknown_tracker_names_the_choices():
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['tensorbord'\]; available: .*tensorboard"):
        create_trackers(["console", "tensorbord"])


@pytest.mark.parametrize("name,module,package", [
    ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
    ("wandb", "wandb", "wandb"),
    ("mlflow", "mlflow", "mlflow"),
    ("swanlab", "swanlab", "swanlab"),
])
def test_missing_package_fails_with_the_install_command(monkeypatch, tmp_path, name, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # what an absent package looks like to `import`
    with pytest.raises(MissingDependencyError, match=rf"trainer.logger={name} needs the '{package}' package.*"
                                                     rf"pip install {package}"):
        create_trackers(["console", "jsonl", name], run_dir=tmp_path)


def test_a_run_with_a_missing_tracker_package_fails_before_the_first_step(monkeypatch, tmp_path):
    from verl.trainer.local import LocalPPOTrainer

    monkeypatch.setitem(sys.modules, "wandb", None)
    trainer = LocalPPOTrainer({"data": {"train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4},
                               "rollout": {"n": 4},
                               "trainer": {"total_steps": 2, "output_dir": str(tmp_path), "experiment_name": "x",
                                           "logger": ["console", "jsonl", "wandb"]}}, quiet=True)
    with pytest.raises(MissingDependencyError, match="pip install wandb"):
        trainer.fit()
    assert not (tmp_path / "verl" / "x").exists()  # checked before the run directory is made


def test_wandb_without_login_fails_in_one_line_and_leaves_no_run_dir(tmp_path):
    # No key, no netrc (HOME is empty), online mode: one line naming both fixes, no traceback, no run dir.
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "", "NETRC": str(tmp_path / "none"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=w",
                      "trainer.logger=[console,jsonl,wandb]"], env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "wandb login" in result.stderr and "WANDB_MODE=offline" in result.stderr
    assert not (tmp_path / "verl" / "w").exists()


def test_offline_wandb_passes_the_login_check(monkeypatch):
    from verl.config import VerlConfig
    from verl.tracking import check_trackers

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(["console", "wandb"], VerlConfig())  # no error: offline runs need no login


def test_a_start_up_failure_after_the_run_dir_exists_removes_it(tmp_path):
    from verl.tracking.base import TRACKERS, register_tracker
    from verl.trainer.local import LocalPPOTrainer

    @register_tracker("fails_to_start")
    def _fails(**_):
        raise ConfigError("this tracker cannot start")

    try:
        trainer = LocalPPOTrainer({"data": {"train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4},
                                   "rollout": {"n": 4},
                                   "trainer": {"total_steps": 1, "output_dir": str(tmp_path), "experiment_name": "s",
                                               "logger": ["jsonl", "fails_to_start"]}}, quiet=True)
        with pytest.raises(ConfigError, match="cannot start"):
            trainer.fit()
    finally:
        TRACKERS.pop("fails_to_start")
    assert not (tmp_path / "verl" / "s").exists()


def test_histogram_summary_is_compact_and_exact_in_its_moments():
    values = np.random.default_rng(0).normal(size=5000)
    summary = histogram_summary([*values, float("nan"), float("inf")])
    assert summary["num"] == 5000 and len(summary["bucket_counts"]) == 30
    assert sum(summary["bucket_counts"]) == 5000
    assert summary["sum"] == pytest.approx(values.sum()) and summary["max"] == pytest.approx(values.max())
    assert summary["bucket_limits"][-1] == pytest.approx(values.max())
    assert histogram_summary([float("nan")]) is None
    assert histogram_summary([2.0])["bucket_counts"] == [1]


def test_flatten_config_and_samples_markdown():
    flat = flatten_config({"actor": {"optim": {"lr": 1e-4, "betas": [0.9, 0.99]}}, "x": None, "k": {}})
    assert flat == {"actor.optim.lr": 1e-4, "actor.optim.betas": "[0.9, 0.99]", "x": "None", "k": "{}"}
    table = samples_markdown([{"prompt": "a|b", "response": "line1\nline2", "score": 0.5, "split": "train"}], step=3)
    lines = table.splitlines()
    assert lines[0] == "| split | prompt | response | ground_truth | score |"
    assert lines[2] == "| train | a\\|b | line1⏎line2 |  | 0.5 |"  # one row: pipes escaped, newlines marked


def test_jsonl_tracker_writes_histogram_rows_the_converter_reads(tmp_path):
    logger = RunLogger(tmp_path / "verl_logs.jsonl")
    token = log.bind(logger)
    try:
        JsonlTracker().log_histograms({"rollout/rewards": [0.0, 1.0, 1.0], "empty": []}, step=7)
    finally:
        log.unbind(token)
        logger.close()
    rows = read_jsonl(tmp_path / "verl_logs.jsonl")
    assert len(rows) == 1
    assert rows[0]["scope"] == "histogram" and rows[0]["step"] == 7 and rows[0]["tag"] == "rollout/rewards"
    assert rows[0]["num"] == 3 and rows[0]["sum_squares"] == 2.0


def test_tracker_fan_out_keeps_one_instance_per_name(tmp_path):
    trackers = create_trackers(["console", "jsonl", "console"], quiet=True)
    assert [type(t) for t in trackers] == [ConsoleTracker, JsonlTracker]


def test_run_ids_persist_atomically(tmp_path):
    ids = RunIds(tmp_path)
    assert ids.get("wandb") is None
    ids.set("wandb", "abc")
    ids.set("mlflow", "123")
    assert RunIds(tmp_path).get("wandb") == "abc"
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"wandb": "abc", "mlflow": "123"}


def test_system_monitor_samples_cpu_and_memory():
    from verl.utils.system import SystemMonitor

    sample = SystemMonitor().sample()
    assert sample["rss_gb"] > 0.01  # this process holds torch
    assert 0 <= sample["host_memory_used_percent"] <= 100 and sample["cpu_percent"] >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NVML metrics)")
def test_system_monitor_reports_gpu_utilisation_and_memory_through_nvml():
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py for NVML")
    from verl.utils.system import SystemMonitor

    monitor = SystemMonitor()
    block = torch.ones(64, 1024, 1024, device="cuda")  # 256 MiB
    sample = monitor.sample()
    assert sample["gpu_memory_allocated_gb"] >= 0.25
    assert 0 <= sample["gpu_util"] <= 100 and 0 < sample["gpu_memory_util"] <= 100
    del block


def test_swanlab_tracker_offline(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="swanlab is optional (pip install swanlab; it pins protobuf<7)")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    from verl.config import build_config, resolve_experiment_name

    config = build_config({"trainer": {"project_name": "p", "experiment_name": "swan"}})
    resolve_experiment_name(config, "x")
    (tracker,) = create_trackers(["swanlab"], config=config, run_dir=tmp_path)
    tracker.log_config({"actor": {"optim": {"lr": 1e-4}}})
    tracker.log_metrics({"rollout/reward_mean": 0.5}, step=1)
    tracker.log_samples([{"prompt": "p", "response": "r", "split": "train"}], step=1)
    tracker.finish()
    (run,) = (tmp_path / "swanlog").glob("run-*")
    assert "lr: 0.0001" in (run / "files" / "config.yaml").read_text()
    assert list(run.glob("run-*.swanlab")) and list((run / "media").rglob("*.txt"))
