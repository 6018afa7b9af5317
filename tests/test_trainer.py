"""The driver loop and roles in-process: estimators, reward sources, exactness of shortcuts, Python API."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from verl.batch import TrainBatch
from verl.data.dataset import RLHFDataset
from verl.trainer.local import LocalPPOTrainer
from verl.workers.actor import Actor

TINY = {
    "data": {"train_batch_size": 4, "val_max_samples": 8},
    "actor": {"ppo_mini_batch_size": 4},
    "rollout": {"n": 2},
    "trainer": {"total_steps": 1, "test_freq": 0, "val_before_train": False, "save_freq": 0,
                "logger": ["jsonl"], "num_samples_to_log": 1},
}


def tiny_config(tmp_path, **sections) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["trainer"]["output_dir"] = str(tmp_path)
    cfg["trainer"]["experiment_name"] = "t"
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def log_rows(trainer, scope):
    return [r for r in map(json.loads, trainer.config.log_path().read_text().splitlines()) if r["scope"] == scope]


@pytest.mark.parametrize(
    "estimator,extra",
    [
        ("grpo", {}),
        ("grpo", {"norm_adv_by_std_in_grpo": False}),  # Dr.GRPO
        ("rloo", {}),
        ("reinforce_plus_plus", {}),
        ("reinforce_plus_plus_baseline", {}),
        ("remax", {}),
        ("opo", {}),
    ],
)
def test_every_estimator_runs_a_step(tmp_path, estimator, extra):
    actor = {"loss_agg_mode": "seq-mean-token-sum-norm"} if extra else {}
    trainer = LocalPPOTrainer(tiny_config(tmp_path, algorithm={"adv_estimator": estimator, **extra}, actor=actor),
                              quiet=True)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit()
    ppo = log_rows(trainer, "ppo")[0]
    assert torch.isfinite(torch.tensor(ppo["policy_loss"]))
    timing = log_rows(trainer, "timing")[0]
    assert ("gen_baseline" in timing) == (estimator == "remax")
    # The optimizer stepped unless every advantage was zero (all-equal rewards in every group).
    advantages_nonzero = log_rows(trainer, "ppo")[0]["grad_norm"] > 0
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert changed == advantages_nonzero


def update_ready_batch(trainer):
    """A real rollout of 4 prompts with random advantages and reference log-probs: the actor update's input."""
    prompts = trainer.train_dataset.collate([0, 1, 2, 3])
    batch = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
    batch.batch["advantages"] = torch.randn(batch.batch["responses"].shape) * batch.batch["response_mask"]
    batch.batch["ref_log_prob"] = trainer.roles.compute_ref_log_prob(batch)
    return batch


def test_on_policy_shortcut_equals_explicit_old_log_probs(tmp_path):
    """Skipping the old-log-prob forward pass (one epoch, one mini-batch) must not change the update."""
    trainer = LocalPPOTrainer(tiny_config(tmp_path), quiet=True)
    batch = update_ready_batch(trainer)
    explicit = copy.deepcopy(batch)
    explicit.batch["old_log_probs"] = trainer.actor.compute_log_prob(batch)

    model_a = copy.deepcopy(trainer.model)
    model_b = copy.deepcopy(trainer.model)
    cfg = trainer.config
    # Adam's first step is lr * g / (|g| + eps): with the default eps (1e-8) a parameter whose gradient is ~1e-8
    # turns float noise between two equal forward passes into a lr-sized difference (seen on some CPUs). A larger
    # eps keeps the update proportional to the gradient, so equal gradients must give equal parameters.
    actor_cfg = cfg.actor.model_copy(update={"optim": cfg.actor.optim.model_copy(update={"eps": 1e-4})})
    actor_a = Actor(model_a, actor_cfg, 1, 1.0, cfg.data.max_response_length)
    actor_b = Actor(model_b, actor_cfg, 1, 1.0, cfg.data.max_response_length)
    metrics_a = actor_a.update_policy(TrainBatch.from_proto(batch), len(batch))
    metrics_b = actor_b.update_policy(TrainBatch.from_proto(explicit), len(explicit))
    assert metrics_a["policy_loss"] == pytest.approx(metrics_b["policy_loss"], abs=1e-6)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_micro_batches_accumulate_to_the_full_batch_update(tmp_path):
    trainer = LocalPPOTrainer(tiny_config(tmp_path), quiet=True)
    batch = update_ready_batch(trainer)
    cfg = trainer.config
    whole = Actor(copy.deepcopy(trainer.model), cfg.actor, 1, 1.0, cfg.data.max_response_length)
    micro_cfg = cfg.actor.model_copy(update={"ppo_micro_batch_size": 2})
    micro = Actor(copy.deepcopy(trainer.model), micro_cfg, 1, 1.0, cfg.data.max_response_length)
    m_whole = whole.update_policy(TrainBatch.from_proto(batch), len(batch))
    m_micro = micro.update_policy(TrainBatch.from_proto(batch), len(batch))
    assert m_whole["policy_loss"] == pytest.approx(m_micro["policy_loss"], abs=1e-6)
    assert m_whole["grad_norm"] == pytest.approx(m_micro["grad_norm"], rel=1e-4)
    for a, b in zip(whole.model.parameters(), micro.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_python_api_with_config_path_and_dataset(tmp_path, repo_root):
    """The seed's usage: LocalPPOTrainer(config_path=..., train_dataset=RLHFDataset(...)).fit()."""
    from verl.models.loader import load_tokenizer

    config_file = tmp_path / "config.yaml"
    import yaml

    config_file.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    tokenizer = load_tokenizer("builtin:tiny-arith")
    dataset = RLHFDataset(["builtin:arithmetic/val"], tokenizer, {"max_prompt_length": 64})
    trainer = LocalPPOTrainer(config_path=config_file, train_dataset=dataset, quiet=True)
    assert trainer.train_dataset is dataset
    trainer.fit()
    assert trainer.global_step == 1
    assert log_rows(trainer, "rollout")[0]["num_responses"] == 8


def test_custom_reward_function(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return {'score': float(len(solution_str)), 'chars': float(len(solution_str))}\n"
    )
    trainer = LocalPPOTrainer(
        tiny_config(tmp_path, reward={"custom_reward": {"path": str(reward_file), "name": "length_reward"}}),
        quiet=True,
    )
    prompts = trainer.train_dataset.collate([0, 1])
    batch = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
    scores, extras, texts = trainer.roles.compute_reward(batch)
    assert scores.sum(-1).tolist() == [float(len(t)) for t in texts]
    assert extras["chars"].tolist() == [float(len(t)) for t in texts]


@pytest.mark.parametrize("score", ["probability", "logit"])
def test_reward_model_scores_responses(tmp_path, score):
    """A tiny AutoModelForSequenceClassification built here scores whole prompt+response texts: the reward is its
    probability (sigmoid of the logit at the last token) or, on request, the logit; the rule's accuracy is logged
    beside it (the rows have answers)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from verl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rm_config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(rm_config)
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    trainer = LocalPPOTrainer(tiny_config(tmp_path, reward={"model": {"path": str(rm_dir), "score": score}}),
                              quiet=True)
    prompts = trainer.train_dataset.collate([0, 1])
    batch = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
    scores, extras, texts = trainer.roles.compute_reward(batch)
    assert {"rm_score", "acc", "rule_score"} <= set(extras)
    # Independently: score each full text with the RM, read the logit at the last token.
    expected = []
    for prompt, text in zip(batch.non_tensor["raw_prompt"], texts, strict=True):
        ids = tokenizer(prompt + text, return_tensors="pt", add_special_tokens=False)
        expected.append(rm(**ids).logits[0, 0].item())
    expected = torch.tensor(expected)
    if score == "probability":
        expected = torch.sigmoid(expected)
    torch.testing.assert_close(scores.sum(-1), expected, atol=1e-5, rtol=1e-4)
    mask = batch.batch["response_mask"]
    last = mask.sum(-1) - 1
    assert torch.equal(scores.nonzero()[:, 1], last[scores.sum(-1) != 0])


def test_strict_data_checks_pass_through_a_whole_step(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")
    trainer = LocalPPOTrainer(tiny_config(tmp_path), quiet=True)
    trainer.fit()
    assert trainer.global_step == 1


def test_validation_accuracy_is_strict_and_flexible(tmp_path):
    trainer = LocalPPOTrainer(tiny_config(tmp_path, trainer={"val_before_train": True, "test_freq": 1}), quiet=True)
    trainer.fit()
    evals = log_rows(trainer, "eval")
    assert [r["step"] for r in evals] == [0, 1]
    first = evals[0]
    # The warm start answers mostly in the plain format: right numbers, wrong (unrewarded) format.
    assert first["accuracy_flexible"] > 0.6
    assert first["accuracy"] < first["accuracy_flexible"]
