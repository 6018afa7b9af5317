"""The engine interface the API layer talks to, and the text-side helpers every engine shares.

An engine turns one sequence request (prompt token ids + sampling options) into an async stream of
``EngineOutput`` deltas. The API layer owns everything HTTP: validation, admission (queue bound), n-expansion,
timeouts, metrics. Closing the stream early (client gone, timeout) aborts the sequence and frees its slot.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


class EngineError(Exception):
    """The engine failed (not the request's fault): the API answers 500/503."""


class RequestFailedError(EngineError):
    """Computing one request (or the batch it was in) failed; the engine goes on serving the others."""


class EngineDeadError(EngineError):
    """The engine's worker is gone; /health reports it and every request gets 503."""


@dataclass
class SamplingOptions:
    """Per-sequence sampling and stopping. ``temperature == 0`` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Penalties as vLLM defines them, applied to the logits before temperature (and before a greedy argmax):
    # presence/frequency subtract per generated occurrence; repetition divides positive logits (multiplies
    # negative ones) of every token seen in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    # None: no log-probs. k >= 0: each generated token's log-prob and the k most likely alternatives, from the
    # model's raw distribution (before penalties and temperature: vLLM's default ``raw_logprobs`` mode).
    logprobs: int | None = None
    # The same for the prompt's tokens (the first has none), sent with the first output.
    prompt_logprobs: int | None = None
    # Constrained decoding: a Lark grammar (llguidance's dialect, JSON schemas embedded) every sampled token must
    # keep satisfiable; the sequence ends when the grammar is complete (serve/constrained.py).
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


@dataclass
class TokenLogprob:
    """One position: the chosen token's log-prob and the ``top`` alternatives as (token id, log-prob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float = 0.0
    # False: the caller only needs the final result, so an engine may send one aggregated output (with
    # ``token_times``) instead of a delta per token -- far less event-loop work for non-streamed requests.
    stream: bool = True
    # The LoRA adapter (as registered with ``Engine.add_adapter``) to generate with; None: the base weights.
    adapter: str | None = None
    # Training traffic (an episode's call): the transformers engine gives it at most training_max_slots_share of
    # its rows, so user requests never wait behind it for a row.
    training: bool = False


@dataclass
class EngineOutput:
    """What one sequence produced since its previous output (a delta)."""

    text: str
    token_ids: list[int]
    num_generated_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    scheduled_time: float | None = None  # perf_counter() when the sequence left the queue (first output only)
    # Aggregated outputs only: perf_counter() time of each generated token (or an even spread between the first
    # and last when the engine knows only those), so latency metrics stay exact without per-token deltas.
    token_times: list[float] | None = None
    # When asked for (SamplingOptions.logprobs): one entry per id in ``token_ids``.
    logprobs: list[TokenLogprob] | None = None
    # When asked for (SamplingOptions.prompt_logprobs), first output only: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The version of the weights that sampled each id in ``token_ids`` (engines with in-place weight updates).
    weight_versions: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine(abc.ABC):
    """A generation backend. Subclasses register themselves with ``serve.engines.ENGINES.register``."""

    name: str = "base"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int, model_path: str):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_path = model_path
        # Why this engine cannot decode under a grammar (tool_choice required/named, response_format), or None.
        self.grammar_problem: str | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights / start workers. Runs once, before the first ``generate``."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas for one sequence; the last one has ``finish_reason`` set. Closing the iterator aborts."""

    @abc.abstractmethod
    async def shutdown(self, timeout: float) -> None:
        """Let running sequences finish for up to ``timeout`` seconds, abort the rest, release resources."""

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """False once the worker died; the service then answers 503."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Sequences currently in the batch."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Sequences admitted but not yet in the batch."""

    @property
    def kv_cache_usage(self) -> float:
        """The share of the engine's KV-cache capacity that holds tokens, in [0, 1] (vLLM's
        ``kv_cache_usage_perc``: 1.0 is full); NaN where an engine cannot say."""
        return float("nan")

    # ------------------------------------------------------------ LoRA adapters (engines that serve several)

    supports_adapters: bool = False

    async def add_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in ``path`` as ``name``, without pausing requests in flight."""
        raise EngineError(f"the {self.name} engine does not serve LoRA adapters")

    async def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name``; the caller makes sure no request still uses it."""
        raise EngineError(f"the {self.name} engine does not serve LoRA adapters")

    # ------------------------------------------------------------ in-place weights, pause, sleep (vLLM's RL endpoints)

    supports_weight_updates: bool = False

    def _no_weight_updates(self, what: str) -> EngineError:
        return EngineError(f"the {self.name} engine does not {what} in place here; serve with the transformers "
                           "engine (VERL_SERVE_ENGINE=transformers), or load the new weights as a model "
                           "(POST /admin/models) and move the route")

    async def update_weights(self, adapter: str | None, path: str, version: int) -> None:
        """Replace the full model's weights (``adapter`` None) or an adapter's with those in directory ``path``,
        without restarting or failing requests; tokens sampled afterwards carry ``version``."""
        raise self._no_weight_updates("update weights")

    async def check_weights(self, adapter: str | None, path: str) -> None:
        """Raise ``EngineError`` where ``update_weights(adapter, path, ...)`` would refuse, changing nothing (a fleet
        replica's prepare phase: every replica checks before any applies)."""
        raise self._no_weight_updates("update weights")

    async def reset_prefix_cache(self) -> None:
        """Drop whatever prompt prefixes the engine keeps across requests (nothing, unless it keeps some)."""
        return None

    def check_sleep(self, level: int, mode: str) -> None:
        """Raise ``EngineError`` where ``sleep(level, mode)`` would refuse."""
        raise self._no_weight_updates("sleep")

    def weight_version(self, adapter: str | None) -> int:
        """The version of the weights that sample for ``adapter`` (None: the full model) now."""
        return 0

    async def pause(self, mode: str) -> None:
        """Stop generating: ``abort`` ends every sequence, ``wait`` returns once the running ones finished,
        ``keep`` freezes them where they are; new requests queue until ``resume``."""
        raise self._no_weight_updates("pause")

    async def resume(self) -> None:
        raise self._no_weight_updates("pause")

    @property
    def paused(self) -> bool:
        return False

    async def sleep(self, level: int, mode: str) -> None:
        """Pause (``mode``) and release memory: level 0 nothing more, 1 the caches."""
        raise self._no_weight_updates("sleep")

    async def wake_up(self) -> None:
        raise self._no_weight_updates("sleep")

    @property
    def sleeping(self) -> bool:
        return False

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids


class StopChecker:
    """Incremental detokenisation with stop strings, shared by engines that do not stop on strings themselves.

    The generated ids are decoded as a whole each time (so multi-token characters and BPE merges come out right),
    and text that could still be the start of a stop string is held back until it is decided. A trailing
    U+FFFD means an incomplete UTF-8 sequence: it is held back too.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def update(self, token_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Decode ``token_ids`` (all generated so far): returns (new text to emit, matched stop string or None)."""
        self.text = self.decode(token_ids)
        if self.stop:
            start = max(0, self.emitted - self.holdback)
            best: tuple[int, str] | None = None
            for s in self.stop:
                pos = self.text.find(s, start)
                if pos != -1 and (best is None or pos < best[0]):
                    best = (pos, s)
            if best is not None:
                return self._emit_until(best[0]), best[1]
        if final:
            return self._emit_until(len(self.text)), None
        safe = len(self.text) - self.holdback
        if self.text.endswith("\ufffd"):
            safe = min(safe, len(self.text) - 1)
        return self._emit_until(safe), None

    def _emit_until(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
