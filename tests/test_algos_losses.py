"""Loss aggregation, the clipped policy loss (low/high clip, dual clip), the clipped value loss and entropy,
checked against values worked out by hand from the definitions in REFERENCES.md."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    clipped_policy_loss,
    entropy_from_log_probs,
    entropy_from_logits,
    get_policy_loss,
    global_agg_denominators,
    value_loss,
)
from verl.errors import ConfigError

F64 = torch.float64

# Two sequences: lengths 2 and 3. The padding entry holds 1000 so any leak is obvious.
LOSS = torch.tensor([[1.0, 2.0, 1000.0], [4.0, 5.0, 6.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)


# ----------------------------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),  # 3.6
        ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),  # 9
        ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),  # 3.25
        # verl: sum of all valid token losses / response-length axis (3); no mean over sequences.
        ("seq-mean-token-sum-norm", (1 + 2 + 4 + 5 + 6) / 3),  # 6
    ],
)
def test_agg_loss_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, abs=1e-12)


def test_seq_mean_token_sum_norm_uses_the_given_max_length():
    # Dr.GRPO divides the batch's token-loss sum by one constant (the max response length), not by lengths.
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(
        (3 + 15) / 5, abs=1e-12
    )


# A third row with no valid token (a response cut to nothing): verl leaves it out of the sequence count.
LOSS_EMPTY = torch.cat([LOSS, torch.tensor([[7.0, 8.0, 9.0]], dtype=F64)])
MASK_EMPTY = torch.cat([MASK, torch.zeros(1, 3, dtype=F64)])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),
        ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),  # 2 sequences count, not 3
        ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 4 + 5 + 6) / 3),
    ],
)
def test_rows_without_valid_tokens_are_left_out_of_the_sequence_count(mode, expected):
    assert agg_loss(LOSS_EMPTY, MASK_EMPTY, mode).item() == pytest.approx(expected, abs=1e-12)
    # ... and the global denominators a mini-batch hands its micro-batches count the same way.
    denominators = global_agg_denominators(MASK_EMPTY)
    assert denominators == {"num_tokens": 5.0, "num_seqs": 2.0, "norm_length": 3.0}
    parts = [agg_loss(LOSS_EMPTY[a:b], MASK_EMPTY[a:b], mode, **denominators) for a, b in ((0, 1), (1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(expected, abs=1e-12)


def test_unknown_agg_mode_is_rejected():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "token-sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_the_mini_batch_loss(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 4, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]],
                        dtype=F64)
    whole = agg_loss(loss, mask, mode)
    parts = [
        agg_loss(loss[a:b], mask[a:b], mode, **global_agg_denominators(mask))
        for a, b in ((0, 2), (2, 3), (3, 6))  # uneven micro-batches, one with a single short row
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-12)


def test_micro_batch_overrides_are_needed_for_token_mean():
    # Without the global token count, per-micro-batch token means do not add up to the mini-batch mean.
    a = agg_loss(LOSS[:1], MASK[:1], "token-mean") / 2
    b = agg_loss(LOSS[1:], MASK[1:], "token-mean") / 2
    assert (a + b).item() == pytest.approx((1.5 + 5.0) / 2)
    assert (a + b).item() != pytest.approx(3.6)


# ----------------------------------------------------------------------------------------------- policy loss

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


def one_token_loss(advantage: float, ratio: float):
    log_prob = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    loss, metrics = clipped_policy_loss(
        log_prob=log_prob,
        old_log_prob=torch.zeros(1, 1, dtype=F64),
        advantages=torch.tensor([[advantage]], dtype=F64),
        mask=torch.ones(1, 1, dtype=F64),
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        clip_c=CLIP_C,
    )
    loss.backward()
    return loss.item(), {k: v.item() for k, v in metrics.items()}, log_prob.grad.item()


# (A, ratio, loss by hand, clipfrac, clipfrac_lower, gradient flows?)
POLICY_CASES = [
    # A > 0, ratio inside [0.8, 1.28]: -A*r.
    (1.0, 1.1, -1.1, 0.0, 0.0, True),
    # A > 0, ratio 1.25: inside the DAPO high clip 1.28 (a symmetric 0.2 would clip it to 1.2).
    (1.0, 1.25, -1.25, 0.0, 0.0, True),
    # A > 0, ratio above 1 + high: max(-1.5, -1.28) = -1.28; clipped, no gradient.
    (1.0, 1.5, -1.28, 1.0, 0.0, False),
    (2.0, 10.0, -2.56, 1.0, 0.0, False),
    # A > 0, ratio below 1 - low: max(-0.5, -0.8) = -0.5; the unclipped term wins.
    (1.0, 0.5, -0.5, 0.0, 0.0, True),
    # A < 0, ratio inside: -A*r.
    (-1.0, 0.9, 0.9, 0.0, 0.0, True),
    # A < 0, ratio below 1 - low: max(0.5, 0.8) = 0.8; clipped, no gradient.
    (-1.0, 0.5, 0.8, 1.0, 0.0, False),
    (-1.0, 0.75, 0.8, 1.0, 0.0, False),
    # A < 0, ratio above 1 + high but below c: max(1.5, 1.28) = 1.5; min(1.5, 3) = 1.5.
    (-1.0, 1.5, 1.5, 0.0, 0.0, True),
    # A < 0, ratio 5 > c = 3: max(5, 1.28) = 5, dual clip bounds it by -A*c = 3.
    (-1.0, 5.0, 3.0, 0.0, 1.0, False),
    (-0.5, 8.0, 1.5, 0.0, 1.0, False),
]


@pytest.mark.parametrize(("adv", "ratio", "loss", "clipfrac", "clipfrac_lower", "grad"), POLICY_CASES)
def test_clipped_policy_loss_one_token_cases(adv, ratio, loss, clipfrac, clipfrac_lower, grad):
    value, metrics, dlogp = one_token_loss(adv, ratio)
    assert value == pytest.approx(loss, abs=1e-12)
    assert metrics["clipfrac"] == clipfrac
    assert metrics["clipfrac_lower"] == clipfrac_lower
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio), abs=1e-12)  # mean of old_logp - logp
    # d(-A*r)/dlogp = -A*r where the unclipped term is active, 0 where a clip is.
    assert dlogp == (pytest.approx(-adv * ratio, abs=1e-12) if grad else 0.0)


def test_clipped_policy_loss_batch_masks_and_aggregates():
    ratios = torch.tensor([[1.1, 1.5, 99.0], [0.5, 5.0, 1.0]], dtype=F64)  # 99 sits on padding
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    loss, metrics = clipped_policy_loss(
        log_prob=ratios.log(), old_log_prob=torch.zeros_like(ratios), advantages=advantages, mask=mask,
        clip_low=0.2, clip_high=0.2, clip_c=3.0, loss_agg_mode="token-mean",
    )
    # Per valid token: -1.1, max(-1.5,-1.2) = -1.2, max(0.5,0.8) = 0.8, min(max(5,1.2),3) = 3, 1.0.
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 3.0 + 1.0) / 5, abs=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)  # tokens 2 and 3
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 5)  # token 4 (dual clip)
    expected_kl = -(math.log(1.1) + math.log(1.5) + math.log(0.5) + math.log(5.0) + 0.0) / 5
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl, abs=1e-12)

    seq_sum, _ = clipped_policy_loss(
        log_prob=ratios.log(), old_log_prob=torch.zeros_like(ratios), advantages=advantages, mask=mask,
        loss_agg_mode="seq-mean-token-sum",
    )
    assert seq_sum.item() == pytest.approx(((-1.1 - 1.2) + (0.8 + 3.0 + 1.0)) / 2, abs=1e-12)


def test_policy_loss_registry():
    assert POLICY_LOSSES["vanilla"] is clipped_policy_loss
    assert get_policy_loss("vanilla") is clipped_policy_loss
    with pytest.raises(ConfigError, match="actor.policy_loss='nope'.*vanilla"):
        get_policy_loss("nope")


# ----------------------------------------------------------------------------------------------- value loss


def test_value_loss_clipping_by_hand():
    vpreds = torch.tensor([[0.3], [2.0], [2.0], [-1.0]], dtype=F64)
    old = torch.tensor([[0.0], [0.0], [0.0], [1.0]], dtype=F64)
    returns = torch.tensor([[1.0], [1.0], [3.0], [-1.0]], dtype=F64)
    mask = torch.ones(4, 1, dtype=F64)
    loss, clipfrac = value_loss(vpreds, old, returns, mask, cliprange_value=0.5)
    # clip(V, old±0.5): 0.3, 0.5, 0.5, 0.5
    # unclipped (V-R)^2:   0.49, 1.0, 1.0,  0.0
    # clipped (Vc-R)^2:    0.49, 0.25, 6.25, 2.25
    # max:                 0.49, 1.0, 6.25, 2.25 -> 0.5 * mean = 0.5 * 9.99 / 4
    assert loss.item() == pytest.approx(0.5 * 9.99 / 4, abs=1e-12)
    assert clipfrac.item() == pytest.approx(0.5)


def test_value_loss_ignores_padding():
    vpreds = torch.tensor([[1.0, 50.0]], dtype=F64)
    old = torch.tensor([[1.0, 0.0]], dtype=F64)
    returns = torch.tensor([[3.0, -50.0]], dtype=F64)
    mask = torch.tensor([[1, 0]], dtype=F64)
    loss, clipfrac = value_loss(vpreds, old, returns, mask, cliprange_value=0.5)
    # Only token 0: unclipped (1-3)^2 = 4, clipped (1-3)^2 = 4 -> 0.5 * 4.
    assert loss.item() == pytest.approx(2.0, abs=1e-12)
    assert clipfrac.item() == 0.0


# ----------------------------------------------------------------------------------------------- entropy


def test_entropy_of_known_distributions():
    probs = [0.5, 0.25, 0.25]
    logits = torch.tensor([[math.log(p) + 3.0 for p in probs],  # shift-invariant
                           [0.0, 0.0, 0.0]], dtype=F64)
    ent = entropy_from_logits(logits)
    # -sum p ln p = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2; uniform over 3 = ln 3.
    torch.testing.assert_close(ent, torch.tensor([1.5 * math.log(2), math.log(3)], dtype=F64), atol=1e-12, rtol=0)


def test_entropy_matches_a_hand_loop_on_random_logits_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=F64) * 4
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            row = logits[i, j].tolist()
            top = max(row)
            weights = [math.exp(x - top) for x in row]
            total = sum(weights)
            by_hand = -sum((w / total) * math.log(w / total) for w in weights)
            assert ent[i, j].item() == pytest.approx(by_hand, abs=1e-10)


def test_entropy_is_stable_for_peaked_logits():
    ent = entropy_from_logits(torch.tensor([[1000.0, 0.0, 0.0]]))
    assert torch.isfinite(ent).all() and ent.item() == pytest.approx(0.0, abs=1e-6)
    from_log_probs = entropy_from_log_probs(torch.log_softmax(torch.tensor([[1000.0, 0.0, 0.0]]), -1))
    assert torch.isfinite(from_log_probs).all() and from_log_probs.item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_from_log_probs_equals_entropy_from_logits():
    """The trainer's path (entropy from the log-softmax it already has) against the definition above."""
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(1), dtype=F64) * 5
    torch.testing.assert_close(entropy_from_log_probs(torch.log_softmax(logits, -1)), entropy_from_logits(logits),
                               atol=1e-12, rtol=0)
    probs = [0.5, 0.25, 0.25]
    log_probs = torch.tensor([[math.log(p) for p in probs]], dtype=F64)
    assert entropy_from_log_probs(log_probs).item() == pytest.approx(1.5 * math.log(2), abs=1e-12)



def test_a_loss_ported_with_verls_argument_order_gets_the_current_policy_as_log_prob(tmp_path):
    """verl's losses take ``(old_log_prob, log_prob, ...)``. A real actor update with such a loss registered: the
    tensor that reaches its ``log_prob`` parameter is the current policy's (it carries the gradient), so the ratio
    exp(log_prob - old_log_prob) is not inverted as a positional call would make it."""
    from verl.algos.losses import POLICY_LOSSES, register_policy_loss
    from verl.config import load_config
    from verl.trainer.factory import build_trainer

    seen = []

    @register_policy_loss("test_verl_order")
    def verl_order(old_log_prob, log_prob, advantages, mask, **_):
        seen.append((log_prob.requires_grad, old_log_prob.requires_grad))
        return -(advantages.detach() * torch.exp(log_prob - old_log_prob) * mask).sum() / mask.sum(), {}

    try:
        cfg = load_config(None, ["actor.policy_loss=test_verl_order", "trainer.total_steps=1",
                                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2",
                                 "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                                 f"trainer.output_dir={tmp_path}", "trainer.num_threads=1"])
        trainer = build_trainer(cfg, quiet=True)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
        assert seen and all(current and not old for current, old in seen)
    finally:
        POLICY_LOSSES.pop("test_verl_order")


def test_bypass_mode_is_a_policy_loss_with_the_common_call():
    """verl registers bypass mode as a policy loss: -A * w * log pi_theta with w = pi_theta / pi_rollout (detached,
    truncated at the threshold), pi_rollout arriving as old_log_prob; the clip options of the common call are
    accepted and do not apply. By hand: w = (exp(0.5), exp(-0.5)), token-mean of (1.6487 * 1, 0.6065 * 2) = 1.4309."""
    from verl.algos.losses import POLICY_LOSSES

    log_prob = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.5]], dtype=F64)
    loss, metrics = POLICY_LOSSES["bypass_mode"](
        log_prob=log_prob, old_log_prob=old, advantages=torch.ones(1, 2, dtype=F64), mask=torch.ones(1, 2, dtype=F64),
        rollout_is="token", rollout_is_threshold=2.0, clip_low=0.2, clip_high=0.2, clip_c=3.0, rollout_is_weights=None,
        num_tokens=2.0, num_seqs=1.0, norm_length=2.0)
    assert loss.item() == pytest.approx((math.exp(0.5) * 1.0 + math.exp(-0.5) * 2.0) / 2, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(((-1.5 + 1.0) + (-1.5 + 2.0)) / 2, abs=1e-12)
    assert any(key.startswith("rollout_corr/") for key in metrics)
