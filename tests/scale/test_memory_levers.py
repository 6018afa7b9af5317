"""Memory levers: gradient checkpointing, bf16 autocast, CPU-offloaded reference, LoRA with no second copy."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_trainer import tiny_config
from verl.trainer.local import LocalPPOTrainer


def first_step(trainer, scope, key):
    rows = map(json.loads, trainer.config.log_path().read_text().splitlines())
    return next(r[key] for r in rows if r["scope"] == scope and r["step"] == 1)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    plain = LocalPPOTrainer(tiny_config(tmp_path / "a"), quiet=True)
    plain.fit()
    ckpt = LocalPPOTrainer(tiny_config(tmp_path / "b", model={"gradient_checkpointing": True}), quiet=True)
    assert ckpt.model.is_gradient_checkpointing
    ckpt.fit()
    for key in ("policy_loss", "grad_norm", "kl_div"):
        assert first_step(ckpt, "ppo", key) == pytest.approx(first_step(plain, "ppo", key), abs=1e-5)
    # Recomputation reorders a few float sums; AdamW's first step (~lr per weight) turns 1e-9 gradient noise into
    # at most ~1e-6 of weight: far below the lr of 1e-4 that every weight moved by.
    for a, b in zip(plain.model.parameters(), ckpt.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_step_is_finite_and_close(tmp_path):
    plain = LocalPPOTrainer(tiny_config(tmp_path / "a"), quiet=True)
    plain.fit()
    bf16 = LocalPPOTrainer(tiny_config(tmp_path / "b", actor={"autocast": "bf16"}), quiet=True)
    bf16.fit()
    loss = first_step(bf16, "ppo", "policy_loss")
    assert loss == loss and abs(loss) < 10  # finite
    # bf16 changes the sampled rollouts a little, so compare what does not depend on them exactly
    assert first_step(bf16, "ppo", "entropy") == pytest.approx(first_step(plain, "ppo", "entropy"), rel=0.3)


def test_reference_offload_and_lora_reference_without_copy(tmp_path):
    offload = LocalPPOTrainer(tiny_config(tmp_path / "a", reference={"offload_to_cpu": True}), quiet=True)
    assert next(offload.reference.model.parameters()).device.type == "cpu"
    assert offload.reference.model is not offload.model
    lora = LocalPPOTrainer(tiny_config(tmp_path / "b", model={"lora": {"rank": 4, "alpha": 8}}), quiet=True)
    assert lora.reference.model is lora.model and lora.reference.adapters_disabled
    trainable = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lora.model.parameters())
    assert 0 < trainable < 0.1 * total
    lora.fit()
    # The reference (adapters off) still gives the base model's log-probs after the adapters trained.
    prompts = lora.train_dataset.collate([0, 1])
    batch = lora.roles.generate(prompts, lora.rollout_stage.train_sampling(5))
    from verl.models.loader import load_causal_lm
    from verl.workers.reference import Reference

    base = Reference(load_causal_lm("builtin:tiny-arith"), temperature=1.0)
    mask = batch.batch["response_mask"]  # packed (the trainer's default) leaves pad positions at 0, padded does not
    torch.testing.assert_close(lora.roles.compute_ref_log_prob(batch) * mask, base.compute_ref_log_prob(batch) * mask,
                               atol=1e-5, rtol=1e-5)
