"""Rollout/trainer mismatch and verl's rollout correction (verl/algos/rollout_correction.py) against hand-computed
values, the config (presets, verl's and TRL's keys), and the trainer: the metrics in a default run's log, ~0 with
matched numerics and not with a bf16 rollout, decoupled weights and rejection in the update, bypass REINFORCE."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.test_trainer import log_rows, tiny_config
from tests.trainer_utils import fit_and_shutdown, run_cli
from verl.algos.losses import clipped_policy_loss, reinforce_policy_loss
from verl.algos.rollout_correction import MismatchStats, correct, is_weights, mismatch_metrics, rejection_mask
from verl.config import RolloutCorrectionConfig, build_config, load_config
from verl.config_aliases import map_verl_keys
from verl.errors import ConfigError
from verl.trainer.local import LocalPPOTrainer

LN2 = math.log(2.0)
# Two sequences. A: tokens the trainer gives 0.5 and 0.25, the engine 0.25 and 0.25 (log-ratios ln2, 0).
# B: one token, 0.2 by the trainer, 0.4 by the engine (log-ratio -ln2), then padding.
TRAINER = torch.log(torch.tensor([[0.5, 0.25], [0.2, 1.0]]))
ROLLOUT = torch.log(torch.tensor([[0.25, 0.25], [0.4, 1.0]]))
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
LOG_RATIO = TRAINER - ROLLOUT


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAINER, ROLLOUT, MASK)
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-7)  # (-ln2 + 0 + ln2) / 3
    # k3 = r - ln r - 1: (2 - ln2 - 1) + 0 + (0.5 + ln2 - 1) = 0.5 over 3 tokens
    assert m["rollout_corr/k3_kl"] == pytest.approx(0.5 / 3, rel=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx((4 + 1 + 0.25) / 3 - 1, rel=1e-6)  # E[r^2] - 1 = 0.75
    # Per sequence: mean log-probs A: trainer (ln.5 + ln.25)/2, engine ln.25; B: ln.2 and ln.4.
    assert m["rollout_corr/training_ppl"] == pytest.approx((2 * math.sqrt(2) + 5.0) / 2, rel=1e-6)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx((4.0 + 2.5) / 2, rel=1e-6)
    diffs = [-LN2 / 2, LN2]  # log(training ppl / rollout ppl) of A and B
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(diffs) / 2, rel=1e-6)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx((LN2 / 2 + LN2) / 2, rel=1e-6)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(LN2, rel=1e-6)
    assert m["rollout_corr/log_ppl_diff_min"] == pytest.approx(-LN2 / 2, rel=1e-6)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((1 / math.sqrt(2) + 2.0) / 2, rel=1e-6)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-6)  # sequence ratios 2 and 1/2
    # verl's debug metrics: |p_trainer - p_rollout| = 0.25, 0, 0.2.
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.15, rel=1e-6)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25, rel=1e-6)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt((0.0625 + 0.04) / 3 - 0.15**2), rel=1e-5)
    # TRL's names: |log-ratio| and the token ratio.
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(2 * LN2 / 3, rel=1e-6)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(LN2, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(3.5 / 3, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0, rel=1e-6)


def test_identical_log_probs_are_no_mismatch_and_partials_add_up_to_the_whole():
    same = mismatch_metrics(TRAINER, TRAINER, MASK)
    assert same["rollout_corr/k3_kl"] == 0.0 and same["training/rollout_probs_diff_max"] == 0.0
    assert same["rollout_corr/ppl_ratio"] == pytest.approx(1.0)
    parts = MismatchStats()
    for row in range(2):  # one micro-batch per sequence, as the actor adds them
        parts.add(TRAINER[row : row + 1], ROLLOUT[row : row + 1], MASK[row : row + 1])
    whole = mismatch_metrics(TRAINER, ROLLOUT, MASK)
    assert parts.metrics() == pytest.approx(whole)
    assert MismatchStats().metrics() == {}


def test_importance_weights_token_sequence_icepop_and_batch_normalised():
    weights, m = is_weights(LOG_RATIO, MASK, "token", 1.5)  # ratios 2, 1, 0.5: the cap truncates 2 to 1.5
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0], [0.5, 0.0]]))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3) and m["rollout_is_max"] == 1.5
    # Sequence products: A 2 x 1 (over the cap 1.5), B 0.5 (under its reciprocal): one sequence each way.
    seq, m = is_weights(LOG_RATIO, MASK, "sequence", 1.5)
    torch.testing.assert_close(seq, torch.tensor([[1.5, 1.5], [0.5, 0.0]]))
    assert m["rollout_is_ratio_fraction_high"] == 0.5 and m["rollout_is_ratio_fraction_low"] == 0.5
    band, m = is_weights(LOG_RATIO, MASK, "token", "0.6_1.5")  # IcePop: outside [0.6, 1.5] -> 0
    torch.testing.assert_close(band, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 3)
    normalised, m = is_weights(LOG_RATIO, MASK, "token", 3.0, batch_normalize=True)  # 2, 1, 0.5 over mean 7/6
    torch.testing.assert_close(normalised, torch.tensor([[12 / 7, 6 / 7], [3 / 7, 0.0]]))
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(3.5 / 3)
    assert not weights.requires_grad


def test_rejection_by_token_and_by_sequence():
    # token_k1 on -log_ratio (verl's sign) within [ln .6, ln 1.5]: -ln2, 0, ln2 -> only the middle token stays.
    kept, m = rejection_mask(LOG_RATIO, MASK, "token_k1", "0.6_1.5")
    torch.testing.assert_close(kept, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 3) and m["rollout_rs_seq_masked_fraction"] == 1.0
    # seq_mean_k3: A's mean k3 = (1 - ln2)/2 = 0.153, B's = ln2 - 0.5 = 0.193: a bound of 0.17 keeps A only.
    kept, m = rejection_mask(LOG_RATIO, MASK, "seq_mean_k3", 0.17)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    # seq_max_k2: k2 = (ln2)^2 / 2 = 0.240 in both sequences; several options must all pass.
    assert rejection_mask(LOG_RATIO, MASK, "seq_max_k2", 0.25)[0].sum() == 3
    kept, _ = rejection_mask(LOG_RATIO, MASK, "seq_max_k2,seq_sum_k1", "0.25,0.9_1.1")  # sums -ln2 and ln2: out
    assert kept.sum() == 0
    weights, kept, m = correct(TRAINER, ROLLOUT, MASK, "token", 1.5, rollout_rs="seq_mean_k3",
                               rollout_rs_threshold=0.17)
    assert weights is not None and kept.sum() == 2 and set(m) >= {"rollout_corr/rollout_is_mean",
                                                                 "rollout_corr/rollout_rs_masked_fraction"}


def test_losses_take_the_weights():
    advantages = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    weights = torch.tensor([[1.5, 1.0], [0.5, 0.0]])
    # On-policy (ratio 1): each token's loss is -A, times its weight: (-1.5 - 1 + 1) / 3 tokens.
    loss, _ = clipped_policy_loss(log_prob=TRAINER, old_log_prob=TRAINER, advantages=advantages, mask=MASK,
                                  rollout_is_weights=weights)
    assert float(loss) == pytest.approx((-1.5 - 1.0 + 1.0) / 3)
    unweighted, _ = clipped_policy_loss(log_prob=TRAINER, old_log_prob=TRAINER, advantages=advantages, mask=MASK)
    assert float(unweighted) == pytest.approx((-1.0 - 1.0 + 2.0) / 3)
    # REINFORCE: -A * w * log pi: -(1.5 ln.5 + ln.25 - 2 * 0.5 * ln.2) / 3; its gradient is -A * w per token.
    log_prob = TRAINER.clone().requires_grad_(True)
    loss, m = reinforce_policy_loss(log_prob=log_prob, rollout_log_prob=ROLLOUT, advantages=advantages, mask=MASK,
                                    rollout_is_weights=weights)
    expected = -(1.5 * math.log(0.5) + math.log(0.25) - 2 * 0.5 * math.log(0.2)) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -advantages * weights * MASK / 3)
    assert float(m["ppo_kl"]) == pytest.approx(0.0, abs=1e-7)


def test_config_presets_verl_and_trl_keys():
    geo = RolloutCorrectionConfig(preset="decoupled_geo_rs")
    assert geo.rollout_rs == "seq_mean_k1" and geo.rollout_rs_threshold == "0.999_1.001" and geo.rollout_is is None
    overridden = RolloutCorrectionConfig(preset="bypass_pg_is", rollout_is_threshold=3.0)
    assert overridden.bypass_mode and overridden.loss_type == "reinforce" and overridden.rollout_is_threshold == 3.0
    assert not RolloutCorrectionConfig().corrects
    with pytest.raises(ConfigError, match="rollout_rs='token_k9': options are token_k1"):
        RolloutCorrectionConfig(rollout_rs="token_k9", rollout_rs_threshold=1.0)
    with pytest.raises(ConfigError, match="rollout_rs_threshold is required"):
        RolloutCorrectionConfig(rollout_rs="token_k1")
    with pytest.raises(ConfigError, match="k2 and k3 options take one positive upper bound"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.5_2")
    with pytest.raises(ValueError, match="loss_type reinforce is bypass mode's loss"):
        RolloutCorrectionConfig(loss_type="reinforce")
    # Rejection in bypass mode (verl's bypass_pg_geo_rs family): bounds on pi_theta / pi_rollout in the update.
    pg_rs = RolloutCorrectionConfig(preset="bypass_pg_geo_rs_token_tis")
    assert pg_rs.bypass_mode and pg_rs.loss_type == "reinforce" and pg_rs.rollout_rs == "seq_mean_k1"
    assert pg_rs.rollout_is == "token" and pg_rs.corrects and not pg_rs.decoupled
    # verl's older names, and TRL's GRPOConfig keys (TRL's defaults: on, sequence_mask, cap 3).
    older = map_verl_keys({"algorithm.rollout_correction.bypass_old_logprob_for_rollout": True,
                           "algorithm.rollout_correction.use_pure_rollout_correction": True})
    assert older == {"algorithm.rollout_correction.bypass_mode": True,
                     "algorithm.rollout_correction.loss_type": "reinforce"}
    trl = map_verl_keys({"vllm_importance_sampling_correction": True})
    assert trl["algorithm.rollout_correction.rollout_is"] == "sequence"
    assert str(trl["algorithm.rollout_correction.rollout_is_threshold"]).endswith("_3")
    truncate = map_verl_keys({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 2})
    assert truncate == {"algorithm.rollout_correction.rollout_is": "token",
                        "algorithm.rollout_correction.rollout_is_threshold": 2.0}
    loaded = load_config(overrides=["algorithm.rollout_correction.preset=decoupled_token_is",
                                    "algorithm.rollout_correction.rollout_is_threshold=1.5"])  # beside the preset
    assert loaded.algorithm.rollout_correction.rollout_is == "token"
    assert loaded.algorithm.rollout_correction.rollout_is_threshold == 1.5


@pytest.mark.e2e
def test_a_default_run_measures_the_mismatch_and_a_bf16_rollout_shows_it(tmp_path):
    matched = LocalPPOTrainer(build_config(tiny_config(tmp_path / "a", trainer={"total_steps": 1, "test_freq": 0})),
                              quiet=True)
    fit_and_shutdown(matched)
    [row] = log_rows(matched, "rollout_corr")
    assert abs(row["k3_kl"]) < 1e-6 and abs(row["kl"]) < 1e-6  # the same weights, the same fp32 numerics
    [probs] = log_rows(matched, "training")
    assert probs["rollout_probs_diff_max"] < 1e-4
    bf16 = LocalPPOTrainer(build_config(tiny_config(tmp_path / "b", trainer={"total_steps": 1, "test_freq": 0},
                                                    rollout={"dtype": "bfloat16"})), quiet=True)
    fit_and_shutdown(bf16)
    [row] = log_rows(bf16, "rollout_corr")
    assert row["k3_kl"] > 1e-6 and log_rows(bf16, "training")[0]["rollout_probs_diff_mean"] > 1e-4
    assert set(log_rows(bf16, "sampling")[0]) >= {"sampling_logp_difference/mean", "importance_sampling_ratio/max"}


@pytest.mark.e2e
def test_decoupled_correction_and_bypass_reinforce_change_the_update(tmp_path):
    steps = {"total_steps": 1, "test_freq": 0}
    rollout = {"dtype": "bfloat16"}
    plain = LocalPPOTrainer(build_config(tiny_config(tmp_path / "p", trainer=steps, rollout=rollout)), quiet=True)
    fit_and_shutdown(plain)
    # Decoupled: pi_old from a trainer forward, token IS weights and a rejection bound tight enough to bite.
    corrected = LocalPPOTrainer(build_config(tiny_config(
        tmp_path / "c", trainer=steps, rollout=rollout,
        algorithm={"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.003,
                                          "rollout_rs": "token_k1", "rollout_rs_threshold": "0.997_1.003"}})),
        quiet=True)
    fit_and_shutdown(corrected)
    [row] = log_rows(corrected, "rollout_corr")
    # bf16 moves a token's probability by up to ~1% here: the bounds of +-0.3% reject some tokens and cap others.
    assert 0.0 < row["rollout_rs_masked_fraction"] < 1.0 and row["rollout_is_max"] == pytest.approx(1.003)
    assert row["k3_kl"] == pytest.approx(log_rows(plain, "rollout_corr")[0]["k3_kl"], rel=1e-4)  # same rollouts
    assert log_rows(corrected, "ppo")[0]["policy_loss"] != pytest.approx(log_rows(plain, "ppo")[0]["policy_loss"])
    bypass = LocalPPOTrainer(build_config(tiny_config(
        tmp_path / "r", trainer=steps, rollout=rollout,
        algorithm={"rollout_correction": {"preset": "bypass_pg_is"}})), quiet=True)
    fit_and_shutdown(bypass)
    [row] = log_rows(bypass, "rollout_corr")
    assert row["rollout_is_mean"] > 0 and row["k3_kl"] > 1e-6
    # Bypass with rejection: the same bound on pi_theta / pi_rollout, applied inside the update's micro-batches.
    rejecting = LocalPPOTrainer(build_config(tiny_config(
        tmp_path / "rs", trainer=steps, rollout=rollout,
        algorithm={"rollout_correction": {"preset": "bypass_pg_is", "rollout_rs": "token_k1",
                                          "rollout_rs_threshold": "0.997_1.003"}})), quiet=True)
    fit_and_shutdown(rejecting)
    [row] = log_rows(rejecting, "rollout_corr")
    assert 0.0 < row["rollout_rs_masked_fraction"] < 1.0 and row["rollout_rs_token_k1_masked_fraction"] > 0
    assert log_rows(rejecting, "ppo")[0]["policy_loss"] != pytest.approx(log_rows(bypass, "ppo")[0]["policy_loss"])


@pytest.mark.e2e
def test_verl_eval_reports_an_engines_mismatch_with_cis(tmp_path):
    """``-e mismatch`` (on request; ``-e`` repeats): the run's engine (a bf16 rollout, rollout.dtype) against the
    trainer's fp32 forward on the same tokens, with CIs over prompts."""
    run = LocalPPOTrainer(build_config(tiny_config(tmp_path / "bf16", trainer={"total_steps": 1, "test_freq": 0,
                                                                               "save_freq": 1},
                                                   rollout={"dtype": "bfloat16"})), quiet=True)
    fit_and_shutdown(run)
    ckpt = run.config.run_dir() / "checkpoints" / "global_step_1"
    done = run_cli(["eval", "--ckpt", str(ckpt), "-e", "mismatch", "-e", "length", "--max-samples", "8", "--n", "2",
                    "--temperature", "1", "--out", str(tmp_path / "ev"), "--quiet"])
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    k3 = results["metrics"]["eval/mismatch_k3_kl"]
    assert k3["value"] > 1e-7 and k3["ci_low"] <= k3["value"] <= k3["ci_high"]
    assert "eval/response_length_mean" in results["metrics"]  # both -e options count
    assert any("trainer's forward (fp32)" in note for note in results["notes"])


def test_group_metrics_by_hand():
    """batch/solve_all, solve_none, same_reward over a step's groups (uid): four groups of two samples."""
    from verl.trainer.step_metrics import group_metrics

    rewards = np.array([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    group = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    acc = np.array([1, 1, 0, 0, 1, 0, 0, 0], dtype=float)
    m = group_metrics(group, rewards, acc)
    assert m == {"same_reward": 0.75, "solve_all": 0.25, "solve_none": 0.5}
    assert group_metrics(group, rewards, None) == {"same_reward": 0.75}


def test_varied_group_rows_keep_what_dapo_keeps():
    """DAPO's filter (algorithm.filter_groups): a group stays when its samples differ in the metric, or holds one."""
    from verl.trainer.stages import filter_values, varied_group_rows

    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2, 0.2, 0.7]).unsqueeze(-1)  # token-level, one token each
    group = np.array([0, 0, 1, 1, 2, 2, 3])
    acc = np.array([1, 1, 0, 1, 0, 0, 1], dtype=float)
    assert filter_values({"acc": acc}, scores, None).tolist() == acc.tolist()  # acc by default
    assert filter_values({"acc": acc}, scores, "score").tolist() == pytest.approx(scores.squeeze(-1).tolist())
    assert filter_values({}, scores, None).tolist() == pytest.approx(scores.squeeze(-1).tolist())  # no acc: reward
    assert varied_group_rows(group, acc).tolist() == [2, 3, 6]
    assert varied_group_rows(group, scores.squeeze(-1).double().numpy()).tolist() == [2, 3, 6]
    with pytest.raises(ConfigError, match="metric=acc: this reward gives no acc"):
        filter_values({}, scores, "acc")


@pytest.mark.e2e
def test_filter_groups_fills_the_batch_with_groups_that_carry_signal(tmp_path):
    """Dynamic sampling on the tiny default: every group the update sees varies in acc, the step says how many
    generation batches it took, and a budget spent is a WARNING row, not a crash."""
    config = build_config(tiny_config(tmp_path, trainer={"total_steps": 2, "test_freq": 0},
                                      data={"train_batch_size": 4, "val_max_samples": 8},
                                      actor={"ppo_mini_batch_size": 4}, rollout={"n": 4},
                                      algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 4}}))
    trainer = LocalPPOTrainer(config, quiet=True)
    seen = []
    real_update = trainer.roles.update_actor

    def spy(batch, mini_batch_size):
        seen.append(batch)
        return real_update(batch, mini_batch_size)

    trainer.roles.update_actor = spy
    fit_and_shutdown(trainer)
    rows = {r["step"]: r for r in log_rows(trainer, "batch")}
    warnings = log_rows(trainer, "filter_groups")
    for step, batch in enumerate(seen, start=1):
        uid = np.asarray(batch.non_tensor["uid"])
        groups = {u: (uid == u).nonzero()[0] for u in set(uid.tolist())}
        acc_varies = [np.ptp(batch.batch["token_level_scores"].sum(-1).numpy()[g]) > 0 for g in groups.values()]
        spent = [w for w in warnings if w["step"] == step]
        assert 1 <= rows[step]["num_gen_batches"] <= 4
        if not spent:  # filled: exactly train_batch_size groups, each with signal
            assert len(groups) == 4 and all(acc_varies)
        else:
            assert rows[step]["num_gen_batches"] == 4 and "max_num_gen_batches" in spent[0]["message"]
    assert len(seen) == 2
