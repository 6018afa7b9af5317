"""Loss aggregation, the clipped policy loss (registry), the clipped value loss and entropy.

Shapes: per-token tensors are ``(batch, response_len)``; ``mask`` is 1 on valid response tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.algos.masked import masked_mean
from verl.algos.rollout_correction import is_weights
from verl.registry import Registry

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", num_tokens: float | None = None,
             num_seqs: float | None = None, norm_length: float | None = None) -> torch.Tensor:
    """Reduce a ``(batch, response_len)`` loss to a scalar, as verl defines each mode.

    - ``token-mean``: sum over all valid tokens / number of valid tokens.
    - ``seq-mean-token-sum``: per-sequence token sum, averaged over sequences that have a valid token.
    - ``seq-mean-token-mean``: per-sequence token mean, averaged over sequences that have a valid token.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): the sum of *all* valid token losses divided by ``norm_length``
      (defaults to the response-length axis, ``mask.shape[-1]``); there is no mean over sequences.

    Rows without a valid token (e.g. a response cut to nothing) are left out of the ``seq-mean-*`` sequence
    count, so they do not dilute the others. ``num_tokens`` / ``num_seqs`` / ``norm_length`` override the
    denominators with the mini-batch's (global) values, so micro-batches of one mini-batch, on any number of
    workers, sum to the mini-batch loss exactly (``global_agg_denominators``).
    """
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    if mode == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else mask.shape[-1]
        return masked.sum() / length
    seqs = num_seqs if num_seqs is not None else valid_sequences(mask).clamp(min=1)
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / seqs
    raise ValueError(f"unknown loss_agg_mode '{mode}'; use one of {LOSS_AGG_MODES}")


def valid_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of a ``(batch, response_len)`` mask with at least one valid token (a 0-dim tensor)."""
    return (mask.sum(-1) > 0).sum()


AGG_DENOMINATORS = ("num_tokens", "num_seqs", "norm_length")  # what global_agg_denominators gives agg_loss


def global_agg_denominators(mask: torch.Tensor, norm_length: float | None = None) -> dict[str, float]:
    """``agg_loss`` denominators of a whole mini-batch ``mask`` ``(batch, response_len)``, to pass to every
    micro-batch: valid tokens, sequences with a valid token, and the fixed length of ``seq-mean-token-sum-norm``
    (the configured max response length, so micro-batches padded to different widths divide alike)."""
    return {"num_tokens": float(mask.sum().clamp(min=1)), "num_seqs": float(valid_sequences(mask).clamp(min=1)),
            "norm_length": float(norm_length if norm_length is not None else mask.shape[-1])}


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", key="actor.policy_loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss. It is called by keyword — ``log_prob``, ``old_log_prob``, ``advantages``, ``mask``
    plus the clip and aggregation options — so a loss ported from verl with its ``(old_log_prob, log_prob, ...)``
    order works unchanged. Registering a name again with another function raises."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name, fn)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")
def clipped_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                        loss_agg_mode: str = "token-mean", rollout_is_weights: torch.Tensor | None = None,
                        **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with separate low/high clip (DAPO clip-higher) and dual clip.

    ratio = exp(logp - old_logp); loss = max(-A*ratio, -A*clip(ratio, 1-low, 1+high)); for A < 0 the loss is
    further bounded by -A*clip_c (dual clip, Ye et al. 2020). ``rollout_is_weights`` (decoupled rollout correction,
    detached) multiply each token's loss before aggregation, as verl applies them. Metrics: ``clipfrac`` (tokens
    where the clipped term is active), ``clipfrac_lower`` (dual clip active), ``ppo_kl`` (mean of old_logp - logp).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_c)
    losses = torch.where(advantages < 0, loss_dual, loss_ppo)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {"clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
               "clipfrac_lower": masked_mean(((loss_ppo > -advantages * clip_c) & (advantages < 0)).float(), mask),
               "ppo_kl": masked_mean(-log_ratio, mask)}
    return agg_loss(losses, mask, loss_agg_mode, **agg_kwargs), metrics


def reinforce_policy_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
                          loss_agg_mode: str = "token-mean",
                          **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's REINFORCE loss (``algorithm.rollout_correction.loss_type: reinforce``): -A * w * log pi_theta
    per token, ``w`` the detached IS weights pi_theta / pi_rollout (1 without them), no clipping; its gradient is the
    importance-weighted policy gradient. Metric ``ppo_kl``: mean of log pi_rollout - log pi_theta."""
    weights = rollout_is_weights if rollout_is_weights is not None else torch.ones_like(log_prob)
    losses = -advantages * weights * log_prob
    return agg_loss(losses, mask, loss_agg_mode, **agg_kwargs), {
        "ppo_kl": masked_mean(rollout_log_prob - log_prob.detach(), mask)}


@register_policy_loss("bypass_mode")
def bypass_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: str | float = 2.0,
                       rollout_is_batch_normalize: bool = False, loss_agg_mode: str = "token-mean",
                       **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's REINFORCE (``algorithm.rollout_correction`` with ``bypass_mode`` and ``loss_type: reinforce``;
    verl registers it as a policy loss too). In bypass mode ``old_log_prob`` is the rollout engine's log-prob of each
    token: the weights w = pi_theta / pi_rollout of these very tokens (detached; ``rollout_is`` sets how, None: 1)
    times -A log pi_theta, no clipping (``reinforce_policy_loss``). The weights' statistics come back as
    ``rollout_corr/*`` metrics; the clip options of the common call do not apply."""
    weights, found = None, {}
    if rollout_is is not None:
        weights, found = is_weights(log_prob.detach() - old_log_prob, mask, rollout_is, rollout_is_threshold,
                                    rollout_is_batch_normalize)
    agg_kwargs = {k: v for k, v in options.items() if k in AGG_DENOMINATORS}
    loss, metrics = reinforce_policy_loss(log_prob=log_prob, rollout_log_prob=old_log_prob, advantages=advantages,
                                          mask=mask, rollout_is_weights=weights, loss_agg_mode=loss_agg_mode,
                                          **agg_kwargs)
    return loss, {**{f"rollout_corr/{k}": torch.tensor(v, dtype=torch.float64) for k, v in found.items()}, **metrics}


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
               **agg_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old +- c) - R)^2)); returns (loss, clipfrac)."""
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, loss_agg_mode, **agg_kwargs)
    return loss, masked_mean((loss_clipped > loss_unclipped).float(), mask)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy per position from normalised log-probabilities ``(..., vocab)`` -> ``(...)``: -sum p log p.

    ``p`` is ``softmax(log_probs)`` (equal to ``exp(log_probs)`` for normalised inputs): on CPU, ``exp`` of the
    very negative log-probs of a large vocabulary takes a slow path (measured 0.5-0.7 s for 16 x 32 x 49,152 when a
    quarter of them underflow), the softmax kernel does not (~0.12 s)."""
    return -(torch.softmax(log_probs, dim=-1) * log_probs).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution per position: ``(..., vocab)`` -> ``(...)``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
