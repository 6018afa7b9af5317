"""What ``verl ship`` is asked for, declared once: each field of ``ShipSettings`` and of its ``CanarySettings`` is
also the command's option (``verl.utils.cli.option``), so the flag and the Python API share one default.

Light on purpose (dataclasses and typer): ``verl --help`` imports it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from verl.errors import ConfigError
from verl.utils.cli import nested, option

METHODS = ("betting", "mixture")  # the reward test's methods (eval.ship.sequential)
# Where the rewards come from (docs/architecture.md §13): a rule checker, users' feedback, a reward model or a judge.
REWARD_SOURCE = re.compile(r"(rule|feedback|rm|judge)(:[\w.\-]+)?")


def parse_stages(text: str) -> tuple[float, ...]:
    """``0.05,0.25,0.5`` as shares."""
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--stages '{text}' must be comma-separated shares, e.g. 0.05,0.25,0.5") from None


@dataclass(frozen=True)
class CanarySettings:
    """The canary's ramp and tests. ``slo_p95_ms``, ``shadow`` and ``capacity`` say which guardrails and stages run
    (each takes a share of alpha); ``verl ship`` sets them from its own settings."""

    stages: tuple[float, ...] = option((0.05, 0.25, 0.5), "--stages", parse=parse_stages, cli_type=str,
                                       cli_default="0.05,0.25,0.5", help="The candidate's route shares, rising, e.g. "
                                       "0.05,0.25,0.5 (then 100% on promote).")
    min_per_stage: int = option(40, "--min-per-stage", help="Rewarded candidate requests a stage needs before "
                                "stepping up.")
    margin: float = option(0.05, "--margin", help="Non-inferiority margin on reward / the gate metric (absolute).")
    alpha: float = option(0.05, "--alpha", help="One error budget for the whole decision: identical models rolled "
                          "back, or a candidate worse by the margin promoted, each at most this often (split across "
                          "the tests as the plan prints).")
    test: str = option("betting", "--test", help="The reward test: betting (rewards in [0, 1]; exact at every n) or "
                       "mixture (normal mixture; asymptotic, any scale).")
    min_per_arm: int = option(30, "--min-per-arm", help="No canary decision before this many rewarded requests on "
                              "each side.")
    max_error_increase: float = option(0.02, "--max-error-increase", help="Guardrail: the candidate's error rate "
                                       "above the incumbent's by more rolls back.")
    max_missing_increase: float = option(0.02, "--max-missing-increase", help="Guardrail: the candidate's share of "
                                         "requests whose reward never came (errors, rewards past --reward-timeout-s) "
                                         "above the incumbent's by more rolls back.")
    slo_p95_ms: float | None = None
    reward_timeout_s: float = option(60.0, "--reward-timeout-s", help="A reward not in this long after its answer "
                                     "counts as missing.")
    budget_requests: int = option(10_000, "--budget-requests", help="Canary requests (both models) before "
                                  "'inconclusive'.")
    budget_s: float = option(600.0, "--budget-s", help="Canary seconds before 'inconclusive'.")
    poll_s: float = option(1.0, "--poll-s", help="Seconds between two looks at the records.")
    shadow: bool = False  # a shadow stage runs first (it takes a share of alpha)
    capacity: bool = False  # a capacity gate runs first (it takes a share of alpha)
    offline: bool = False  # the offline gates run first: their quality and diversity bounds take a share each
    reward_source: str = option("rule", "--reward-source", help="The canary's rewards: rule (requests that carry an "
                                "answer), feedback (users' POST /v1/feedback), rm:NAME or judge:NAME (a scorer's "
                                "reward rows).")

    def __post_init__(self) -> None:
        if not self.stages or any(not 0 < s < 1 for s in self.stages) or list(self.stages) != sorted(self.stages):
            raise ValueError(f"canary stages must rise within (0, 1), e.g. 0.05,0.25,0.5 (got {list(self.stages)}); "
                             "the last step to 100% is the promote")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1) (got {self.alpha})")
        if not REWARD_SOURCE.fullmatch(self.reward_source):
            raise ValueError(f"the reward source must be rule, feedback, rm:NAME or judge:NAME (got "
                             f"{self.reward_source!r})")
        if self.shadow and self.reward_source.startswith("feedback"):
            raise ValueError("a shadow stage cannot be judged by feedback: users never see a mirrored answer; use "
                             "--reward-source rule, rm:NAME or judge:NAME, or no --shadow")
        if self.test not in METHODS:
            raise ValueError(f"the test must be one of {', '.join(METHODS)} (got {self.test!r})")

    def alpha_split(self) -> dict[str, float]:
        """Each test's alpha. Turning a candidate away (rollback, or a refusal at an offline gate, the capacity
        gate or in shadow): the reward test takes half; the guardrails that run (errors, missing rewards, latency
        when an SLO is set), the offline quality gate and diversity guardrail (their one-sided bounds), the capacity
        gate and the shadow stage share the other half equally. Promoting: only the reward test's non-inferiority
        side promotes, so it has the whole alpha."""
        others = ["errors", "missing_rewards"] + (["latency"] if self.slo_p95_ms is not None else []) + (
            ["offline_quality", "offline_diversity"] if self.offline else []) + (
            ["capacity"] if self.capacity else []) + (["shadow"] if self.shadow else [])
        split = {"reward_worse": self.alpha / 2, **{name: self.alpha / 2 / len(others) for name in others}}
        return {**split, "reward_non_inferior": self.alpha}

    def offline_bounds(self) -> dict[str, float] | None:
        """The offline gates' one-sided bounds (None when they do not run): each at level 1 - its share of alpha,
        from enough bootstrap replicates for that level (20 / alpha, so the bound's tail holds 20 of them; at
        least 2,000)."""
        if not self.offline:
            return None
        alpha = self.alpha_split()["offline_quality"]
        return {"alpha": alpha, "level": 1.0 - alpha, "replicates": max(2000, math.ceil(20.0 / alpha))}


@dataclass
class ShipSettings:
    """``verl ship``: the candidate, the service, the gates; the canary's own settings are ``canary``."""

    run: str = option(argument=True, help="The candidate's training run (its best checkpoint ships).")
    service: str = option(dataclasses.MISSING, "--service", help="The running service's URL.")
    route: str = option("default", "--route", help="The route to ship on.")
    ckpt: str | None = option(None, "--ckpt", help="Ship this checkpoint instead of the best.")
    name: str | None = option(None, "--name", help="The candidate's model name in the service (default: "
                              "RUN-stepN).")
    admin_key: str | None = option(None, "--admin-key", envvar="VERL_SERVE_ADMIN_API_KEY",
                                   help="The service's admin key.")
    api_key: str | None = option(None, "--api-key", envvar="VERL_SERVE_API_KEY", help="The service's request key "
                                 "(capacity gate).")
    out: Path | None = option(None, "--out", help="Audit log and report dir (default: RUN/ship/<id>).")
    canary: CanarySettings = nested(CanarySettings)
    gate_metric: str = "eval/accuracy"
    offline: bool = option(True, "--offline/--skip-offline", help="Run the offline gates.")
    capacity: bool = option(True, "--capacity/--skip-capacity", help="Run the capacity gate.")
    capacity_users: int = option(2, "--capacity-users", help="Users in the capacity gate.")
    capacity_s: float = option(10.0, "--capacity-s", help="Seconds of the capacity gate.")
    slo_p95_ms: float = option(1000.0, "--slo-p95-ms", help="Guardrail (a sequential test that the candidate's p95 "
                               "is above it) and capacity gate: p95 latency SLO (ms).")
    gate_data: list[str] | None = option(None, "--gate-data", help="Offline gate prompts (parquet or "
                                         "builtin:TASK/SPLIT; repeatable). Default: the built-in task's test split, "
                                         "which the run's checkpoint selection never saw.")
    max_samples: int | None = option(None, "--max-samples", help="Offline gate: the first N prompts.")
    max_kl: float | None = option(None, "--max-kl", help="Offline guardrail: refuse a candidate whose exact KL to its "
                                  "base model is above this (default: reported only).")
    shadow_fraction: float = option(0.0, "--shadow", help="Before the canary, mirror this share of the route to the "
                                    "candidate (recorded, never returned); 0: no shadow stage.")
    shadow_requests: int = option(50, "--shadow-requests", help="Mirrored, rewarded answers the shadow stage needs.")
    strict: bool = option(False, "--strict", help="Offline gate: refuse when its prompts overlap the run's training "
                          "data (exactly or by a 13-gram) instead of reporting it.")
    dry_run: bool = option(False, "--dry-run", help="Print the plan, the alpha split and the canary's power for the "
                           "route's observed traffic; change nothing.")

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ConfigError(f"--shadow is a share of the route's requests: 0 (no shadow stage) to 1 (got "
                              f"{self.shadow_fraction})")
        # The canary's guardrails and stages follow what this ship runs: one source for each.
        self.canary = dataclasses.replace(self.canary, slo_p95_ms=self.slo_p95_ms, capacity=self.capacity,
                                          shadow=self.shadow_fraction > 0, offline=self.offline)
