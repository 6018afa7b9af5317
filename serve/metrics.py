"""Prometheus metrics with vLLM's names under a ``verl:`` prefix, and vLLM's own families under ``vllm:`` as well
(``with_vllm_names``), so a vLLM dashboard reads the page unchanged.

Each app gets its own ``CollectorRegistry`` (several apps in one process, as in tests, never collide).
Latency metrics are measured by the API layer from the engine's output stream, so the transformers and vLLM
engines report the same quantities the same way:

- ``time_to_first_token_seconds``: admission -> first generated token of a sequence;
- ``inter_token_latency_seconds``: gap between consecutive outputs of a sequence;
- ``e2e_request_latency_seconds``: admission -> last output of a sequence;
- ``request_queue_time_seconds``: admission -> the engine scheduled the sequence (engines that report it).

Token counters and ``request_success_total`` count sequences (a request with ``n=4`` is four sequences);
``http_requests_total{path,status}`` counts HTTP requests by outcome (200, 400, 429, 503, ...).

A fleet (``verl serve --replicas``) answers ``/metrics`` on any replica with every live replica's series, each
labelled ``replica`` (``merge_expositions``): replicas ship their page to the control plane with their polls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# `*_created` timestamp series double the exposition for no use to Prometheus (vLLM turns them off too).
disable_created_metrics()

PREFIX = "verl:"
# Buckets as vLLM uses them, extended downwards: a small model on CPU produces tokens every few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
REWARD_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """The service's metric families; gauges read live values through callbacks at scrape time."""

    def __init__(self, model_name: str, engine_name: str = "unknown", version: str = "0"):
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self.running = Gauge(PREFIX + "num_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting for a batch slot.", labels, registry=r)
        self.kv_cache = Gauge(PREFIX + "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent (of the "
                              "engine's max_batch_size x max_model_len token positions on the transformers engine).",
                              labels, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed (per sequence).", labels,
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                               [*labels, "finished_reason"], registry=r)
        self.http = Counter(PREFIX + "http_requests", "HTTP requests by path and status code.",
                            ["path", "method", "status"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before generation, by reason.",
                                [*labels, "reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Admission to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between consecutive outputs.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Admission to last token.", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Admission to scheduling.", labels,
                                    buckets=TTFT_BUCKETS, registry=r)
        self.prompt_hist = Histogram(PREFIX + "request_prompt_tokens", "Prompt length per sequence.", labels,
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.generation_hist = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per sequence.",
                                         labels, buckets=TOKEN_BUCKETS, registry=r)
        self.healthy = Gauge(PREFIX + "engine_healthy", "1 when the engine serves requests, else 0.", labels,
                             registry=r)
        self.errors = Counter(PREFIX + "request_errors", "Sequences that failed in the engine (the client got an "
                              "error), per model.", labels, registry=r)
        self.reward = Histogram(PREFIX + "request_reward", "Rule reward of responses whose request named one "
                                "(the `verl` extension field), per model.", labels, buckets=REWARD_BUCKETS,
                                registry=r)
        self.feedback = Counter(PREFIX + "feedback", "POST /v1/feedback calls by the answering model (unknown: an id "
                                "not found) and outcome (recorded, duplicate, conflict, unknown_id, expired, "
                                "rate_limited, invalid).", [*labels, "outcome"], registry=r)
        self.feedback_score = Histogram(PREFIX + "feedback_score", "Users' feedback scores (thumbs up 1, down 0), "
                                        "per answering model.", labels, buckets=REWARD_BUCKETS, registry=r)
        self.live_scores = Counter(PREFIX + "live_scores", "Answers drawn for live scoring (score_traffic) by the "
                                   "answering model and outcome (scored, failed, dropped: the queue was full).",
                                   [*labels, "outcome"], registry=r)
        self.live_score = Histogram(PREFIX + "live_score", "The reward model's scores of live answers, per answering "
                                    "model.", labels, buckets=REWARD_BUCKETS, registry=r)
        self.info = Gauge(PREFIX + "server_info", "Constant 1, labelled with what is served.",
                          ["model_name", "engine", "version"], registry=r)
        self.model_name = model_name
        self.set_engine(engine_name, version)

    def set_engine(self, engine_name: str, version: str) -> None:
        self.info.clear()
        self.info.labels(self.model_name, engine_name, version).set(1)

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float], kv_cache: Callable[[], float],
                    healthy: Callable[[], float]) -> None:
        self.running.labels(self.model_name).set_function(running)
        self.waiting.labels(self.model_name).set_function(waiting)
        self.kv_cache.labels(self.model_name).set_function(kv_cache)
        self.healthy.labels(self.model_name).set_function(healthy)

    def exposition(self) -> bytes:
        """The Prometheus page: every family under ``verl:``, and the ones vLLM has under ``vllm:`` too."""
        return with_vllm_names(generate_latest(self.registry))


# The families vLLM's server exports under these names (and the `model_name` label), which its Grafana dashboards
# read: the page repeats them under `vllm:` so such a dashboard works unchanged (docs/serving.md).
VLLM_FAMILIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                 "generation_tokens", "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens")
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def with_vllm_names(page: bytes) -> bytes:
    """``page`` and, after it, each of its ``verl:`` lines of a ``VLLM_FAMILIES`` family renamed to ``vllm:``."""
    families = {f"{PREFIX}{family}{suffix}" for family in VLLM_FAMILIES for suffix in _SUFFIXES}
    copies = []
    for line in page.decode().splitlines():
        text = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        name = text.split("{", 1)[0].split(" ", 1)[0]
        if name in families:
            copies.append(line.replace(PREFIX, "vllm:", 1))
    return page + "".join(c + "\n" for c in copies).encode()


class SequenceTimer:
    """Feeds one sequence's outputs into the histograms and counters."""

    __slots__ = ("metrics", "arrival", "last", "tokens", "label", "ttft")

    def __init__(self, metrics: ServeMetrics, arrival: float, prompt_tokens: int, label: str | None = None):
        self.metrics, self.arrival, self.last, self.tokens = metrics, arrival, None, 0
        self.label = label or metrics.model_name  # the model that answers (one of several in a service)
        self.ttft: float | None = None
        metrics.prompt_tokens.labels(self.label).inc(prompt_tokens)
        metrics.prompt_hist.labels(self.label).observe(prompt_tokens)

    def on_output(self, now: float, new_tokens: int, scheduled_time: float | None,
                  token_times: list[float] | None = None) -> None:
        """A delta arrived at ``now`` with ``new_tokens`` tokens (or an aggregated output with ``token_times``)."""
        m = self.metrics
        if scheduled_time is not None:
            m.queue_time.labels(self.label).observe(max(0.0, scheduled_time - self.arrival))
        if token_times is not None:
            for t in token_times:
                self.on_output(t, 1, None)
            return
        if new_tokens:
            if self.last is None:
                self.ttft = now - self.arrival
                m.ttft.labels(self.label).observe(self.ttft)
            else:
                m.itl.labels(self.label).observe(now - self.last)
            self.last = now
            self.tokens += new_tokens
            m.generation_tokens.labels(self.label).inc(new_tokens)

    def on_finish(self, now: float, finish_reason: str) -> None:
        m = self.metrics
        m.e2e.labels(self.label).observe(now - self.arrival)
        m.success.labels(self.label, finish_reason).inc()
        m.generation_hist.labels(self.label).observe(self.tokens)


class _Merged:
    """A collector yielding ready-made families (the merged fleet page)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(pages: Mapping[str, str]) -> bytes:
    """One Prometheus page from several replicas' pages (``{replica: page}``): every sample gains a ``replica``
    label, and each family is described once. Summing a series over ``replica`` gives the fleet's total."""
    families: dict[str, Metric] = {}
    for replica, page in sorted(pages.items()):
        for family in text_string_to_metric_families(page):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                  for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)
