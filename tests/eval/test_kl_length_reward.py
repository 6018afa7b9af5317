"""KL estimators vs the exact KL, the length and reward evaluators."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.eval.helpers import make_batch
from verl.evaluators.kl import KL, k1_k3
from verl.evaluators.kl_terms import compute_kl_terms, token_kl_terms
from verl.evaluators.length import Length
from verl.evaluators.reward import Reward


def test_k1_k3_reference_vector():
    k1, k3 = k1_k3(torch.tensor([-1.0]), torch.tensor([-2.0]))
    assert k1.item() == pytest.approx(1.0)
    assert k3.item() == pytest.approx(math.exp(-1), abs=1e-5)  # 0.36788


def test_k1_k3_are_unbiased_estimates_of_exact_kl():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(6), torch.randn(6)
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    exact = float((logp.exp() * (logp - logq)).sum())
    terms = token_kl_terms(p_logits.view(1, 1, -1), q_logits.view(1, 1, -1), torch.zeros(1, 1, dtype=torch.long))
    assert terms["token_kl"].item() == pytest.approx(exact, rel=1e-5)
    samples = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    k1, k3 = k1_k3(logp[samples], logq[samples])
    for estimate in (k1, k3):
        se = float(estimate.std()) / math.sqrt(len(samples))
        assert abs(float(estimate.mean()) - exact) < 4 * se
    assert float(k3.std()) < float(k1.std())  # k3's point: lower variance
    assert (k3 >= 0).all()


def test_kl_evaluator_sums_per_response(tiny_base_dir):
    from transformers import AutoModelForCausalLM

    from verl.protocol import DataProto

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1) * mask,
                                "responses": ids[:, 3:], "response_mask": mask[:, 3:]})
    same = compute_kl_terms(model, model, data, micro_batch_size=1)
    assert same["token_kl"].abs().max().item() < 1e-6  # a model against itself
    other = AutoModelForCausalLM.from_pretrained(tiny_base_dir).eval()
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn_like(param))
    terms = compute_kl_terms(model, other, data, micro_batch_size=2)
    assert terms["token_kl"][1, 1].item() == 0.0  # padding position
    batch = make_batch(["ab", "a"], lengths=[2, 1])
    batch.kl_terms = terms
    result = KL().evaluate(batch)
    assert result.per_sample["kl_exact"] == pytest.approx(terms["token_kl"].sum(-1).double().numpy())
    assert result.metrics["kl_exact"].value > 0
    assert result.metrics["kl_exact_per_token"].value == pytest.approx(float(terms["token_kl"].sum()) / 3, rel=1e-5)
    assert not result.notes  # sampled at temperature 1: no caveat


def test_length_percentiles_and_clip_ratio():
    batch = make_batch(["x"] * 5, lengths=[1, 2, 3, 4, 16], max_new_tokens=16)
    m = Length().evaluate(batch).metrics
    assert m["response_length_mean"].value == pytest.approx(5.2)
    assert m["response_length_p50"].value == pytest.approx(3.0)
    assert m["response_length_p90"].value == pytest.approx(np.percentile([1, 2, 3, 4, 16], 90))
    assert m["response_length_clip_ratio"].value == pytest.approx(0.2)
    assert m["response_length_mean"].se == pytest.approx(np.std([1, 2, 3, 4, 16], ddof=1) / math.sqrt(5))


def test_reward_mean_and_missing_rewards():
    from verl.errors import VerlError

    result = Reward().evaluate(make_batch(["a", "b", "c", "d"], rewards=[1, 0, 1, 1]))
    assert result.metrics["reward_mean"].value == pytest.approx(0.75)
    assert result.metrics["reward_mean"].binary
    with pytest.raises(VerlError, match="no rewards"):
        Reward().evaluate(make_batch(["a"]))
