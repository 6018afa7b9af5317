"""RL algorithm pieces as pure tensor functions: advantages, policy/value losses, KL, aggregation.

Only torch is imported here; registries let a user add an estimator or a loss without editing the trainer.
"""

from verl.algos.advantages import ADV_ESTIMATORS, get_adv_estimator, register_adv_est
from verl.algos.kl import AdaptiveKLController, FixedKLController, build_kl_controller, kl_penalty
from verl.algos.losses import (
    POLICY_LOSSES,
    agg_loss,
    clipped_policy_loss,
    entropy_from_log_probs,
    entropy_from_logits,
    get_policy_loss,
    register_policy_loss,
    value_loss,
)
from verl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = ["ADV_ESTIMATORS", "POLICY_LOSSES", "AdaptiveKLController", "FixedKLController", "agg_loss",
           "build_kl_controller", "clipped_policy_loss", "entropy_from_log_probs", "entropy_from_logits",
           "get_adv_estimator", "get_policy_loss", "kl_penalty", "masked_mean", "masked_sum", "masked_var",
           "masked_whiten", "register_adv_est", "register_policy_loss", "value_loss"]
