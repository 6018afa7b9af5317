"""FSDP2 in one process (world size 1): the same numbers as the plain module; checkpoints gather to one HF dir."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.test_trainer import tiny_config
from tests.trainer_utils import fit_and_shutdown as run
from tests.trainer_utils import rows_by_step
from verl.trainer.checkpoint import read_pointer
from verl.trainer.local import LocalPPOTrainer


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
            assert rows_by_step(sharded.run_dir, scope)[step][key] == pytest.approx(
                rows_by_step(plain.run_dir, scope)[step][key], abs=1e-5)
    resumed = LocalPPOTrainer(tiny_config(tmp_path / "fsdp", actor={"strategy": "fsdp"},
                                          trainer={"total_steps": 3}), quiet=True)
    run(resumed)
    assert resumed.global_step == 3
    assert (read_pointer(resumed.run_dir) / "model.safetensors").is_file()
