"""Rollout/trainer mismatch: how far the rollout engine's log-probs are from the trainer's, and verl's rollout
correction (``algorithm.rollout_correction``) — truncated importance sampling (token or sequence, or IcePop's band),
rejection sampling by divergence bounds — as pure functions, with verl's names and meanings
(docs/algo/rollout_corr.md and verl/trainer/ppo/rollout_corr_helper.py in verl, read 2026-11-27).

Shapes: per-token tensors are ``(batch, response_len)``; ``mask`` is 1 on valid response tokens. ``trainer`` is
the trainer's log-prob of each drawn token (pi_old in decoupled mode, pi_theta in bypass mode), ``rollout`` the
engine's (the behaviour policy); ``log_ratio = trainer - rollout``, so a ratio above 1 means the trainer finds the
token likelier than the engine that drew it.

The metrics are sums and maxima first (``MismatchStats``), finished once: micro-batches and data-parallel ranks add
their partials, so the logged numbers are the whole batch's, not a mean of means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from verl.algos.masked import masked_mean, masked_sum
from verl.errors import ConfigError

SAFETY_BOUND = 20.0  # log-ratios are clamped to +-20 before exp (verl's bound): weights stay in [2e-9, 5e8]
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


# ---------------------------------------------------------------------------------------------- mismatch metrics


@dataclass
class MismatchStats:
    """Partial sums (and maxima) of the mismatch between ``trainer`` and ``rollout`` log-probs; ``add`` a
    micro-batch, merge ranks with ``sums`` / ``maxima`` (all-reduced by SUM and MAX), then ``metrics()``.

    Token-level means average over valid tokens; sequence-level ones over sequences with a valid token."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def _add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def _max(self, key: str, value: torch.Tensor | float) -> None:
        self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))

    def add(self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        mask = mask.float()
        trainer, rollout = trainer.float(), rollout.float()
        valid = mask.bool()
        log_ratio = trainer - rollout
        safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        tokens = mask.sum()
        if tokens == 0:
            return
        self._add("tokens", tokens)
        self._add("kl", masked_sum(-log_ratio, mask))  # E_rollout[log rollout - log trainer]
        self._add("k3_kl", masked_sum(torch.exp(log_ratio) - log_ratio - 1.0, mask))
        self._add("chi2_token", masked_sum(torch.exp(safe).square(), mask))
        self._add("logp_abs_diff", masked_sum(log_ratio.abs(), mask))
        probs_diff = (torch.exp(trainer) - torch.exp(rollout)).abs()
        self._add("probs_diff", masked_sum(probs_diff, mask))
        self._add("probs_diff_sq", masked_sum(probs_diff.square(), mask))
        ratio = torch.exp(safe)
        self._add("is_ratio", masked_sum(ratio, mask))
        self._max("probs_diff_max", probs_diff[valid].max())
        self._max("logp_abs_diff_max", log_ratio.abs()[valid].max())
        self._max("is_ratio_max", ratio[valid].max())
        self._max("neg_is_ratio_min", -ratio[valid].min())
        # Sequences: mean log-prob of each (its log perplexity, negated), and the sum of its log-ratios.
        rows = mask.sum(-1) > 0
        trainer_mean = masked_mean(trainer, mask, dim=-1)[rows]
        rollout_mean = masked_mean(rollout, mask, dim=-1)[rows]
        log_ppl_diff = rollout_mean - trainer_mean  # log(training ppl / rollout ppl) per sequence
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
        self._add("sequences", rows.sum())
        self._add("training_ppl", torch.exp(-trainer_mean).sum())
        self._add("training_log_ppl", (-trainer_mean).sum())
        self._add("rollout_ppl", torch.exp(-rollout_mean).sum())
        self._add("rollout_log_ppl", (-rollout_mean).sum())
        self._add("log_ppl_diff", log_ppl_diff.sum())
        self._add("log_ppl_abs_diff", log_ppl_diff.abs().sum())
        self._add("ppl_ratio", torch.exp(log_ppl_diff).sum())
        self._add("chi2_seq", torch.exp(2.0 * seq_log_ratio).sum())
        self._max("log_ppl_diff_max", log_ppl_diff.max())
        self._max("neg_log_ppl_diff_min", -log_ppl_diff.min())

    def merge(self, other: MismatchStats) -> None:
        for key, value in other.sums.items():
            self._add(key, value)
        for key, value in other.maxima.items():
            self._max(key, value)

    def metrics(self) -> dict[str, float]:
        """``rollout_corr/*`` (verl's off-policy diagnostics), ``training/rollout_probs_diff_*`` (verl's debug
        metrics) and ``sampling/*`` (TRL's GRPOTrainer names), as ``scope/name`` keys; empty without tokens."""
        s, m = self.sums, self.maxima
        tokens, seqs = s.get("tokens", 0.0), s.get("sequences", 0.0)
        if not tokens or not seqs:
            return {}
        mean_diff = s["probs_diff"] / tokens
        out = {f"rollout_corr/{name}": s[name] / tokens for name in ("kl", "k3_kl")}
        out["rollout_corr/chi2_token"] = s["chi2_token"] / tokens - 1.0
        for name in ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
                     "log_ppl_abs_diff", "ppl_ratio"):
            out[f"rollout_corr/{name}"] = s[name] / seqs
        out["rollout_corr/chi2_seq"] = s["chi2_seq"] / seqs - 1.0
        out["rollout_corr/log_ppl_diff_max"] = m["log_ppl_diff_max"]
        out["rollout_corr/log_ppl_diff_min"] = -m["neg_log_ppl_diff_min"]
        out["training/rollout_probs_diff_mean"] = mean_diff
        out["training/rollout_probs_diff_max"] = m["probs_diff_max"]
        out["training/rollout_probs_diff_std"] = math.sqrt(max(s["probs_diff_sq"] / tokens - mean_diff**2, 0.0))
        out["sampling/sampling_logp_difference/mean"] = s["logp_abs_diff"] / tokens
        out["sampling/sampling_logp_difference/max"] = m["logp_abs_diff_max"]
        out["sampling/importance_sampling_ratio/min"] = -m["neg_is_ratio_min"]
        out["sampling/importance_sampling_ratio/mean"] = s["is_ratio"] / tokens
        out["sampling/importance_sampling_ratio/max"] = m["is_ratio_max"]
        return out


def mismatch_metrics(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``MismatchStats`` of one batch, finished: see ``MismatchStats.metrics``."""
    stats = MismatchStats()
    stats.add(trainer, rollout, mask)
    return stats.metrics()


# ---------------------------------------------------------------------------------------------- thresholds


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``rollout_is_threshold``: a number is truncated IS's upper cap; ``"lower_upper"`` is IcePop's band (weights
    outside it are zeroed). Returns ``(upper, lower or None)``."""
    if isinstance(spec, bool):
        raise ConfigError("algorithm.rollout_correction.rollout_is_threshold must be a number or 'lower_upper'")
    lower: float | None = None
    try:
        if isinstance(spec, str) and "_" in spec:
            low, high = spec.split("_", 1)
            lower, upper = float(low), float(high)
        else:
            upper = float(spec)
    except ValueError:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold={spec!r}: give a number (the cap) "
                          "or 'lower_upper' (IcePop's band), e.g. 2.0 or 0.5_5.0") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold={spec!r}: bounds must be positive "
                          "with lower <= upper")
    return upper, lower


def parse_rs_options(options: str) -> list[str]:
    """``rollout_rs``: one option or several, comma-separated (all must pass to keep a token)."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        raise ConfigError(f"algorithm.rollout_correction.rollout_rs={options!r}: options are {', '.join(RS_OPTIONS)} "
                          "(comma-separated for several)")
    return names


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold``: one spec for all options or one per option (comma-separated). A k1 option takes
    ratio bounds ``lower_upper`` (a single number ``u`` means ``1/u_u``); k2 / k3 options take one upper bound.
    Returns option -> ``(lower or None, upper)``."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ConfigError(f"{key} is required with rollout_rs (e.g. 0.5_2.0 for a k1 option, 0.01 for k3)")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ConfigError(f"{key}={spec!r}: give one threshold for all {len(options)} rollout_rs options or one each")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, specs, strict=True):
        try:
            if option.endswith("k1"):
                low, high = text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text)
                lower, upper = float(low), float(high)
                if not 0 < lower <= upper:
                    raise ValueError
                out[option] = (lower, upper)
            else:
                if "_" in text:
                    raise ValueError
                upper = float(text)
                if upper <= 0:
                    raise ValueError
                out[option] = (None, upper)
        except ValueError:
            raise ConfigError(f"{key}: {text!r} for {option}: a k1 option takes ratio bounds 'lower_upper' (0 < lower "
                              "<= upper) or one number; k2 and k3 options take one positive upper bound") from None
    return out


# ---------------------------------------------------------------------------------------------- correction


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: str | float,
               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_trainer / pi_rollout, detached, zero on padding, ``(batch, response_len)``.

    ``token``: one weight per token, exp(log_ratio_t). ``sequence``: the product over the sequence,
    exp(sum_t log_ratio_t), given to each of its tokens. Both are bounded to exp(+-20) first; then a number
    threshold caps them (truncated IS, upper only), a ``lower_upper`` threshold zeroes those outside the band
    (IcePop). ``batch_normalize`` divides by the batch mean (over tokens, or over sequences) after that."""
    if level not in IS_LEVELS:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is={level!r}: use token, sequence or null")
    upper, lower = parse_is_threshold(threshold)
    mask = mask.float()
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        per_sequence = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(per_sequence).unsqueeze(-1).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    weights = weights.detach()
    low = lower if lower is not None else 1.0 / upper
    rows = mask.sum(-1) > 0
    # Beyond the bounds: the share of tokens (token level) or of sequences (sequence level), as verl counts them.
    outside = (raw, mask) if level == "token" else (raw[:, :1][rows], torch.ones_like(raw[:, :1][rows]))
    metrics = {"rollout_is_mean": float(masked_mean(weights, mask)),
               "rollout_is_ratio_fraction_high": float(masked_mean((outside[0] > upper).float(), outside[1])),
               "rollout_is_ratio_fraction_low": float(masked_mean((outside[0] < low).float(), outside[1]))}
    valid = mask.bool()
    if valid.any():
        metrics["rollout_is_max"] = float(weights[valid].max())
        metrics["rollout_is_min"] = float(weights[valid].min())
        normalised = weights / (masked_mean(weights, mask) + 1e-8)
        metrics["rollout_is_eff_sample_size"] = float(1.0 / masked_mean(normalised.square(), mask).clamp(min=1e-8))
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).float(), mask))
    if batch_normalize:
        mean = (masked_mean(weights, mask) if level == "token"
                else masked_mean(weights, mask, dim=-1)[rows].mean() if rows.any() else torch.tensor(0.0))
        if float(mean) > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = float(mean) if float(mean) > 1e-8 else 1.0
    return weights, metrics


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: str,
                   threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with the tokens (``token_*``) or whole sequences (``seq_*``) that break a bound set to 0.

    Per token: k1 = -log_ratio, kept inside [log lower, log upper] (verl's sign: the bounds are on pi_rollout /
    pi_trainer; symmetric bounds, the usual case, read either way); k2 = log_ratio^2 / 2 and k3 = exp(log_ratio) - 1
    - log_ratio, kept at or under the upper bound. ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` bound a sequence's
    sum / mean / max of the token values. Several options: a token stays only if it passes all."""
    names = parse_rs_options(options)
    bounds = parse_rs_thresholds(names, threshold)
    mask_f = mask.float()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep = torch.ones_like(mask_f)
    metrics: dict[str, float] = {}
    valid = mask_f.bool()
    for name in names:
        lower, upper = bounds[name]
        values = per_token[name[-2:]]
        if name.startswith("seq_sum"):
            values = masked_sum(values, mask_f, dim=-1).unsqueeze(-1).expand_as(mask_f)
        elif name.startswith("seq_mean"):
            values = masked_mean(values, mask_f, dim=-1).unsqueeze(-1).expand_as(mask_f)
        elif name.startswith("seq_max"):
            values = values.masked_fill(~valid, -math.inf).max(-1).values.unsqueeze(-1).expand_as(mask_f)
        # k1: ratio bounds, compared in log space; k2 / k3: an upper bound.
        in_bounds = (((values >= math.log(lower)) & (values <= math.log(upper))) if lower is not None
                     else values <= upper)
        passed = in_bounds.float()
        keep = keep * passed
        metrics[f"rollout_rs_{name}_masked_fraction"] = float(masked_mean(1.0 - passed, mask_f))
        metrics[f"rollout_rs_{name}_mean"] = float(masked_mean(values, mask_f))
    rows = mask_f.sum(-1) > 0
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1.0 - keep, mask_f))
    rejected_rows = ((1.0 - keep) * mask_f).sum(-1) > 0
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected_rows[rows].float().mean()) if rows.any() else 0.0
    return (mask_f * keep).to(mask.dtype), metrics


def correct(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rollout_is: str | None,
            rollout_is_threshold: str | float = 2.0, rollout_is_batch_normalize: bool = False,
            rollout_rs: str | None = None, rollout_rs_threshold: str | float | None = None,
            ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask``: IS weights (``None`` when ``rollout_is`` is None),
    the response mask after rejection (a copy when ``rollout_rs`` is None), and their ``rollout_corr/*`` metrics."""
    log_ratio = trainer.float() - rollout.float()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, found = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(found)
    new_mask = mask.clone()
    if rollout_rs is not None:
        new_mask, found = rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        metrics.update(found)
    return weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
