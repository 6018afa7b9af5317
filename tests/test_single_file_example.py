"""examples/grpo_single_file.py is the trainer's algorithm: fed the trainer's first rollout, its ``grpo_update``
gives the same loss and the same weights after the step as LocalPPOTrainer's first update (to 1e-6), with one
mini-batch (on-policy) and with two (the second step's ratio uses the sampling policy's log-probs)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from verl.config import load_config
from verl.trainer.factory import build_trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_single_file.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_single_file", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_first_update_equals_the_trainers(tmp_path, mini_batches):
    example = load_example()
    # grpo_tiny's algorithm (GRPO, clip 0.2, low_var_kl 0.04, token-mean, lr 1e-4) on a small batch. Adam's eps is
    # raised so its first step is proportional to the gradient: with eps 1e-8 a gradient entry at float-noise level
    # becomes a full lr-sized step whose sign is noise, on either side.
    cfg = load_config(None, ["trainer.total_steps=1", "data.train_batch_size=4",
                             f"actor.ppo_mini_batch_size={4 // mini_batches}",
                             "rollout.n=4", "trainer.test_freq=0", "trainer.val_before_train=false",
                             "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}", "trainer.num_threads=1",
                             "actor.optim.eps=1e-4"])
    assert (cfg.algorithm.adv_estimator, cfg.actor.kl_loss_type, cfg.actor.loss_agg_mode) == (
        "grpo", "low_var_kl", "token-mean")
    trainer = build_trainer(cfg, quiet=True)
    worker = trainer.worker
    seen = {}
    original_update = worker.update_actor

    def recording_update(batch, mini_batch_size):
        seen["batch"] = {k: v.clone() for k, v in batch.batch.items()}
        seen["before"] = copy.deepcopy(worker.model).eval()
        metrics = original_update(batch, mini_batch_size)
        seen["metrics"] = metrics
        return metrics

    worker.update_actor = recording_update
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    batch, trainer_model = seen["batch"], worker.model

    before = seen["before"]
    model = copy.deepcopy(before)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # step 1: the reference is the starting policy
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.actor.optim.lr, eps=cfg.actor.optim.eps,
                                  weight_decay=cfg.actor.optim.weight_decay)
    scores = batch["token_level_scores"].sum(-1)
    order = None
    if mini_batches > 1:  # the trainer's mini-batch order: whole prompt groups, shuffled by its seeded generator
        from verl.workers.actor import group_shuffle

        order = group_shuffle(len(scores), cfg.rollout.n, torch.Generator().manual_seed(cfg.trainer.seed))
    stats = example.grpo_update(model, reference, optimizer, batch, scores, group_size=cfg.rollout.n,
                                kl_coef=cfg.actor.kl_loss_coef, clip=cfg.actor.clip_ratio,
                                grad_clip=cfg.actor.optim.grad_clip, mini_batches=mini_batches, order=order)

    assert scores.std() > 0  # the step had something to learn from
    # On-policy the ratio is exactly 1; after a first step on this batch the second step's is not.
    assert (stats["ratio_mean"] == 1.0) == (mini_batches == 1)
    assert abs(stats["pg_loss"] - seen["metrics"]["policy_loss"]) < 1e-6
    assert abs(stats["grad_norm"] - seen["metrics"]["grad_norm"]) < 1e-6 * max(1.0, stats["grad_norm"])
    ours, theirs = dict(model.named_parameters()), dict(trainer_model.named_parameters())
    moved = max((theirs[k] - before.get_parameter(k)).abs().max().item() for k in theirs)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"largest weight change {moved:.3g}, largest difference to the trainer {worst:.3g}")
    assert moved > 1e-6 and worst < 1e-6, (moved, worst)


def test_the_example_uses_only_torch_transformers_and_verl_algos():
    import ast

    imported = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    third_party = {m for m in imported if m.split(".")[0] not in {"__future__", "copy", "random", "re", "pathlib"}}
    assert {m.split(".")[0] for m in third_party} <= {"torch", "transformers", "verl"}
    assert all(m.startswith("verl.algos") for m in third_party if m.startswith("verl"))
    assert len(EXAMPLE.read_text().splitlines()) < 250
