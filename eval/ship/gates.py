"""The offline gates of ``verl ship``: before any user sees the candidate.

- **quality** (paired, non-inferiority): the candidate and the incumbent evaluated on the same prompts (the
  candidate run's validation set, the run's validation sampling), compared prompt by prompt as ``verl compare``
  does (a paired bootstrap of the prompts). It passes when the difference's one-sided lower bound at level
  ``1 - alpha`` lies above ``-margin``, ``alpha`` its share of ``--alpha`` (``CanarySettings.offline_bounds``: the
  turn-away half, shared with the guardrails, capacity and shadow; 20 / alpha replicates, at least 2,000).
- **guardrails**: diversity must not collapse (the share of distinct responses, ``eval/distinct_responses``, under
  half the incumbent's, its one-sided upper bound at its own share of alpha below 0; ``eval/distinct_1`` for
  evaluations without it), the
  mean response length must not shrink to under half the incumbent's, and the candidate's exact KL to its run's
  base model is reported (refused above ``--max-kl`` when given).
- **reward-hacking tripwire**: the candidate run's training reward rose by more than the margin while its held-out
  accuracy fell by more than the margin (against its own first validation, its own peak before the candidate's
  step, or the incumbent), or — when a reward model gave the reward — rose by ``RM_STALL_Z`` of its starting spread
  while the rule's held-out accuracy did not rise: the reward was learnt, the task was not.
- **capacity**: a short load test of the candidate (already loaded in the service, 0% of the route) at the planning
  load; refused when its p95 is significantly above the SLO or its failures significantly above the incumbent's
  rate plus the allowed increase (binomial tests on the service's records of those requests, one look).

Each returns a ``Gate`` with the numbers it decided on; ``verl ship`` refuses at the first that fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from verl.trainer.health import RM_STALL_Z
from verl.utils.log import read_jsonl


@dataclass
class Gate:
    name: str
    passed: bool
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def bound(row: dict, side: str) -> tuple[float, str]:
    """A pair row's one-sided bound (``side``: lower or upper) and how to name it: at the offline gates' share of
    alpha when ``compare_pair`` was given one, else the 95% interval's end."""
    if row.get(side) is not None and row.get("bound_alpha") is not None:
        return row[side], f"one-sided {1 - row['bound_alpha']:.2%} bound"
    return row["ci_low" if side == "lower" else "ci_high"], "95% CI"


def quality_gate(pair: dict, metric: str, margin: float) -> Gate:
    """``pair``: ``eval.compare.compare_pair(incumbent, candidate)``; it passes when the lower bound of the difference
    lies above ``-margin``."""
    row = pair["metrics"].get(metric)
    if row is None:
        return Gate("quality", False, f"no {metric} in both evaluations (available: {', '.join(pair['metrics'])})")
    evidence = {k: row.get(k) for k in ("baseline", "candidate", "diff", "ci_low", "ci_high", "lower", "bound_alpha",
                                        "replicates", "p_value", "test", "n_prompts")}
    low, what = bound(row, "lower")
    head = (f"{metric}: candidate {row['candidate']:.3f} vs incumbent {row['baseline']:.3f}, difference "
            f"{row['diff']:+.3f} ({what} {low:+.3f})")
    if low > -margin:
        return Gate("quality", True, f"{head} above -{margin:g}", evidence)
    return Gate("quality", False, f"{head} does not rule out being worse by more than the margin {margin:g}", evidence)


def guardrail_gate(pair: dict, margin: float, kl: float | None = None, max_kl: float | None = None) -> Gate:
    """Diversity and length against the incumbent; ``kl``: the candidate's exact KL to its run's base model
    (``eval/kl_exact``), refused above ``max_kl`` when one is given (else reported)."""
    metrics = pair["metrics"]
    evidence: dict[str, Any] = {"kl_to_base": kl, "max_kl": max_kl}
    if kl is not None and max_kl is not None and kl > max_kl:
        return Gate("guardrails", False, f"KL to the base model {kl:.4g} above --max-kl {max_kl:g}", evidence)
    distinct_1 = metrics.get("eval/distinct_1")
    if distinct_1 is not None:
        evidence["distinct_1"] = {k: distinct_1.get(k) for k in ("baseline", "candidate", "diff", "ci_low", "ci_high")}
    # A collapse is different prompts getting the same answer: the share of distinct responses. distinct-1 (the
    # rule before, and the fallback for evaluations that lack the share) also falls when every answer gains a
    # format marker, and a model that learnt terse answers is less diverse than one that rambles, so the guardrail
    # asks for a fall to under half the incumbent's, and a significant one.
    name = "distinct_responses" if "eval/distinct_responses" in metrics else "distinct_1"
    diversity = metrics.get(f"eval/{name}")
    if diversity is not None:
        evidence[name] = {k: diversity.get(k) for k in ("baseline", "candidate", "diff", "ci_low", "ci_high", "upper",
                                                         "bound_alpha")}
        high, what = bound(diversity, "upper")
        if diversity["candidate"] < 0.5 * diversity["baseline"] and high < 0:
            return Gate("guardrails", False, f"diversity collapsed: {name} {diversity['candidate']:.3f} vs "
                        f"{diversity['baseline']:.3f} (under half; the difference's {what} {high:+.3f} below 0)",
                        evidence)
    length = metrics.get("eval/response_length_mean")
    if length is not None:
        evidence["response_length_mean"] = {k: length.get(k) for k in ("baseline", "candidate")}
        if length["baseline"] and length["candidate"] < 0.5 * length["baseline"]:
            return Gate("guardrails", False, f"responses shrank to {length['candidate']:.1f} tokens from "
                        f"{length['baseline']:.1f} (under half)", evidence)
    held = "diversity and response length hold" + (f"; KL to the base {kl:.4g}" if kl is not None else "")
    return Gate("guardrails", True, held, evidence)


def training_trend(run_dir: Path | None, step: int | None) -> dict[str, Any]:
    """The candidate run's training reward and held-out accuracy, first vs at the candidate's step. The reward's rise
    is also given in units of its spread across a step's samples at the start (``z``: a reward model's scores have
    units of their own), and whether a reward model gave it (``source``: rows with ``rm_score``); the accuracy's
    peak up to the candidate's step."""
    if run_dir is None or not (Path(run_dir) / "verl_logs.jsonl").is_file():
        return {}
    rewards, spreads, accuracy, from_rm = [], [], [], False
    for row in read_jsonl(Path(run_dir) / "verl_logs.jsonl"):
        if step is not None and row.get("step", 0) > step:
            continue
        if row.get("scope") == "rollout" and isinstance(row.get("reward_mean"), (int, float)):
            rewards.append((row["step"], float(row["reward_mean"])))
            spreads.append(float(row["reward_std"]) if isinstance(row.get("reward_std"), (int, float)) else None)
            from_rm = from_rm or "rm_score" in row
        if row.get("scope") == "eval" and isinstance(row.get("accuracy"), (int, float)):
            accuracy.append((row["step"], float(row["accuracy"])))
    out: dict[str, Any] = {}
    if len(rewards) >= 2:
        k = max(1, min(3, len(rewards) // 2))  # a few steps at each end: one step's reward is noisy
        first = sum(v for _, v in rewards[:k]) / k
        last = sum(v for _, v in rewards[-k:]) / k
        early = [v for v in spreads[:k] if v is not None]
        spread = sum(early) / len(early) if early else 0.0
        out["train_reward"] = {"first": first, "last": last, "change": last - first, "steps_averaged": k,
                               "z": (last - first) / spread if spread > 1e-9 else None,
                               "source": "rm" if from_rm else "rule"}
    if len(accuracy) >= 2:
        peak_step, peak = max(accuracy, key=lambda item: item[1])
        out["heldout_accuracy"] = {"first": accuracy[0][1], "last": accuracy[-1][1],
                                   "change": accuracy[-1][1] - accuracy[0][1], "peak": peak, "peak_step": peak_step}
    return out




def tripwire_gate(trend: dict[str, Any], pair: dict, metric: str, margin: float) -> Gate:
    reward = trend.get("train_reward")
    if reward is None or reward["change"] <= margin:
        return Gate("tripwire", True, "training reward did not rise beyond the margin: nothing to trip on", trend)
    rose = f"training reward rose {reward['change']:+.3f}"
    own = trend.get("heldout_accuracy")
    if own is not None and own["change"] < -margin:
        return Gate("tripwire", False, f"reward-hacking tripwire: {rose} while held-out accuracy fell "
                    f"{own['change']:+.3f} over the run", trend)
    if own is not None and own["last"] < own["peak"] - margin:
        return Gate("tripwire", False, f"reward-hacking tripwire: {rose} while held-out accuracy fell from its peak "
                    f"{own['peak']:.3f} (step {own['peak_step']}) to {own['last']:.3f}", trend)
    z = reward.get("z")
    if (own is not None and reward.get("source") == "rm" and z is not None and z >= RM_STALL_Z
            and own["change"] <= margin):
        return Gate("tripwire", False, f"reward-hacking tripwire: the reward model's reward rose {z:.1f} times its "
                    f"starting spread while the rule's held-out accuracy did not rise ({own['change']:+.3f})", trend)
    row = pair["metrics"].get(metric)
    if row is not None and row["diff"] < -margin:
        return Gate("tripwire", False, f"reward-hacking tripwire: {rose} but held-out {metric} is "
                    f"{row['diff']:+.3f} against the incumbent", trend)
    return Gate("tripwire", True, f"{rose} and held-out accuracy held", trend)


def capacity_gate(report: dict, rows: list[dict], slo_p95_ms: float, allowance: float, alpha: float) -> Gate:
    """``report``: the capacity report of the candidate's short load test (evidence); ``rows``: the service's records
    of the candidate's requests during it. One look, two binomial tests at ``alpha / 2`` each: refused when the share
    of answers slower than the SLO is significantly above 5% (its p95 is above the SLO), or its failure rate is
    significantly above ``allowance``; a sample p95 a little over the SLO by chance is not a refusal."""
    from scipy.stats import binom  # noqa: PLC0415

    steps = report.get("steps") or []
    keys = ("users", "requests", "latency_p95_ms", "failure_rate", "requests_per_s")
    answered = [r for r in rows if not r.get("error") and r.get("e2e_s") is not None]
    slow = sum(1000.0 * r["e2e_s"] > slo_p95_ms for r in answered)
    failed = sum(bool(r.get("error")) for r in rows)
    p_slow = float(binom.sf(slow - 1, len(answered), 0.05)) if answered else 1.0
    p_failed = float(binom.sf(failed - 1, len(rows), allowance)) if rows else 1.0
    evidence = {"steps": [{k: s.get(k) for k in keys} for s in steps], "slo_p95_ms": slo_p95_ms,
                "requests": len(rows), "above_slo": slow, "p_value_p95_above_slo": p_slow, "failed": failed,
                "failure_allowance": allowance, "p_value_failures_above_allowance": p_failed, "alpha": alpha}
    if not rows:
        return Gate("capacity", False, "the load test's requests are not in the service's records", evidence)
    p95 = float(np.percentile([1000.0 * r["e2e_s"] for r in answered], 95)) if answered else float("nan")
    if p_slow < alpha / 2:
        return Gate("capacity", False, f"p95 above the SLO {slo_p95_ms:g} ms: {slow} of {len(answered)} answers "
                    f"slower (p = {p_slow:.2g} against 5%; sample p95 {p95:.0f} ms)", evidence)
    if p_failed < alpha / 2:
        return Gate("capacity", False, f"{failed} of {len(rows)} requests failed (p = {p_failed:.2g} against the "
                    f"allowance {allowance:.1%})", evidence)
    return Gate("capacity", True, f"{len(rows)} requests: p95 {p95:.0f} ms against the SLO {slo_p95_ms:g} ms ({slow} "
                f"slower), {failed} failed (allowance {allowance:.1%}); neither significantly over", evidence)
