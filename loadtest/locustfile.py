"""Locust users for the verl inference service (``uvicorn serve.api:app``) or any OpenAI-compatible server.

    locust -f loadtest/ -H http://127.0.0.1:8000                          # web UI on :8089, stepped load
    locust -f loadtest/ --config loadtest/locust.conf -H http://127.0.0.1:8000 --csv out/run   # headless

Users (``--user-mix``, or name classes: ``locust -f loadtest/ ChatStreamUser``; weights with ``--*-weight``):

- ``MixedUser`` (default, ``--user-mix mixed``): each request is one of the three below, drawn by weight.
- ``GenerateUser``: ``POST /generate`` (the tutorial endpoint).
- ``CompletionUser``: ``POST /v1/completions``.
- ``ChatStreamUser``: ``POST /v1/chat/completions`` with ``stream: true``, read to ``[DONE]``.
- ``RouteUser`` (``--user-mix route``): ``POST /v1/completions`` to a route of a multi-model service (``--model
  ROUTE``, default ``default``), each request as one of ``--route-user-pool`` end users (the ``user`` field keeps
  each on one variant); every entry is named after the variant that answered (``/v1/completions @b``,
  ``e2e_latency_ms @b``), so the tables and the capacity report show latency and request share per variant.
- ``AgentUser`` (``--user-mix agent``): agent sessions. Each task is one conversation: ``POST
  /v1/chat/completions`` with ``tools`` (``--agent-tools``, run here, client-side, as an agent framework does),
  the calls the model makes executed and their results sent back as ``tool`` messages, until the model answers
  or ``--max-turns``. Each turn is an HTTP entry (``/v1/chat/completions [agent turn]``) with the usual LLM
  entries; each finished session adds ``session_latency_ms``, ``session_turns``, ``session_output_tokens`` and
  ``session_tool_calls``, and the capacity report gains sessions/s within ``--slo-session-p95-ms``. Use a prompt
  file whose questions need the tool: ``--prompt-file builtin:tool_arithmetic/val``.

Every response is checked (status, JSON shape, non-empty text, usage counts; see ``checks.py``). Besides the HTTP
entries, LLM numbers go into Locust's statistics as custom entries of type ``LLM`` (in the web UI, the console
table and every CSV; the value sits in the "response time" columns, the unit is in the name):

- ``e2e_latency_ms``: request start -> whole answer received, successful requests of every endpoint (the SLO
  metric of the capacity report). For the stream this is also the HTTP entry's time: Locust would otherwise
  stop the clock at the response headers.
- ``ttft_ms``: time to first token (streams); ``itl_ms``: mean inter-token latency of one stream;
- ``output_tokens``: generated tokens per request; ``output_tokens_per_s``: output_tokens / e2e latency.

Locust's ``Aggregated`` row adds these entries to the HTTP ones, so read HTTP totals from the endpoint rows (the
capacity report does). Our options (``add_arguments`` below; CLI, ``LOCUST_*`` env vars, ``locust.conf`` or the web
UI's form) choose prompts, the request mix and the stepped shape (``StepShape``, plan in ``shapes.py``).
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.pool
import locust
import locust.exception
import locust.stats
from locust import FastHttpUser, LoadTestShape, events
from locust.env import Environment
from locust.runners import WORKER_REPORT_INTERVAL, MasterRunner, WorkerRunner

from loadtest.checks import (
    ABORT_AFTER_FAILURES,
    ABORT_EXIT_CODE,
    ABORT_MARKER,
    BadResponse,
    SSEReader,
    check_chat_stream,
    check_chat_turn,
    check_completion,
    check_generate,
    error_message,
)
from loadtest.open_loop import (
    ARRIVALS,
    OPEN_RECORDS_SUFFIX,
    RequestRecord,
    arrival_offsets,
    worker_records_path,
    worker_share,
    write_records,
)
from loadtest.prompts import DEFAULT_PROMPT_FILE, Prompt, load_prompts, render_with_server
from loadtest.report import CUT_ENTRY, NO_TOOL_ENTRY, VARIANT_MARK
from loadtest.settings import AGENT_MAX_TOKENS, DEFAULT_MAX_TOKENS
from loadtest.shapes import StepPlan
from verl.errors import VerlError
from verl.utils.fs import atomic_write_json

log = logging.getLogger("loadtest")

LLM = "LLM"  # request_type of the custom entries
DEFAULT_HOST = "http://127.0.0.1:8000"  # `uvicorn serve.api:app` / `verl serve` defaults
STREAM_NAME = "/v1/chat/completions [stream]"  # the HTTP entry of streamed chats
AGENT_TURN_NAME = "/v1/chat/completions [agent turn]"  # the HTTP entry of each turn of an agent session
OPEN_NAME = "/v1/chat/completions [open loop]"  # OpenLoopUser's HTTP entry (timed from the scheduled send)
# "started"/"done": this process's open-loop schedule began/has run (the shape then ends the test); on the master,
# "workers_done": the worker indices whose OPEN_DONE_MESSAGE came (their records are on disk), "give_up_at" and
# "finished_at" (time.monotonic(); see open_loop_finished). Cleared at each test start.
OPEN_LOOP: dict[str, Any] = {}
OPEN_DONE_MESSAGE = "verl_open_loop_done"  # worker -> master, sent once the worker's records are written
OPEN_DONE_GRACE_S = 30.0  # past the schedule and the request timeout, the longest the master waits for a worker
USER_WEIGHTS = {"GenerateUser": "generate_weight", "CompletionUser": "completion_weight",
                "ChatStreamUser": "chat_weight"}

# Filled once per process at test start (prompt file read, chats rendered, model name looked up).
STATE: dict[str, Any] = {"prompts": [], "model": None, "ready": False}
WORKER_DRAIN_S = 2 * WORKER_REPORT_INTERVAL + 1  # the workers' closing reports arrive within this (see StepShape)
FIRST_USERS_WAIT_S = 30.0  # the longest the first level waits for its users (the run's timeout has 90 s spare)

FAILURES: dict[str, Any] = {"succeeded": False, "failed": 0, "first": None, "aborted": False}


# ---------------------------------------------------------------- options


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    """Our options; each also reads ``LOCUST_<NAME>``, a ``name = value`` line in the config file and the web UI."""

    def option(name: str, **kwargs: Any) -> None:
        # Locust's own add_argument (not an argument group's): only it knows is_secret and the web UI form.
        parser.add_argument(f"--{name}", env_var="LOCUST_" + name.upper().replace("-", "_"), **kwargs)

    option("prompt-file", default=DEFAULT_PROMPT_FILE,
           help="Parquet or JSONL file with a prompt column (text or chat messages), or builtin:TASK/SPLIT.")
    option("prompt-column", default="prompt", help="Column/field holding the prompt.")
    option("num-prompts", type=int, default=256, help="Use the first N prompts of the file.")
    option("text-prompts", choices=["template", "content"], default="template",
           help="How chat prompts become text for /generate and /v1/completions: the model's chat template "
                "(via the server's /tokenize + /detokenize) or the messages' contents.")
    option("max-tokens", type=int, default=None,
           help=f"max_tokens / max_new_tokens per request (default {DEFAULT_MAX_TOKENS}; agent users "
                f"{AGENT_MAX_TOKENS}: a tool call and its answer must fit).")
    option("temperature", type=float, default=0.0, help="Sampling temperature (0 = greedy).")
    option("ignore-eos", action="store_true", default=False,
           help="Always generate max-tokens tokens (vLLM extension; OpenAI endpoints only), like vllm bench.")
    option("model", default="", help="Model name for the OpenAI endpoints (default: the first of /v1/models).")
    option("api-key", default="", is_secret=True, help="Bearer key when the server sets VERL_SERVE_API_KEY.")
    option("rate", type=float, default=None,
           help="OpenLoopUser (--user-mix open): requests/s sent on a schedule that does not wait for answers; "
                "latency counts from each request's scheduled send time.")
    option("arrival", choices=list(ARRIVALS), default="poisson",
           help="OpenLoopUser: constant spacing, or poisson (gamma gaps with --burstiness, as vllm bench serve).")
    option("burstiness", type=float, default=1.0, help="OpenLoopUser: gamma shape of the gaps (1 = Poisson).")
    option("duration", type=float, default=30.0, help="OpenLoopUser: seconds of scheduled sends.")
    option("schedule-seed", type=int, default=0, help="OpenLoopUser: seed of the arrival schedule and prompts.")
    option("open-sessions", action="store_true", default=False,
           help="OpenLoopUser: each scheduled arrival starts an agent session (AgentUser's turns, tools run "
                "client-side) instead of one streamed chat.")
    option("open-records", default="",
           help="OpenLoopUser: where each request's record goes (<this>_requests.jsonl; default: the --csv prefix). "
                "Needed with --processes: Locust's worker processes get no --csv.")
    option("replay-schedule", default="",
           help="OpenLoopUser: send this JSONL schedule instead (offset_s, messages, max_tokens per line; verl "
                "loadtest --replay writes it from the service's records).")
    option("user-mix", choices=["mixed", "classes", "route", "agent", "feedback", "open"], default="mixed",
           help="mixed: every user sends all three requests by weight (MixedUser); classes: one user class per "
                "endpoint, weighted (GenerateUser, CompletionUser, ChatStreamUser); route: RouteUser, a route's "
                "traffic split per variant; agent: AgentUser, multi-turn tool-calling sessions; feedback: "
                "FeedbackUser, chats without answers and thumbs up/down sent later; open: OpenLoopUser, streamed "
                "chats at --rate on a schedule (open loop). Naming classes overrides this.")
    option("agent-tools", default="calculator",
           help="AgentUser: built-in tools (comma-separated) offered to the model and run client-side.")
    option("max-turns", type=int, default=4, help="AgentUser: assistant turns per session at most.")
    option("route-user-pool", type=int, default=100_000,
           help="RouteUser: requests come from this many distinct end users (the `user` field), uniformly.")
    option("reward", default="",
           help="RouteUser: score each response with this rule reward (arithmetic, gsm8k, ...) against the prompt "
                "file's ground truth (the `verl` extension field), so `verl compare --online` compares reward.")
    option("feedback-share", type=float, default=0.5,
           help="FeedbackUser: the share of answers a user gives feedback on (POST /v1/feedback).")
    option("feedback-delay", type=float, default=2.0,
           help="FeedbackUser: feedback comes this many seconds after the answer on average (exponential; the "
                "user goes on meanwhile).")
    option("feedback-rule", default="arithmetic",
           help="FeedbackUser: how a simulated user judges an answer: thumbs up when this rule reward, against "
                "the prompt file's answer, gives >= 0.5 (a person who knows the answer).")
    option("generate-weight", type=int, default=1, help="Relative weight of /generate requests (0 = none).")
    option("completion-weight", type=int, default=1, help="Relative weight of /v1/completions requests (0 = none).")
    option("chat-weight", type=int, default=1, help="Relative weight of streamed chat requests (0 = none).")
    option("wait-min", type=float, default=0.0, help="Each user waits uniform(wait-min, wait-max) s between requests.")
    option("wait-max", type=float, default=0.0, help="See --wait-min (0 and 0: back to back, a closed loop).")
    option("request-timeout", type=float, default=60.0, help="Seconds before a request counts as failed.")
    option("health-timeout", type=float, default=120.0,
           help="At start, wait up to this long for the server's /health to answer 200 (0: do not wait).")
    option("load-shape", choices=["steps", "fixed"], default="steps",
           help="steps: 1, 2, 4 ... users (below); fixed: Locust's own -u/-r/-t.")
    option("max-users", type=int, default=8, help="Steps double up to this many users (1, 2, 4, ..., N).")
    option("step-users", default="", help="Explicit levels instead, e.g. 1,2,4,8,12.")
    option("step-time", type=float, default=20.0, help="Seconds each level is held.")
    option("step-settle", type=float, default=5.0,
           help="Seconds at the start of each level left out of its percentiles (spawning, queues filling).")


def apply_options(environment: Environment, at_init: bool = False) -> None:
    """Validate options, set user weights and the percentile window (at init, and again at start: the web UI
    may have changed the options in between)."""
    options = environment.parsed_options
    # Only the command line's -u/-t count (at init): by test start Locust has filled num_users from the shape.
    if at_init and options.load_shape == "steps" and (options.num_users is not None or options.run_time):
        # `-u 4 -r 4 -t 30s` means a fixed load; the stepped shape would silently ignore all three.
        options.load_shape = "fixed"
        log.warning("loadtest: -u/-t given: a fixed load of %s users (spawn rate %s/s) for %s instead of the "
                    "stepped shape; drop -u/-t (or set --max-users/--step-time) for a stepped capacity run",
                    options.num_users or 1, options.spawn_rate or 1,
                    f"{options.run_time} s" if options.run_time else "until stopped")
    try:
        plan = StepPlan.from_options(options)
    except ValueError as exc:
        raise SystemExit(f"loadtest: {exc}") from None
    if options.max_tokens is None:
        agents = options.user_mix == "agent" or "AgentUser" in (options.user_classes or []) or getattr(
            options, "open_sessions", False)
        options.max_tokens = AGENT_MAX_TOKENS if agents else DEFAULT_MAX_TOKENS
    if options.max_tokens < 1:  # 0 would make every request a 400: a run of 100% failures that measures nothing
        raise SystemExit(f"loadtest: --max-tokens must be >= 1 (got {options.max_tokens})")
    if options.user_mix == "open" or "OpenLoopUser" in (options.user_classes or []):
        if options.rate is None and not options.replay_schedule:
            raise SystemExit("loadtest: the open loop needs --rate (requests/s) or --replay-schedule FILE")
        try:
            if options.rate is not None:
                arrival_offsets(options.rate, options.duration, options.arrival, options.burstiness)
        except VerlError as exc:
            raise SystemExit(f"loadtest: {exc}") from None
    if options.max_turns < 1:
        raise SystemExit(f"loadtest: --max-turns must be >= 1 (got {options.max_turns})")
    if not 0.0 <= options.feedback_share <= 1.0 or options.feedback_delay < 0:
        raise SystemExit(f"loadtest: need 0 <= --feedback-share <= 1 and --feedback-delay >= 0 (got "
                         f"{options.feedback_share}, {options.feedback_delay})")
    if options.num_prompts < 1:
        raise SystemExit(f"loadtest: --num-prompts must be >= 1 (got {options.num_prompts})")
    if options.wait_min < 0 or options.wait_max < options.wait_min:
        raise SystemExit(f"loadtest: need 0 <= --wait-min <= --wait-max (got {options.wait_min}, {options.wait_max})")
    if options.load_shape == "steps":
        # The history row written at the end of a level then holds percentiles over that level after settling.
        locust.stats.CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW = plan.window_s
    weights = {}
    for name, attribute in USER_WEIGHTS.items():
        weights[name] = getattr(options, attribute)
        if weights[name] < 0:
            raise SystemExit(f"loadtest: --{attribute.replace('_', '-')} must be >= 0 (got {weights[name]})")
    if not any(weights.values()):
        raise SystemExit("loadtest: --generate-weight, --completion-weight and --chat-weight are all 0")
    requests = {"GenerateUser": LLMUser.generate, "CompletionUser": LLMUser.completion,
                "ChatStreamUser": LLMUser.chat_stream}
    # A list with repeats is how Locust weighs tasks (it picks with random.choice).
    MixedUser.tasks = [requests[name] for name, weight in weights.items() for _ in range(weight)]
    # Classes named on the command line run as named; otherwise --user-mix picks MixedUser or the endpoint classes.
    named = bool(options.user_classes)
    mixes = {MixedUser: "mixed", RouteUser: "route", AgentUser: "agent", OpenLoopUser: "open", FeedbackUser: "feedback"}
    for user_class in environment.user_classes:
        if user_class.__name__ in weights:
            user_class.weight = weights[user_class.__name__] if named or options.user_mix == "classes" else 0
        elif user_class in mixes:
            user_class.weight = 1 if named or options.user_mix == mixes[user_class] else 0
    if not any(getattr(c, "weight", 1) > 0 for c in environment.user_classes):
        raise SystemExit("loadtest: no user class left to run (weights 0); check --user-mix and the --*-weight "
                         "options")


@events.init.add_listener
def configure(environment: Environment, **_: Any) -> None:
    if environment.parsed_options is not None:  # None when Locust runs as a library without our parser
        apply_options(environment, at_init=True)
        options = environment.parsed_options
        try:  # a bad prompt file fails here, in a second, not at test start after the service wait
            load_prompts(options.prompt_file, options.prompt_column, options.num_prompts)
        except VerlError as exc:
            raise SystemExit(f"loadtest: {exc}") from None
    STATE["environment"] = environment
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message(OPEN_DONE_MESSAGE, _worker_schedule_done)


def _worker_schedule_done(msg: Any, **_: Any) -> None:
    """The master's handler of OPEN_DONE_MESSAGE: the worker's share has run and its records are written."""
    OPEN_LOOP.setdefault("workers_done", set()).add(int(msg.data["worker"]))


@events.request.add_listener
def stop_when_nothing_succeeds(request_type: str, name: str, exception: Any = None, **_: Any) -> None:
    """After ``ABORT_AFTER_FAILURES`` failed requests and no success, quit with the first error (exit code 3)."""
    if request_type == LLM or FAILURES["succeeded"] or FAILURES["aborted"]:
        return
    if exception is None:
        FAILURES["succeeded"] = True
        return
    FAILURES["failed"] += 1
    FAILURES["first"] = FAILURES["first"] or f"{request_type} {name}: {exception}"
    environment = STATE.get("environment")
    if FAILURES["failed"] >= ABORT_AFTER_FAILURES and environment is not None and environment.runner is not None:
        FAILURES["aborted"] = True
        log.error("%s the first %d requests all failed; first error: %s", ABORT_MARKER, FAILURES["failed"],
                  FAILURES["first"])
        environment.process_exit_code = ABORT_EXIT_CODE
        gevent.spawn(environment.runner.quit)  # not from this greenlet: quitting kills the users, this one too


@events.test_start.add_listener
def prepare(environment: Environment, **_: Any) -> None:
    """Load prompts and find the model name once; render chats as text through the server when asked."""
    options = environment.parsed_options
    STATE["ready"] = False
    STATE.pop("first_users_running", None)  # a new test (the web UI's restart) waits for its users again
    STATE.pop("first_users_wait_from", None)
    OPEN_LOOP.clear()
    apply_options(environment)
    host = environment.host or DEFAULT_HOST
    headers = _auth_headers(options.api_key)
    _wait_ready(host, options.health_timeout)
    prompts = load_prompts(options.prompt_file, options.prompt_column, options.num_prompts)
    if options.text_prompts == "template" and any(p.chat for p in prompts):
        prompts, problem = render_with_server(prompts, host, headers)
        if problem:
            log.warning("loadtest: could not render chat prompts with the server's template (%s); text endpoints "
                        "get the messages' contents instead", problem)
    STATE["prompts"] = prompts
    STATE["model"] = options.model or _first_model(host, headers)
    log.info("loadtest: %d prompts from %s; model %s", len(prompts), options.prompt_file, STATE["model"] or "-")
    if options.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        _write_run_info(environment, host, len(prompts))
    STATE["ready"] = True
    if environment.shape_class is not None:
        environment.shape_class.reset_time()  # the first level gets its full time from now


def _write_run_info(environment: Environment, host: str, num_prompts: int) -> None:
    """``<csv prefix>_loadtest.json``: what this run did, so the report can name the step plan and the mix."""
    options = environment.parsed_options
    info = {"locust_version": locust.__version__, "host": host, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_shape": options.load_shape, "processes": max(1, int(getattr(options, "processes", 1) or 1)),
            "plan": StepPlan.from_options(options).to_dict() if options.load_shape == "steps" else None,
            "percentile_window_s": locust.stats.CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW,
            "user_classes": {c.__name__: getattr(c, "weight", 1) for c in environment.user_classes},
            "mixed_user_requests": {f.__name__: MixedUser.tasks.count(f) for f in set(MixedUser.tasks)},
            "prompt_file": options.prompt_file, "num_prompts": num_prompts, "text_prompts": options.text_prompts,
            "model": STATE["model"], "max_tokens": options.max_tokens, "temperature": options.temperature,
            "ignore_eos": options.ignore_eos, "wait_s": [options.wait_min, options.wait_max]}
    atomic_write_json(f"{options.csv_prefix}_loadtest.json", info)


def _wait_ready(host: str, timeout_s: float) -> None:
    """Wait while ``/health`` is refused or 503 (the model still loading), so no level measures a start-up.

    A server without ``/health`` (404 or anything else) is taken as ready.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(host.rstrip("/") + "/health", timeout=5):  # noqa: S310 (the target host)
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                return
            problem = "503 (loading?)"
        except OSError as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            log.warning("loadtest: %s/health not ready after %g s (%s); starting anyway", host, timeout_s, problem)
            return
        time.sleep(0.5)  # gevent-patched: the rest of Locust keeps running


def _auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _first_model(host: str, headers: dict[str, str]) -> str | None:
    try:
        request = urllib.request.Request(host.rstrip("/") + "/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (the test's own target host)
            return json.loads(response.read())["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - the model field is optional for our server; say why it is missing
        log.warning("loadtest: no model name from %s/v1/models (%s); sending requests without 'model'", host, exc)
        return None


# ---------------------------------------------------------------- users


class LLMUser(FastHttpUser):
    """Common parts: options, prompt choice, the custom LLM entries."""

    abstract = True
    host = DEFAULT_HOST

    def __init__(self, environment: Environment) -> None:
        self.options = environment.parsed_options
        # FastHttpUser reads these when it builds its session in __init__, so they are set first.
        self.network_timeout = self.options.request_timeout
        self.default_headers = _auth_headers(self.options.api_key)
        super().__init__(environment)

    def wait_time(self) -> float:
        return random.uniform(self.options.wait_min, self.options.wait_max)

    def prompt(self) -> Prompt:
        return random.choice(STATE["prompts"])

    def openai_body(self, **fields: Any) -> dict[str, Any]:
        body = {"max_tokens": self.options.max_tokens, "temperature": self.options.temperature, **fields}
        if STATE["model"] and "model" not in fields:
            body["model"] = STATE["model"]
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        return body

    def fire(self, name: str, value: float) -> None:
        """One custom entry; ``value`` goes where Locust keeps response times (the unit is in ``name``)."""
        self.environment.events.request.fire(request_type=LLM, name=name, response_time=value, response_length=0,
                                             exception=None, context={})

    def record(self, latency_s: float, completion_tokens: int, endpoint: str, finish_reason: str) -> None:
        self.fire("e2e_latency_ms", latency_s * 1000)
        self.fire("output_tokens", completion_tokens)
        self.fire("output_tokens_per_s", completion_tokens / latency_s if latency_s > 0 else 0.0)
        # 1 or 0 per answer: the entry's mean is the share cut at max_tokens (the report warns when it is high).
        self.fire(f"{CUT_ENTRY} {endpoint}", 1.0 if finish_reason == "length" else 0.0)

    def route_completion(self) -> None:
        """``POST /v1/completions`` to a route as a random end user; named after the variant that answered."""
        prompt = self.prompt()
        body = self.openai_body(prompt=prompt.text, model=self.options.model or "default",
                                user=f"user-{random.randrange(max(1, self.options.route_user_pool))}")
        if self.options.reward and prompt.ground_truth is not None:
            body["verl"] = {"ground_truth": prompt.ground_truth, "reward": self.options.reward}
        self.post_checked("/v1/completions", body, check_completion, by_variant=True)

    def post_checked(self, path: str, body: dict[str, Any], check: Any, by_variant: bool = False,
                     require_variant: bool = True, name: str | None = None) -> Any:
        """POST, validate with ``check``, record the LLM entries for a success; returns what ``check`` returned, or
        None for a failed request. ``by_variant``: name the entries after the model that answered (the
        ``X-Verl-Model`` header: ``/v1/completions @b``), which must be there unless not ``require_variant``;
        ``name``: the HTTP entry's name, when not ``path`` (an agent's turns)."""
        start = time.perf_counter()
        variant = None
        with self.client.post(path, json=body, catch_response=True, name=name) as response:
            latency = time.perf_counter() - start
            if by_variant:
                variant = response.headers.get("X-Verl-Model") if response.headers else None
                if variant:
                    response.request_meta["name"] = path + VARIANT_MARK + variant
            if response.status_code != 200:
                response.failure(error_message(response.status_code, response.content, response.error))
                return None
            try:
                result = check(response.content)
            except BadResponse as exc:
                response.failure(str(exc))
                return None
            if by_variant and require_variant and not variant:
                response.failure("no X-Verl-Model header: the server does not name the variant (not a route?)")
                return None
            response.success()
        self.record(latency, result.completion_tokens, name or path, result.finish_reason)
        if variant:
            self.fire("e2e_latency_ms" + VARIANT_MARK + variant, latency * 1000)
        return result

    # ------------------------------------------------------------ the three requests (tasks of the classes below)

    def generate(self) -> None:
        """``POST /generate`` with a text prompt."""
        body = {"prompt": self.prompt().text, "max_new_tokens": self.options.max_tokens,
                "temperature": self.options.temperature}
        self.post_checked("/generate", body, check_generate)

    def completion(self) -> None:
        """``POST /v1/completions`` with a text prompt (not streamed)."""
        self.post_checked("/v1/completions", self.openai_body(prompt=self.prompt().text), check_completion)

    def chat_stream(self) -> None:
        """``POST /v1/chat/completions`` with ``stream: true``, timing every chunk as it arrives."""
        body = self.openai_body(messages=list(self.prompt().messages), stream=True,
                                stream_options={"include_usage": True})
        start = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name=STREAM_NAME) as response:
            if response.status_code != 200:
                response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
                response.failure(error_message(response.status_code, response.content, response.error))
                return
            result, failure, size = _read_stream(response, start)
            # With stream=True Locust stops the clock at the headers; the request's time is the whole stream.
            end = time.perf_counter() - start
            response.request_meta["response_time"] = end * 1000
            response.request_meta["response_length"] = size
            if failure:
                response.failure(failure)
                return
            response.success()
        self.record(end, result.completion_tokens, STREAM_NAME, result.finish_reason)
        self.fire("ttft_ms", result.ttft_s * 1000)
        if result.mean_itl_s is not None:
            self.fire("itl_ms", result.mean_itl_s * 1000)


@dataclass
class Session:
    """What one agent session did."""

    turns: int = 0
    calls: int = 0
    tokens: int = 0
    finish_reason: str | None = None


class AgentUser(LLMUser):
    """Multi-turn tool-calling sessions (see the module docstring): the client runs the tools, as agents do."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        from verl.tools.registry import build_tool_set, load_function  # noqa: PLC0415  (agent runs only)

        names = [n.strip() for n in self.options.agent_tools.split(",") if n.strip()]
        tool_set = build_tool_set(names, None)
        self.tools = tool_set.schemas()
        self.functions = {name: load_function(tool.target) for name, tool in tool_set.tools.items()}

    @locust.task
    def session(self) -> None:
        """One conversation: turns until the model answers without a call, a turn fails, or --max-turns."""
        start = time.perf_counter()
        session = self.converse(list(self.prompt().messages))
        if session is None:
            return  # a turn failed (recorded as its HTTP entry's failure): no session entries
        self.fire("session_latency_ms", (time.perf_counter() - start) * 1000)
        self.fire_session(session)

    def converse(self, messages: list[dict[str, Any]]) -> Session | None:
        """Turns until the model answers without a call or --max-turns; None when a turn failed."""
        session = Session()
        while session.turns < self.options.max_turns:
            result = self.post_checked("/v1/chat/completions", self.openai_body(messages=messages, tools=self.tools),
                                       check_chat_turn, name=AGENT_TURN_NAME)
            if result is None:
                return None
            session.turns += 1
            session.tokens += result.completion_tokens
            session.finish_reason = result.finish_reason
            if not result.tool_calls:
                break
            session.calls += len(result.tool_calls)
            messages.append({k: v for k, v in result.message.items() if v is not None})
            messages.extend({"role": "tool", "tool_call_id": call["id"], "content": self.run_tool(call)}
                            for call in result.tool_calls)
        return session

    def fire_session(self, session: Session) -> None:
        self.fire("session_turns", session.turns)
        self.fire("session_output_tokens", session.tokens)
        self.fire("session_tool_calls", session.calls)
        self.fire(NO_TOOL_ENTRY, 0.0 if session.calls else 1.0)  # its mean: the share of sessions that made no call

    def run_tool(self, call: dict[str, Any]) -> str:
        """The tool's result, or an error message for the model (an unknown tool, bad arguments, an exception)."""
        function = call["function"]
        run = self.functions.get(function["name"])
        if run is None:
            return f"error: unknown tool '{function['name']}'"
        try:
            return str(run(**json.loads(function["arguments"])))
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's tool result, as in training
            return f"error: {type(exc).__name__}: {exc}"


class OpenLoopUser(AgentUser):
    """Open-loop load (``--user-mix open``; loadtest/open_loop.py): one user sends streamed chats at ``--rate`` on
    a schedule drawn before the first request, each in its own greenlet, never waiting for earlier answers.
    Latency (the HTTP entry's time, ``e2e_latency_ms``, ``ttft_ms``) counts from the scheduled send time, so a
    late send or a queue counts against the service; every request's record goes to
    ``<csv prefix>_requests.jsonl`` for the report's goodput and percentiles."""

    # Requests in flight at once on this user's connection pool (an overloaded service queues). No fixed_count: it
    # would spawn this user in every test, whatever its weight; the shape runs exactly one for --user-mix open.
    concurrency = 4096

    def run_schedule(self) -> None:
        if OPEN_LOOP.get("started"):  # a second user here (the master re-dispatches when a worker heals): the
            raise locust.exception.StopUser()  # schedule already ran, or runs, in this process
        OPEN_LOOP["started"] = True
        options = self.options
        if options.replay_schedule:  # the service's own traffic (verl loadtest --replay)
            rows = replay_rows(options.replay_schedule)
            offsets = [float(row["offset_s"]) for row in rows]
            requests = [{"messages": row["messages"], "max_tokens": int(row["max_tokens"])} for row in rows]
        else:
            offsets = arrival_offsets(options.rate, options.duration, options.arrival, options.burstiness,
                                      options.schedule_seed)
            rng = random.Random(options.schedule_seed)
            requests = [{"messages": list(rng.choice(STATE["prompts"]).messages)} for _ in offsets]
        records = [RequestRecord(scheduled_s=float(t)) for t in offsets]
        runner = self.environment.runner
        if isinstance(runner, WorkerRunner):  # --processes: this process sends its share of the one schedule
            share = worker_share(len(records), runner.worker_index, max(1, int(options.processes or 1)))
            records, requests = [records[i] for i in share], [requests[i] for i in share]
        pool = gevent.pool.Pool()
        start = time.perf_counter()
        for record, fields in zip(records, requests, strict=True):
            delay = start + record.scheduled_s - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            pool.spawn(self.open_session if options.open_sessions else self.open_request, record, fields, start)
        pool.join(timeout=options.request_timeout + 5)
        pool.kill()  # past the timeout: whatever still runs has failed (its record says so)
        prefix = options.open_records or options.csv_prefix
        if prefix:
            write_records(worker_records_path(prefix, runner.worker_index) if isinstance(runner, WorkerRunner)
                          else f"{prefix}{OPEN_RECORDS_SUFFIX}", records)
        OPEN_LOOP["done"] = True
        if isinstance(runner, WorkerRunner):  # the master ends the test once every worker's records are written
            runner.send_message(OPEN_DONE_MESSAGE, {"worker": runner.worker_index})
        raise locust.exception.StopUser()


    def open_session(self, record: RequestRecord, fields: dict[str, Any], start: float) -> None:
        """``--open-sessions``: the arrival starts an agent session (AgentUser's turns and client-side tools); its
        latency runs from the scheduled start to the last turn's answer (no TTFT: the turns are not streamed)."""
        record.sent_s = time.perf_counter() - start
        session = self.converse(list(fields["messages"]))
        end = time.perf_counter() - start
        if session is None:
            record.error = "a turn of the session failed (Locust's failures table has it)"
            return
        record.status, record.end_s, record.output_tokens = 200, end, session.tokens
        record.finish_reason, record.turns, record.tool_calls = session.finish_reason, session.turns, session.calls
        self.fire("session_latency_ms", (end - record.scheduled_s) * 1000)
        self.fire_session(session)

    def open_request(self, record: RequestRecord, fields: dict[str, Any], start: float) -> None:
        """One streamed chat (``fields``: its messages, and a replay's max_tokens), timed from ``start`` (the
        schedule's zero); fills ``record``."""
        body = self.openai_body(**fields, stream=True, stream_options={"include_usage": True})
        record.sent_s = time.perf_counter() - start
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name=OPEN_NAME) as response:
            record.status = response.status_code or None
            if response.status_code != 200:
                record.error = error_message(response.status_code, response.content, response.error)
                response.request_meta["response_time"] = (time.perf_counter() - start - record.scheduled_s) * 1000
                response.failure(record.error)
                return
            result, record.error, _ = _read_stream(response, start)
            end = time.perf_counter() - start
            response.request_meta["response_time"] = (end - record.scheduled_s) * 1000  # from the schedule
            if record.error:
                response.failure(record.error)
                return
            response.success()
        record.ttft_s, record.end_s = result.ttft_s, end
        record.output_tokens, record.itl_s, record.finish_reason = (result.completion_tokens, result.itl_s,
                                                                    result.finish_reason)
        self.record(end - record.scheduled_s, result.completion_tokens, OPEN_NAME, result.finish_reason)
        self.fire("ttft_ms", (result.ttft_s - record.scheduled_s) * 1000)
        self.fire("schedule_lag_ms", (record.sent_s - record.scheduled_s) * 1000)


# Only the schedule, not AgentUser's closed-loop session task too (a session is what a scheduled arrival starts).
# Set after the class: Locust's metaclass adds the base classes' tasks to a `tasks` list given in the class body,
# and with both, a user picked the closed-loop session first about half the time (a stray agent turn per run).
OpenLoopUser.tasks = [OpenLoopUser.run_schedule]


class FeedbackUser(LLMUser):
    """Real users' traffic as a service sees it: chats (to ``--model``, else the service's default route) that carry
    no answer, from a pool of end users, and — for ``--feedback-share`` of the answers, ``--feedback-delay`` seconds
    later on average while the user goes on — a thumbs up or down (``POST /v1/feedback``). The simulated user knows
    the prompt file's answer and judges with ``--feedback-rule``; the service never sees that answer, only the
    verdict, as `verl ship --reward-source feedback` reads it. All users share one API key (or address), and the
    service limits feedback per key (``feedback_rate_limit``): raise it on the service for a load test."""

    FEEDBACK_NAME = "/v1/feedback"

    @locust.task
    def chat_then_feedback(self) -> None:
        prompt = self.prompt()
        body = self.openai_body(messages=list(prompt.messages),
                                user=f"user-{random.randrange(max(1, self.options.route_user_pool))}")
        body.pop("model", None)  # no model named: the service's default route (or its only model)
        if self.options.model:
            body["model"] = self.options.model
        turn = self.post_checked("/v1/chat/completions", body, check_chat_turn, by_variant=True, require_variant=False)
        if turn is None or prompt.ground_truth is None or not turn.id or random.random() >= \
                self.options.feedback_share:
            return
        good = judge(self.options.feedback_rule, turn.message.get("content") or "", prompt.ground_truth)
        delay = random.expovariate(1.0 / self.options.feedback_delay) if self.options.feedback_delay > 0 else 0.0
        gevent.spawn_later(delay, self.send_feedback, turn.id, "up" if good else "down")

    def send_feedback(self, completion_id: str, thumbs: str) -> None:
        with self.client.post(self.FEEDBACK_NAME, json={"id": completion_id, "thumbs": thumbs, "source": "loadtest"},
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(error_message(response.status_code, response.content, response.error))
            else:
                response.success()


def judge(rule: str, text: str, ground_truth: str) -> bool:
    """The simulated user's verdict: the rule reward ``rule`` of ``text`` against the answer, >= 0.5."""
    from verl.rewards import get_reward_fn  # noqa: PLC0415  (feedback runs only)

    value = get_reward_fn(rule)("loadtest", text, str(ground_truth))
    return float(value["score"] if isinstance(value, dict) else value) >= 0.5


class GenerateUser(LLMUser):
    """Sends only ``POST /generate``."""

    tasks = [LLMUser.generate]


class CompletionUser(LLMUser):
    """Sends only ``POST /v1/completions``."""

    tasks = [LLMUser.completion]


class ChatStreamUser(LLMUser):
    """Sends only streamed ``POST /v1/chat/completions``."""

    tasks = [LLMUser.chat_stream]


class MixedUser(LLMUser):
    """Each request picks generate / completion / streamed chat by the ``--*-weight`` options.

    The default (``--user-mix mixed``): at 1 or 2 users every level still sends the whole mix, where one class
    per endpoint would send only the first class's requests (Locust hands out classes, not requests, by weight).
    """

    tasks = [LLMUser.generate, LLMUser.completion, LLMUser.chat_stream]  # reweighted by apply_options


class RouteUser(LLMUser):
    """Sends ``POST /v1/completions`` to a route (``--model``) and records which variant answered."""

    tasks = [LLMUser.route_completion]


def _read_stream(response: Any, start: float) -> tuple[Any, str | None, int]:
    """Read a chat stream to its end, each event timed from ``start``: (the checked stream or None, the failure or
    None, the bytes read)."""
    reader, payloads, size = SSEReader(), [], 0
    try:
        for line in _lines(response):
            now = time.perf_counter() - start
            size += len(line)
            payloads.extend((now, data) for data in reader.feed(line))
        return check_chat_stream(payloads), None, size
    except BadResponse as exc:
        return None, str(exc), size
    except Exception as exc:  # noqa: BLE001 - a broken connection mid-stream is a failed request
        return None, f"stream broken: {type(exc).__name__}: {exc}", size


def _lines(response: Any) -> Iterator[bytes]:
    """The body line by line, each as soon as its newline arrives.

    Not ``iter_content``/``iter_lines``: geventhttpclient's ``read(n)`` waits until ``n`` bytes (or the end) are
    in, so several SSE events of a fast model arrive as one chunk and every token would get the same timestamp.
    ``readline`` returns as soon as the separator is buffered.
    """
    raw = response._response  # geventhttpclient's HTTPSocketPoolResponse behind Locust's FastResponse
    while line := raw.readline(b"\n"):
        yield line


# ---------------------------------------------------------------- load shape


def open_loop_finished(workers: int, options: Any) -> float | None:
    """On the master: when (``time.monotonic()``) all ``workers`` had sent OPEN_DONE_MESSAGE, else None. A worker
    silent past the schedule, the request timeout and OPEN_DONE_GRACE_S is given up on (logged; the report then
    names its missing share), so a dead worker cannot hold the test open."""
    if "finished_at" in OPEN_LOOP:
        return OPEN_LOOP["finished_at"]
    now = time.monotonic()
    done = OPEN_LOOP.get("workers_done", set())
    give_up_at = OPEN_LOOP.setdefault("give_up_at", now + schedule_span_s(options) + options.request_timeout
                                      + OPEN_DONE_GRACE_S)
    if len(done) >= workers:
        OPEN_LOOP["finished_at"] = now
    elif now > give_up_at:
        missing = sorted(set(range(workers)) - done)
        log.error("loadtest: worker process(es) %s never reported their open-loop share done; ending the test", missing)
        OPEN_LOOP["finished_at"] = now
    return OPEN_LOOP.get("finished_at")


def replay_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a replay schedule (``verl loadtest --replay`` writes it: offset_s, messages, max_tokens)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def schedule_span_s(options: Any) -> float:
    """How long the open-loop schedule runs: ``--duration``, or a replay's last offset."""
    if not options.replay_schedule:
        return float(options.duration)
    return max((float(row["offset_s"]) for row in replay_rows(options.replay_schedule)), default=0.0)


class StepShape(LoadTestShape):
    """Steps through ``StepPlan`` levels, spawning each level's new users within about a second.

    With ``--load-shape fixed`` it runs the plain ``-u/-r/-t`` test instead, so one locustfile serves both uses
    (Locust always runs a shape class when the locustfile has one).
    """

    use_common_options = True  # we read -u/-r for the fixed mode, so Locust need not warn they are ignored

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if not STATE["ready"] or self.waiting_for_first_users():
            # test_start (waiting for /health, loading prompts) runs beside this greenlet: hold the clock at 0.
            self.reset_time()
        if getattr(options, "user_mix", None) == "open":
            return self.open_loop_tick(options)
        if options.load_shape == "fixed":
            # Headless Locust waits for a shape to finish before it arms -t, so the shape enforces -t itself.
            if options.run_time and self.get_run_time() >= options.run_time:
                return None
            return int(options.num_users or 1), float(options.spawn_rate or 1)
        plan = StepPlan.from_options(options)
        users = plan.users_at(self.get_run_time())
        if users is None:
            # With worker processes: zero users for a few report intervals before the end, so every worker's last
            # requests reach the master in a regular report (on quit Locust waits only 0.5 s for a final one, and a
            # busy worker's was lost: 49 answered requests missing from a fleet test's counts).
            if isinstance(self.runner, MasterRunner) and self.get_run_time() < plan.duration_s + WORKER_DRAIN_S:
                return 0, 100.0
            return None
        return users, float(users)  # spawn a whole level at once: the level's time is for measuring, not ramping

    def open_loop_tick(self, options: Any) -> tuple[int, float] | None:
        """One user runs the schedule and the test ends with it. With ``--processes N`` the master starts one user
        on each of the N workers (each sends its share) and ends the test a few report intervals after the last
        worker said its records are written, so every worker's final stats arrive (as for the user steps).

        Not on the workers' user counts: a busy worker that misses heartbeats counts 0 users on the master for a
        while, and the master used to end the test then, killing that worker before it wrote its records."""
        if not isinstance(self.runner, MasterRunner):
            return None if OPEN_LOOP.get("done") else (1, 1.0)
        workers = max(1, int(options.processes or 1))
        if STATE.get("first_users_running"):
            finished = open_loop_finished(workers, options)
            if finished is not None:
                return (0, 100.0) if time.monotonic() - finished < WORKER_DRAIN_S else None
        return workers, float(workers)

    def waiting_for_first_users(self) -> bool:
        """True until the first users run (at most ``FIRST_USERS_WAIT_S``). With ``--processes`` the workers start
        their users only after their own test_start (the /health wait, loading prompts: seconds on a busy box),
        which the master does not wait for; the first level's time, and so its percentile window, starts then."""
        if STATE.get("first_users_running"):
            return False
        since = STATE.setdefault("first_users_wait_from", time.monotonic())
        if self.runner.user_count > 0 or time.monotonic() - since > FIRST_USERS_WAIT_S:
            STATE["first_users_running"] = True
            return False
        return True
