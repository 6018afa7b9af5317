"""``verl loadtest``'s and ``verl loadtest-report``'s settings: each field is its command's option, declared once
with one default (``verl.utils.cli.option``), and the Python API runs on the same classes (``LoadTestConfig``,
``SLO``). Light on purpose (dataclasses and typer): ``verl --help`` imports it, and Locust's processes import ``SLO``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loadtest.shapes import StepPlan, doubling_levels, parse_levels
from verl.errors import ConfigError, DataError
from verl.utils.cli import nested, option

# max_tokens per request; agent users get room for a call, the tool's turn and the answer (the README's agent test
# measured sessions of 0 tool calls at 32: every answer of the tiny agent was cut before its call closed).
DEFAULT_MAX_TOKENS, AGENT_MAX_TOKENS = 32, 128
# Agent runs (--user-mix agent) without a model or prompt file: the shipped tool-using model on the task it learnt.
AGENT_MODEL, AGENT_PROMPTS = "builtin:tiny-agent", "builtin:tool_arithmetic/val"
USER_MIXES = ("mixed", "classes", "agent", "feedback")
TARGET_RPS_HELP = "A load to plan for: the report gives the replicas it needs at the per-replica rate."


@dataclass(frozen=True)
class SLO:
    """What "within the SLO" means for one step; the capacity search uses it."""

    p95_ms: float = option(1000.0, "--slo-p95-ms", help="p95 latency SLO in ms (end-to-end, successful requests of "
                           "every endpoint).")
    max_failure_rate: float = option(0.01, "--max-failure-rate", help="Largest failure fraction a level may have.")
    ttft_p95_ms: float | None = option(None, "--slo-ttft-p95-ms", help="Also require TTFT p95 <= this (ms).")
    headroom: float = option(0.2, "--headroom", help="Spare share at the planning point.")
    session_p95_ms: float | None = option(None, "--slo-session-p95-ms", help="Agent runs (AgentUser): also require "
                                          "whole-session p95 <= this (ms).")

    def __post_init__(self) -> None:
        if self.p95_ms <= 0:
            raise DataError(f"the p95 SLO must be > 0 ms (got {self.p95_ms})")
        if not 0 <= self.max_failure_rate <= 1:
            raise DataError(f"the failure-rate limit must be within 0..1 (got {self.max_failure_rate})")
        if self.ttft_p95_ms is not None and self.ttft_p95_ms <= 0:
            raise DataError(f"the TTFT p95 SLO must be > 0 ms (got {self.ttft_p95_ms})")
        if self.session_p95_ms is not None and self.session_p95_ms <= 0:
            raise DataError(f"the session p95 SLO must be > 0 ms (got {self.session_p95_ms})")
        if not 0 <= self.headroom < 1:
            raise DataError(f"headroom must be within 0..1 (got {self.headroom}); 0.2 keeps 20% spare")


@dataclass
class LoadTestConfig:
    """A capacity run; the defaults match ``loadtest/locust.conf``."""

    out_dir: Path = option(Path("outputs/loadtest"), "--out", help="Output dir (CSVs, logs, report).")
    model: str | None = option(None, "--model", help="Model to serve (export dir or builtin:NAME; default: the "
                               "service's default).")  # VERL_SERVE_MODEL
    engine: str | None = option(None, "--engine", help="auto, transformers or vllm.")  # VERL_SERVE_ENGINE
    max_users: int = option(8, "--max-users", help="Levels 1, 2, 4, ... up to this.")
    step_users: str = option("", "--step-users", help="Explicit levels, e.g. 1,2,4,8,12.")  # wins over max_users
    step_time_s: float = option(20.0, "--step-time", help="Seconds each level is held.")
    step_settle_s: float = option(5.0, "--step-settle", help="Seconds at the start of a level left out of its "
                                  "percentiles.")
    user_mix: str = option("mixed", "--user-mix", help="mixed (each user sends all three requests), classes (one "
                           "user class per endpoint), agent (tool-calling sessions, AgentUser) or feedback (chats "
                           "without answers, then thumbs up/down: FeedbackUser).")
    user_classes: list[str] = option([], "--user", help="Run only these user classes (repeatable): GenerateUser, "
                                     "CompletionUser, ChatStreamUser, MixedUser.")  # empty: per user_mix
    max_tokens: int | None = option(None, "--max-tokens", help="max_tokens per request (default 32; --user-mix agent "
                                    "128: a tool call, the tool's turn and the answer must fit).")
    extra_locust_args: list[str] = option([], "--locust-arg", help="Extra Locust option, repeatable, e.g. "
                                          "--locust-arg=--wait-max=0.5.")
    slo: SLO = nested(SLO)
    startup_timeout_s: float = 180.0
    server_env: dict[str, str] = field(default_factory=dict)  # more VERL_SERVE_* settings
    url: str | None = option(None, "--url", help="Test a running service (e.g. verl serve --replicas 2) instead of "
                             "starting one; its /health gives the replicas for the per-replica line.")
    api_key: str | None = option(None, "--api-key", envvar="VERL_SERVE_API_KEY", show_envvar=True, help="The "
                                 "running service's key (--url), for the requests and /metrics.")
    processes: int = option(1, "--processes", help="Locust worker processes generating the load (one core each).")
    target_rps: float | None = option(None, "--target-rps", help=TARGET_RPS_HELP)

    def __post_init__(self) -> None:
        if self.user_mix not in USER_MIXES:
            raise ConfigError(f"--user-mix must be mixed, classes, agent or feedback (got {self.user_mix!r})")
        if self.processes < 1:
            raise ConfigError(f"--processes must be >= 1 (got {self.processes})")
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise ConfigError(f"--url must be the service's base URL, e.g. http://127.0.0.1:8000 "
                                  f"(got {self.url!r})")
            if self.model or self.engine or self.server_env:
                raise ConfigError("--model and --engine choose what a local service loads; with --url the running "
                                  "service decides (drop them, or drop --url)")
            self.url = self.url.rstrip("/")
        else:
            self.api_key = None  # the key of a running service (VERL_SERVE_API_KEY): a local one is started without
        if self.user_mix == "agent" and self.model is None:
            self.model = AGENT_MODEL  # the default model's template renders no tools
        # 0 would make every request a 400: minutes of 100% failures that measure nothing (the plan's own values
        # are checked by plan(); the SLO's by SLO).
        if self.max_tokens is None:
            agents = self.user_mix == "agent" or "AgentUser" in self.user_classes
            self.max_tokens = AGENT_MAX_TOKENS if agents else DEFAULT_MAX_TOKENS
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1 (got {self.max_tokens})")

    def plan(self) -> StepPlan:
        levels = parse_levels(self.step_users) if self.step_users else doubling_levels(self.max_users)
        return StepPlan(tuple(levels), self.step_time_s, self.step_settle_s)


@dataclass(frozen=True)
class OpenLoopOptions:
    """``verl loadtest --rate`` / ``--replay``: a schedule of sends that does not wait for answers."""

    rate: str | None = option(None, "--rate", help="Open loop instead of user steps: requests/s, comma-separated for "
                              "several (2,4,8), each sent on a schedule that does not wait for answers; latency "
                              "counts from the scheduled send.")
    arrival: str = option("poisson", "--arrival", help="--rate: constant or poisson arrivals.")
    burstiness: float = option(1.0, "--burstiness", help="--rate poisson: gamma shape of the gaps, as vllm bench "
                               "serve (1 = Poisson).")
    duration: float = option(30.0, "--duration", help="--rate: seconds of sends per rate.")
    goodput_slo: str | None = option(None, "--slo", help="--rate: per-request SLOs for goodput in ms, vLLM's names: "
                                     "ttft:300,tpot:50,itl:100,e2el:2000.")
    max_lag_p99_ms: float = option(10.0, "--max-lag-p99-ms", help="--rate: refuse a rate whose sends ran this late "
                                   "at p99 (the generator, not the service, was the bottleneck).")
    schedule_seed: int = option(0, "--schedule-seed", help="--rate: seed of the arrival schedule.")
    sweep: bool = option(False, "--sweep", help="--rate R: find the knee, the largest rate whose goodput stays >= "
                         "--goodput-share of the offered rate: double from R until a rate misses, then bisect.")
    goodput_share: float = option(0.95, "--goodput-share", help="--sweep: the share to hold.")
    max_rate: float = option(1024.0, "--max-rate", help="--sweep: the highest rate tried.")
    replay: str | None = option(None, "--replay", help="Open loop on the service's own traffic: its records (a "
                                "records_path file, or a service URL's /admin/records with VERL_SERVE_ADMIN_API_KEY), "
                                "at the recorded arrival times, prompts (where kept) and output lengths.")
    replay_speed: float = option(1.0, "--replay-speed", help="--replay: divide the recorded gaps by this (2 = twice "
                                 "the recorded rate).")

    def __post_init__(self) -> None:
        if self.rate is not None and self.replay is not None:
            raise ConfigError("--rate and --replay both set the schedule: give one")
        if self.sweep and self.replay is not None:
            raise ConfigError("--sweep searches rates; a --replay keeps the recorded times (use --replay-speed)")

    @property
    def chosen(self) -> bool:
        """An open-loop run, not user steps."""
        return self.rate is not None or self.replay is not None


@dataclass
class LoadTestSettings:
    """``verl loadtest``: the capacity run, its open-loop schedule (when one is given) and the console."""

    config: LoadTestConfig = nested(LoadTestConfig)
    open_loop: OpenLoopOptions = nested(OpenLoopOptions)
    quiet: bool = option(False, "--quiet", "-q", help="Only the summary.")

    def __post_init__(self) -> None:
        if self.open_loop.goodput_slo is not None and not self.open_loop.chosen:
            raise ConfigError("--slo sets goodput's per-request limits of an open-loop run: add --rate, or use "
                              "--slo-p95-ms for the user steps")


@dataclass(frozen=True)
class ReportSettings:
    """``verl loadtest-report``: a capacity report from saved CSVs, or two open-loop runs compared."""

    csv_prefix: Path | None = option(None, argument=True, help="Locust's --csv prefix (out/run for "
                                     "out/run_stats.csv), one of its files, or their directory.")
    out: Path | None = option(None, "--out", help="Report dir (default: beside the CSVs).")
    compare: tuple[Path, Path] | None = option(None, "--compare", help="Two open-loop runs (their --out dirs or "
                                               "open_loop.json), A then B: paired by offered rate.")
    slo: SLO = nested(SLO)
    server_metrics: Path | None = option(None, "--server-metrics", help="The service's /metrics saved after the run "
                                         "(shown as a cross-check).")
    no_plots: bool = option(False, "--no-plots", help="Skip the PNGs (no matplotlib needed).")
    replicas: int = option(1, "--replicas", help="Replicas that served the test.")
    target_rps: float | None = option(None, "--target-rps", help=TARGET_RPS_HELP)

    def __post_init__(self) -> None:
        if self.compare is not None and self.csv_prefix is not None:
            raise ConfigError("give either a Locust CSV prefix or --compare A B, not both")
        if self.compare is None and self.csv_prefix is None:
            raise ConfigError("give a Locust CSV prefix (or --compare A B for two open-loop runs)")
