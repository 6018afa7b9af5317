"""Checkpoints and resume: exact continuation, SIGKILL mid-run, retention, no partial checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.test_trainer import log_rows, tiny_config
from tests.trainer_utils import TINY, VERL, rows, run_cli
from verl.trainer.checkpoint import list_checkpoints, read_pointer
from verl.trainer.local import LocalPPOTrainer

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it


def _metrics_by_step(trainer, scope, key):
    return {r["step"]: r[key] for r in log_rows(trainer, scope)}


def test_resume_continues_exactly(tmp_path):
    """Steps 3-4 after a resume from step 2 equal steps 3-4 of an uninterrupted run."""
    straight = LocalPPOTrainer(tiny_config(tmp_path / "a", trainer={"total_steps": 4, "save_freq": 2}), quiet=True)
    straight.fit()
    first = LocalPPOTrainer(tiny_config(tmp_path / "b", trainer={"total_steps": 2, "save_freq": 2}), quiet=True)
    first.fit()
    resumed = LocalPPOTrainer(tiny_config(tmp_path / "b", trainer={"total_steps": 4, "save_freq": 2}), quiet=True)
    resumed.fit()
    assert resumed.global_step == 4
    events = [r for r in log_rows(resumed, "train") if r.get("status") == "resumed"]
    assert events and events[0]["step"] == 2 and events[0]["checkpoint"].endswith("global_step_2")
    for scope, key in (("rollout", "reward_mean"), ("rollout", "response_length_mean"), ("ppo", "policy_loss"),
                       ("ppo", "kl_div")):
        a = _metrics_by_step(straight, scope, key)
        b = _metrics_by_step(resumed, scope, key)
        assert sorted(b) == [1, 2, 3, 4]  # the resumed run appends to the same log, numbering continues
        assert [b[s] for s in (3, 4)] == pytest.approx([a[s] for s in (3, 4)], abs=1e-6), (scope, key)


def test_retention_keeps_newest_and_latest(tmp_path):
    trainer = LocalPPOTrainer(
        tiny_config(tmp_path, trainer={"total_steps": 4, "save_freq": 1, "max_ckpt_to_keep": 2}), quiet=True
    )
    trainer.fit()
    assert [step for step, _ in list_checkpoints(trainer.run_dir)] == [3, 4]
    assert read_pointer(trainer.run_dir).name == "global_step_4"


def test_resume_disable_and_explicit_path(tmp_path):
    LocalPPOTrainer(tiny_config(tmp_path, trainer={"total_steps": 2, "save_freq": 1}), quiet=True).fit()
    fresh = LocalPPOTrainer(tiny_config(tmp_path, trainer={"total_steps": 1, "resume": "disable"}), quiet=True)
    fresh.fit()
    assert fresh.global_step == 1
    path = tmp_path / "verl" / "t" / "checkpoints" / "global_step_1"
    explicit = LocalPPOTrainer(tiny_config(tmp_path, trainer={"total_steps": 3, "resume": str(path)}), quiet=True)
    explicit.fit()
    assert explicit.global_step == 3
    from verl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        LocalPPOTrainer(tiny_config(tmp_path, trainer={"resume": str(tmp_path)}), quiet=True).fit()


@pytest.mark.budget(50)
@pytest.mark.slow  # a real process killed mid-run, then the same command again: ~1 minute
def test_sigkill_then_resume_auto(tmp_path):
    """Kill -9 while training; every checkpoint left is complete; the same command continues."""
    args = ["train", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=killed", "trainer.total_steps=200",
            "trainer.save_freq=2", "trainer.test_freq=0", "trainer.val_before_train=false", *TINY[:3]]
    run_dir = tmp_path / "verl" / "killed"
    stderr = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([VERL, *args], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            latest = read_pointer(run_dir)
            if latest is not None and int(latest.name.split("_")[-1]) >= 4:
                break
            if proc.poll() is not None:
                pytest.fail(f"training exited ({proc.returncode}) before it could be killed: "
                            f"{(tmp_path / 'stderr.txt').read_text()[-2000:]}")
            time.sleep(0.1)
        else:
            pytest.fail("no checkpoint appeared")
        time.sleep(0.5)  # kill somewhere inside the following steps (possibly while writing a checkpoint)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    checkpoints = list_checkpoints(run_dir)
    assert checkpoints
    for _, path in checkpoints:
        assert {"model.safetensors", "config.json", "trainer_state.pt", "meta.json", "tokenizer.json"} <= {
            p.name for p in path.iterdir()}, f"partial checkpoint {path}"
    last = read_pointer(run_dir)
    last_step = int(last.name.split("_")[-1])
    logged = [r["step"] for r in rows(run_dir / "verl_logs.jsonl", "rollout")]

    total = last_step + 2
    same_command = [f"trainer.total_steps={total}" if a.startswith("trainer.total_steps") else a for a in args]
    result = run_cli([*same_command, "trainer.resume=auto"])
    assert result.returncode == 0, result.stderr
    after = rows(run_dir / "verl_logs.jsonl")
    resumed = [r for r in after if r["scope"] == "train" and r.get("status") == "resumed"]
    assert resumed[-1]["step"] == last_step
    new_steps = [r["step"] for r in after if r["scope"] == "rollout"][len(logged):]
    assert new_steps == [last_step + 1, last_step + 2]
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "stale temp checkpoint left behind"
    assert json.loads((run_dir / "checkpoints" / f"global_step_{total}" / "meta.json").read_text())["step"] == total
