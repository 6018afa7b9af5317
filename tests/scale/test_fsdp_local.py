"""FSDP2 in one process (world size 1): the same numbers as the plain module; checkpoints gather to one HF dir."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.test_trainer import tiny_config
from verl.trainer.checkpoint import read_pointer
from verl.trainer.local import LocalPPOTrainer


def rows(trainer, scope):
    lines = trainer.config.log_path().read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["scope"] == scope}


def run(trainer):
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_single_process_fsdp_matches_plain_and_resumes(tmp_path):
    plain = LocalPPOTrainer(tiny_config(tmp_path / "plain", trainer={"total_steps": 2}), quiet=True)
    run(plain)
    sharded = LocalPPOTrainer(tiny_config(tmp_path / "fsdp", actor={"strategy": "fsdp"},
                                          trainer={"total_steps": 2, "save_freq": 1}), quiet=True)
    assert type(sharded.model).__name__.startswith("FSDP")
    run(sharded)
    assert not dist.is_initialized()  # shutdown leaves no process group behind
    for step in (1, 2):
        for scope, key in (("rollout", "reward_mean"), ("ppo", "policy_loss"), ("ppo", "kl_div")):
            assert rows(sharded, scope)[step][key] == pytest.approx(rows(plain, scope)[step][key], abs=1e-5)
    resumed = LocalPPOTrainer(tiny_config(tmp_path / "fsdp", actor={"strategy": "fsdp"},
                                          trainer={"total_steps": 3}), quiet=True)
    run(resumed)
    assert resumed.global_step == 3
    assert (read_pointer(resumed.run_dir) / "model.safetensors").is_file()
