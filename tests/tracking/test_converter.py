"""`verl tensorboard`: follows a log another process appends to; restarts and Ctrl-C never duplicate a point."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl.errors import ConfigError
from verl.tracking.converter import STATE_FILE, TensorBoardConverter, follow

STEPS = 60

# A stand-in trainer: the real RunLogger writes rows the way PPOTrainer does (samples, histogram, metric rows,
# then the next step), one step every 0.1 s; step 30 ends with a row written in two halves (a torn line).
WRITER = r"""
import json, sys, time
from verl.utils.log import RunLogger
from verl.tracking.common import histogram_summary
path, steps = sys.argv[1], int(sys.argv[2])
logger = RunLogger(path)
logger.event("train", step=0, status="started")
for step in range(1, steps + 1):
    logger.set_step(step)
    for i in range(2):
        logger.event("sample", step=step, split="train", prompt=f"p{step}-{i}", response=f"r{step}-{i}",
                     ground_truth="x", score=float(i))
    logger.event("histogram", step=step, tag="rollout/rewards", **histogram_summary([0.0, 1.0, float(step)]))
    logger.info("rollout", reward_mean=step / 10, response_length_mean=5.0)
    logger.info("ppo", kl_div=step / 100, policy_loss=-0.1)
    logger.flush(step)
    if step == 30:
        row = json.dumps({"timestamp": "t", "level": "INFO", "scope": "custom", "step": step, "torn": 1.5})
        with open(path, "a") as fh:
            fh.write(row[:20]); fh.flush(); time.sleep(0.6); fh.write(row[20:] + "\n")
    time.sleep(0.1)
logger.event("train", step=steps, status="finished", reason="completed")
logger.close()
"""


def scalars(tb_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def wait_for(predicate, what: str, timeout: float = 120.0, processes: tuple = ()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in processes:
            if proc.poll() not in (None, 0):
                raise AssertionError(f"{proc.args[:4]} failed while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def state(tb_dir: Path) -> dict:
    try:
        return json.loads((tb_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def start_converter(run_dir: Path, tb_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verl.cli", "tensorboard", "--log_dir", str(run_dir),
                             "--tb_dir", str(tb_dir), "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_converter(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)  # a loaded 2-core box: the last pass may still be writing events
    assert proc.returncode == 0, err  # Ctrl-C is a clean stop, not an error
    return err


def test_converter_follows_a_growing_log_across_restarts_with_one_point_per_step(tmp_path):
    run_dir, tb_dir = tmp_path / "run", tmp_path / "tb"
    run_dir.mkdir()
    log_path = run_dir / "verl_logs.jsonl"
    converter = start_converter(run_dir, tb_dir)  # started before the trainer: it waits for the log
    writer = None
    try:
        wait_for(lambda: (tb_dir / STATE_FILE).is_file(), "the converter's first pass", processes=(converter,))
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log_path), str(STEPS)],
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: state(tb_dir).get("offset", 0) > 0, "the first converted rows",
                 processes=(converter, writer))
        first_err = stop_converter(converter)  # Ctrl-C while the log is still growing
        assert "stopped;" in first_err
        stopped_at = state(tb_dir)["offset"]
        converter = start_converter(run_dir, tb_dir)
        assert writer.wait(timeout=120) == 0
        size = log_path.stat().st_size
        wait_for(lambda: state(tb_dir).get("offset") == size, "the converter to reach the end of the log",
                 processes=(converter,))
        stop_converter(converter)
    finally:
        for proc in (converter, writer):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert 0 < stopped_at < size  # the restart really happened mid-log

    acc = scalars(tb_dir)
    tags = acc.Tags()
    for tag in ("rollout/reward_mean", "rollout/response_length_mean", "ppo/kl_div", "ppo/policy_loss"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == list(range(1, STEPS + 1)), tag  # exactly one point per step, in order
    assert [e.value for e in acc.Scalars("rollout/reward_mean")] == pytest.approx([s / 10 for s in range(1, 61)])
    assert [(e.step, e.value) for e in acc.Scalars("custom/torn")] == [(30, 1.5)]  # the torn row, once
    assert [e.step for e in acc.Histograms("rollout/rewards")] == list(range(1, STEPS + 1))
    texts = acc.Tensors("samples/train/text_summary")
    assert [e.step for e in texts] == list(range(1, STEPS + 1))
    assert "r7-1" in texts[6].tensor_proto.string_val[0].decode()
    assert "train/status" not in tags["scalars"]  # events are not curves


def write_rows(path: Path, rows: list[dict]) -> None:
    with path.open("a") as fh:
        for row in rows:
            fh.write(json.dumps({"timestamp": "t", "level": "INFO", **row}) + "\n")


def test_sample_table_at_the_end_of_the_log_waits_until_complete(tmp_path):
    log = tmp_path / "verl_logs.jsonl"
    write_rows(log, [{"scope": "sample", "step": 1, "split": "train", "response": "a1"},
                     {"scope": "rollout", "step": 1, "reward_mean": 0.5},
                     {"scope": "sample", "step": 2, "split": "train", "response": "b1"}])
    converter = TensorBoardConverter(log, tmp_path / "tb")
    assert converter.convert() == {"scalars": 1, "texts": 1}  # step 2's table is held back
    held_at = state(tmp_path / "tb")["offset"]
    # RunLogger writes a NaN metric as the string "nan" (JSON has no NaN); it is still a (NaN) point.
    write_rows(log, [{"scope": "sample", "step": 2, "split": "train", "response": "b2"},
                     {"scope": "rollout", "step": 2, "reward_mean": "nan"}])
    assert converter.convert() == {"scalars": 1, "texts": 1}
    converter.close()
    assert 0 < held_at < log.stat().st_size
    acc = scalars(tmp_path / "tb")
    step2 = acc.Tensors("samples/train/text_summary")[1].tensor_proto.string_val[0].decode()
    assert "b1" in step2 and "b2" in step2
    values = [e.value for e in acc.Scalars("rollout/reward_mean")]
    assert values[0] == 0.5 and math.isnan(values[1])


def test_tb_dir_of_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_rows(a, [{"scope": "rollout", "step": 1, "reward_mean": 1.0}])
    write_rows(b, [{"scope": "rollout", "step": 1, "reward_mean": 2.0}])
    follow(a, tmp_path / "tb", once=True)
    with pytest.raises(ConfigError, match="already holds the conversion of .*a.jsonl.*pick another --tb_dir"):
        follow(b, tmp_path / "tb", once=True)


def test_bad_arguments_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match="--interval must be > 0"):
        follow(tmp_path, tmp_path / "tb", interval=0)
    with pytest.raises(ConfigError, match="--log_dir: no training log found"):
        follow(tmp_path / "missing-run", tmp_path / "tb", once=True)
