"""Advantage estimators against values computed by hand from their published definitions.

Every expected number below is written out (or computed by a plain Python loop over floats) from the
definition in REFERENCES.md / the estimator's paper, never by calling the function under test another way.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from verl.algos.advantages import ADV_ESTIMATORS, get_adv_estimator
from verl.errors import ConfigError

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def whiten_by_hand(values: list[float], eps: float = 1e-8) -> list[float]:
    """(x - mean) / sqrt(var + eps) with the Bessel-corrected variance (as verl's masked_whiten)."""
    mean, var = statistics.fmean(values), statistics.variance(values)
    return [(v - mean) / math.sqrt(var + eps) for v in values]


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rewards with each score at the last valid token, and the matching right-padded mask."""
    rewards = torch.zeros(len(scores), width, dtype=F64)
    mask = torch.zeros(len(scores), width, dtype=F64)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


# ----------------------------------------------------------------------------------------------- GAE


def test_gae_three_tokens_by_hand_with_padding_and_whitening():
    gamma, lam = 0.9, 0.8
    # Row 0: three valid tokens. Row 1: two valid tokens, then padding whose reward/value must be ignored.
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    values = t([[0.5, 0.6, 0.7], [1.0, 0.5, 9.9]])
    mask = t([[1, 1, 1], [1, 1, 0]])

    # Row 0: delta_2 = 1 - 0.7 = 0.3; A_2 = 0.3
    #        delta_1 = 0 + 0.9*0.7 - 0.6 = 0.03; A_1 = 0.03 + 0.72*0.3 = 0.246
    #        delta_0 = 0 + 0.9*0.6 - 0.5 = 0.04; A_0 = 0.04 + 0.72*0.246 = 0.21712
    # Row 1: delta_1 = 2 + 0 - 0.5 = 1.5; A_1 = 1.5 (V after the last valid token is 0)
    #        delta_0 = 0 + 0.9*0.5 - 1.0 = -0.55; A_0 = -0.55 + 0.72*1.5 = 0.53
    raw = [0.21712, 0.246, 0.3, 0.53, 1.5]
    expected_returns = t([[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7], [0.53 + 1.0, 1.5 + 0.5, 0.0]])

    adv, ret = get_adv_estimator("gae")(token_level_rewards=rewards, values=values, response_mask=mask,
                                         gamma=gamma, lam=lam)
    torch.testing.assert_close(ret, expected_returns, atol=1e-12, rtol=0)
    w = whiten_by_hand(raw)
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]), atol=1e-9, rtol=0)
    # Whitened over valid tokens: mean 0, (Bessel) std 1 there.
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-9
    assert abs(valid.std().item() - 1.0) < 1e-6


def test_gae_gamma_lambda_one_is_monte_carlo_return_minus_value():
    rewards = t([[0.5, 0.0, 2.0]])
    values = t([[1.0, 3.0, -1.0]])
    mask = t([[1, 1, 1]])
    _, ret = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t, so returns = reward-to-go.
    torch.testing.assert_close(ret, t([[2.5, 2.0, 2.0]]), atol=1e-12, rtol=0)


def test_gae_skips_masked_tokens_inside_the_response():
    # An observation token (mask 0) in the middle: its reward and value are skipped, V_{t+1} is the next valid one.
    rewards = t([[0.0, 5.0, 1.0], [0.0, 0.0, 1.0]])
    values = t([[0.5, 100.0, 0.7], [0.2, 0.3, 0.4]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    _, ret = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8)
    # Row 0: A_2 = 1 - 0.7 = 0.3; A_0 = (0.9*0.7 - 0.5) + 0.72*0.3 = 0.13 + 0.216 = 0.346
    assert ret[0, 1].item() == 0.0
    assert ret[0, 2].item() == pytest.approx(0.3 + 0.7, abs=1e-12)
    assert ret[0, 0].item() == pytest.approx(0.346 + 0.5, abs=1e-12)


def gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """The textbook recursion on one unpadded sequence, in plain floats."""
    adv, next_adv, next_v = [0.0] * len(rewards), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        delta = rewards[i] + gamma * next_v - values[i]
        next_adv = delta + gamma * lam * next_adv
        next_v = values[i]
        adv[i] = next_adv
    return adv


def test_gae_agrees_with_a_per_sequence_loop_on_random_padded_batches():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 6, 2]
    width = 6
    rewards = torch.randn(len(lengths), width, generator=gen, dtype=F64)
    values = torch.randn(len(lengths), width, generator=gen, dtype=F64)
    mask = torch.zeros(len(lengths), width, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv, ret = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.95,
                                     lam=0.9)
    raw_all = []
    for i, n in enumerate(lengths):
        raw = gae_loop(rewards[i, :n].tolist(), values[i, :n].tolist(), 0.95, 0.9)
        raw_all += raw
        expected = [a + v for a, v in zip(raw, values[i, :n].tolist(), strict=True)]
        torch.testing.assert_close(ret[i, :n], t(expected), atol=1e-10, rtol=0)
    w = iter(whiten_by_hand(raw_all))
    for i, n in enumerate(lengths):
        torch.testing.assert_close(adv[i, :n], t([next(w) for _ in range(n)]), atol=1e-8, rtol=0)


# ----------------------------------------------------------------------------------------------- GRPO family


# Group "a" has four responses, "b" one, "c" two; lengths differ so the score sits at different positions.
SCORES = [1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 0.0]
LENGTHS = [2, 3, 1, 3, 2, 3, 1]
INDEX = np.array(["a", "a", "a", "a", "b", "c", "c"], dtype=object)


def test_grpo_by_hand_bessel_std_and_group_of_one():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, width=3)
    adv, ret = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    eps = 1e-6
    # a: mean 0.75; deviations .25 -.75 .25 .25 -> sum sq 0.75 / (4-1) = 0.25 -> std 0.5 (Bessel, not 0.433)
    # b: a group of one has mean 0, std 1.
    # c: mean 1; sum sq 2 / 1 -> std sqrt(2).
    expected = [0.25 / (0.5 + eps), -0.75 / (0.5 + eps), 0.25 / (0.5 + eps), 0.25 / (0.5 + eps),
                0.5 / (1.0 + eps), 1.0 / (math.sqrt(2) + eps), -1.0 / (math.sqrt(2) + eps)]
    for i, (value, n) in enumerate(zip(expected, LENGTHS, strict=True)):
        torch.testing.assert_close(adv[i, :n], torch.full((n,), value, dtype=F64), atol=1e-12, rtol=0)
        assert torch.all(adv[i, n:] == 0)
    torch.testing.assert_close(ret, adv)


def test_dr_grpo_has_no_std_division():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, width=3)
    adv, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=rewards, response_mask=mask, index=INDEX,
                                    norm_adv_by_std_in_grpo=False)
    expected = [0.25, -0.75, 0.25, 0.25, 0.5, 1.0, -1.0]
    torch.testing.assert_close(adv[:, 0], t(expected), atol=1e-12, rtol=0)


def test_grpo_identical_scores_give_zero_advantage():
    rewards, mask = outcome_rewards([1.0, 1.0, 1.0], [1, 2, 3], width=3)
    adv, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=rewards, response_mask=mask, index=[7, 7, 7])
    assert torch.all(adv == 0)


def grpo_vectorised(scores: torch.Tensor, index: list[int], eps: float = 1e-6) -> torch.Tensor:
    """An independent vectorised GRPO: group sums by scatter_add, Bessel std, groups of one -> mean 0 std 1."""
    ids = torch.as_tensor(index)
    groups = int(ids.max()) + 1
    count = torch.zeros(groups, dtype=F64).scatter_add_(0, ids, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=F64).scatter_add_(0, ids, scores)
    mean = total / count
    sq = torch.zeros(groups, dtype=F64).scatter_add_(0, ids, (scores - mean[ids]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count[ids] == 1
    mean_i = torch.where(single, torch.zeros_like(scores), mean[ids])
    std_i = torch.where(single, torch.ones_like(scores), std[ids])
    return (scores - mean_i) / (std_i + eps)


def test_grpo_loop_matches_a_vectorised_implementation():
    gen = torch.Generator().manual_seed(1)
    index = torch.randint(0, 6, (40,), generator=gen).tolist()
    scores = torch.randn(40, generator=gen, dtype=F64)
    lengths = torch.randint(1, 5, (40,), generator=gen).tolist()
    rewards, mask = outcome_rewards(scores.tolist(), lengths, width=4)
    adv, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=rewards, response_mask=mask, index=index)
    expected = grpo_vectorised(scores, index).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, expected, atol=1e-10, rtol=0)


def test_rloo_leave_one_out_by_hand():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, width=3)
    adv, _ = get_adv_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    # a: [1,0,1,1]: 1 - mean(0,1,1) = 1/3; 0 - mean(1,1,1) = -1.  b: alone, no baseline.  c: 2 - 0, 0 - 2.
    expected = [1 / 3, -1.0, 1 / 3, 1 / 3, 0.5, 2.0, -2.0]
    torch.testing.assert_close(adv[:, 0], t(expected), atol=1e-12, rtol=0)
    for i, n in enumerate(LENGTHS):
        assert torch.all(adv[i, n:] == 0)


def test_rloo_equals_n_over_n_minus_one_times_centred_score():
    # verl's vectorised form: A_i = n/(n-1) * (r_i - mean(group)); check it on random groups of equal size.
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(12, generator=gen, dtype=F64)
    index = [i // 4 for i in range(12)]
    rewards, mask = outcome_rewards(scores.tolist(), [2] * 12, width=2)
    adv, _ = ADV_ESTIMATORS["rloo"](token_level_rewards=rewards, response_mask=mask, index=index)
    group_mean = scores.view(3, 4).mean(-1).repeat_interleave(4)
    torch.testing.assert_close(adv[:, 0], 4 / 3 * (scores - group_mean), atol=1e-12, rtol=0)


def test_reinforce_plus_plus_discounted_return_then_whitening():
    rewards = t([[0.0, 1.0, 2.0], [3.0, 1.0, 7.0]])  # 7.0 sits on padding and must not leak back
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    # Row 0: G_2 = 2; G_1 = 1 + 0.5*2 = 2; G_0 = 0 + 0.5*2 = 1.   Row 1: G_1 = 1; G_0 = 3 + 0.5*1 = 3.5.
    torch.testing.assert_close(ret, t([[1.0, 2.0, 2.0], [3.5, 1.0, 0.0]]), atol=1e-12, rtol=0)
    w = whiten_by_hand([1.0, 2.0, 2.0, 3.5, 1.0])
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]), atol=1e-9, rtol=0)


def test_reinforce_plus_plus_baseline_group_mean_then_token_whitening():
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0], [2, 3, 1], width=3)
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=["p", "p", "q"]
    )
    # Group p: mean 0.5 -> +0.5 on 2 tokens, -0.5 on 3 tokens; group q alone -> baseline 0 -> 3.0 on 1 token.
    # Then whitened over all six valid tokens.
    w = whiten_by_hand([0.5, 0.5, -0.5, -0.5, -0.5, 3.0])
    expected = t([[w[0], w[1], 0.0], [w[2], w[3], w[4]], [w[5], 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)


def test_remax_reward_to_go_minus_greedy_baseline():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    baselines = t([0.4, 1.5])
    adv, ret = get_adv_estimator("remax")(token_level_rewards=rewards, response_mask=mask,
                                          reward_baselines=baselines)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, t([[0.6, 0.6, 0.6], [0.5, 0.5, 0.0]]), atol=1e-12, rtol=0)


def test_opo_length_weighted_baseline():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 0.8], [2, 4, 1, 3], width=4)
    adv, _ = get_adv_estimator("opo")(token_level_rewards=rewards, response_mask=mask, index=[0, 0, 0, 1])
    # Group 0 baseline = (2*1 + 4*0 + 1*1) / (2+4+1) = 3/7; group 1 alone -> baseline 0.
    expected = [1 - 3 / 7, -3 / 7, 1 - 3 / 7, 0.8]
    for i, (value, n) in enumerate(zip(expected, [2, 4, 1, 3], strict=True)):
        torch.testing.assert_close(adv[i, :n], torch.full((n,), value, dtype=F64), atol=1e-12, rtol=0)
        assert torch.all(adv[i, n:] == 0)


# ----------------------------------------------------------------------------------------------- all estimators


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_is_zero_outside_the_response_mask(name):
    gen = torch.Generator().manual_seed(3)
    batch, width = 8, 5
    lengths = [5, 1, 3, 4, 2, 5, 3, 1]
    mask = torch.zeros(batch, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    # Garbage everywhere, padding included: nothing outside the mask may survive.
    kwargs = dict(
        token_level_rewards=torch.randn(batch, width, generator=gen),
        values=torch.randn(batch, width, generator=gen),
        response_mask=mask,
        index=[i // 2 for i in range(batch)],
        reward_baselines=torch.randn(batch, generator=gen),
        gamma=0.9,
        lam=0.95,
    )
    adv, ret = ADV_ESTIMATORS[name](**kwargs)
    assert adv.shape == ret.shape == (batch, width)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[mask == 1].abs().sum() > 0


def test_the_issue_s_estimators_are_registered():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
            "opo"} <= set(ADV_ESTIMATORS)


def test_unknown_estimator_is_a_config_error_listing_the_names():
    with pytest.raises(ConfigError) as err:
        get_adv_estimator("grpoo")
    assert "algorithm.adv_estimator='grpoo'" in str(err.value)
    assert "grpo" in str(err.value) and "rloo" in str(err.value)


def test_registrations_carry_the_facts_validation_reads():
    from verl.algos.advantages import ADV_ESTIMATORS, estimator_facts

    groups = {name for name in ADV_ESTIMATORS if estimator_facts(name).needs_groups}
    assert groups == {"grpo", "rloo", "reinforce_plus_plus_baseline", "opo"}
    assert {n for n in ADV_ESTIMATORS if estimator_facts(n).needs_critic} == {"gae"}
    assert {n for n in ADV_ESTIMATORS if estimator_facts(n).needs_greedy_baseline} == {"remax"}


@pytest.mark.parametrize("name", ["opo", "reinforce_plus_plus_baseline", "grpo"])
def test_group_estimators_refuse_one_sample_per_prompt(name):
    from verl.config import load_config
    from verl.errors import ConfigError

    with pytest.raises(ConfigError, match=f"adv_estimator={name} compares responses .* rollout.n >= 2"):
        load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=1"])


def test_a_new_estimator_gets_the_checks_from_its_registration():
    from verl.algos.advantages import ADV_ESTIMATORS, ESTIMATOR_FACTS, register_adv_est
    from verl.config import load_config
    from verl.errors import ConfigError

    @register_adv_est("test_critic_based", needs_critic=True)
    def critic_based(token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    try:
        assert load_config(None, ["algorithm.adv_estimator=test_critic_based"]).use_critic
        with pytest.raises(ValueError, match="advantage estimator 'grpo' is defined twice"):
            register_adv_est("grpo")(critic_based)  # another function under a built-in name
        register_adv_est("test_critic_based", needs_critic=True)(critic_based)  # the same one again: fine
        with pytest.raises(ConfigError, match="'no_such_estimator' is unknown"):
            load_config(None, ["algorithm.adv_estimator=no_such_estimator"])
    finally:
        ADV_ESTIMATORS.pop("test_critic_based"), ESTIMATOR_FACTS.pop("test_critic_based")
