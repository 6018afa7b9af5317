"""The ``transformers`` engine: step-level continuous batching over a plain HF causal LM with a KV cache.

Why our own scheduler and not transformers' ``ContinuousBatchingManager`` (``model.generate_batch``, 5.19)?
Measured here on the 25M-parameter benchmark model (one CPU thread, 32 prompts x 32 tokens): transformers'
continuous batching ran at ~12 tokens/s (paged attention over a CPU-unfriendly path, plus warm-up), while one
batched ``model.generate`` call ran at ~440 tokens/s. It also has no per-request stop strings and no per-request
seeds. So this engine is a small scheduler of ours; ``model.generate`` is not used because it cannot admit new
requests into a running batch or stop rows independently.

How it works (one background thread owns the model):

- Running sequences are rows of one batch whose KV cache is a ``DynamicCache`` kept **right-aligned**: row ``i``
  occupies the last ``len_i`` columns, the columns before it are padding masked out by ``attention_mask``.
  Position ids are per row (the count of real tokens), so padding never shifts RoPE positions.
- Each iteration: admit waiting sequences into free slots (one batched prefill of their prompts, left-padded; the
  new cache rows are left-padded to the running length and concatenated), then one decode step for every row,
  then per-row sampling (temperature / top-k / top-p, a private ``torch.Generator`` per seeded request so a seed
  reproduces the same text whatever else is in the batch), stop checks (eos, stop token ids, stop strings,
  ``max_tokens``, context length) and delivery of text deltas to each request's asyncio queue.
- Finished or aborted rows (client gone, timeout) are dropped from the cache before the next step, and columns
  that became padding for every row are trimmed, so the cache is as long as the longest live row.
- The cache layers append in place into spare capacity (``GrowingLayer`` in verl/models/kv_cache.py) instead of
  ``DynamicLayer``'s ``torch.cat`` of the whole cache per step; with that, 32 requests x 100 tokens run at least
  as fast as one fixed ``model.generate`` batch of 32 (measured 489 vs 467 tokens/s), while rows come and go.
- LoRA adapters (several checkpoints of one run over one base in memory) are PEFT adapters on the model; every
  forward passes ``adapter_names`` per row, so requests for different adapters and for the base share one decode
  step (PEFT runs each adapter's low-rank product on its rows only). Adapters are loaded and unloaded on the engine
  thread between two steps, so requests in flight never pause or fail.
- New weights arrive in place (``update_weights``: a safetensors or LoRA directory, read off the engine thread and
  copied between two steps, serve/engines/weights.py), and the loop pauses and resumes with vLLM's modes; every
  token carries the version of the weights that sampled it.
- Non-streamed requests get one aggregated output at the end (with per-token times for the latency metrics),
  and their text is decoded once unless stop strings need it per step.

This module is the ``Engine`` interface (the event loop's side); ``step_loop.py`` is the engine thread and
``rows.py`` a running sequence with the sampler that picks each row's next token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.utils import logging as hf_logging

from serve.constrained import GrammarMatcher, GrammarTokenizer
from serve.engines.base import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineOutput,
    EngineRequest,
    RequestFailedError,
    StopChecker,
)
from serve.engines.rows import RunningSequence
from serve.engines.step_loop import PAUSE_MODES, StepLoop
from serve.engines.weights import read_update
from serve.settings import ServeSettings
from verl.models.loader import load_causal_lm, pick_device
from verl.utils.allocator import keep_freed_memory


class TransformersEngine(Engine):
    """Continuous batching over ``AutoModelForCausalLM`` (any model whose cache is a plain ``DynamicCache``): the
    ``Engine`` interface on the event loop, over a ``StepLoop`` on its own thread."""

    name = "transformers"
    supports_adapters = True
    supports_weight_updates = True

    def __init__(self, settings: ServeSettings, tokenizer: PreTrainedTokenizerBase, model_path: str,
                 max_model_len: int):
        super().__init__(tokenizer, max_model_len, model_path)
        self.settings = settings
        self.steps = StepLoop(settings, tokenizer, max_model_len)
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._eos_ids = self.eos_token_ids()
        self._grammar_lock = threading.Lock()
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built by the first constrained request
        self._sleeping = False

    # The step loop's model and counters, for metrics and tests.
    model = property(lambda self: self.steps.model)
    adapters = property(lambda self: self.steps.adapters)
    mixed_adapter_steps = property(lambda self: self.steps.mixed_adapter_steps)
    shared_prefix_tokens = property(lambda self: self.steps.shared_prefix_tokens)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.steps.loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self.steps.run, name="verl-serve-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        hf_logging.disable_progress_bar()  # a server log wants one line per load, not a progress bar
        torch.set_num_threads(self.settings.torch_threads)
        keep_freed_memory()  # recycle activation-sized blocks from the heap (verl/utils/allocator.py)
        self.steps.device = pick_device(self.settings.device)
        model = load_causal_lm(self.model_path, dtype=self.settings.dtype, device=self.steps.device,
                               trust_remote_code=self.settings.trust_remote_code)
        self.steps.model = model.eval().requires_grad_(False)  # never trained here: frozen layers use packed weights
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self._eos_ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos])}
        probe = DynamicCache(config=model.config)
        if not all(type(layer) is DynamicLayer for layer in probe.layers):
            kinds = sorted({type(layer).__name__ for layer in probe.layers})
            raise EngineError(
                f"the transformers engine batches plain DynamicCache layers only; this model uses {kinds}. "
                "Serve it with VERL_SERVE_ENGINE=vllm."
            )
        # One forward now so the first request does not pay for lazy initialisation.
        with torch.inference_mode():
            ids = torch.tensor([[self.tokenizer.bos_token_id or 0]], device=self.steps.device)
            model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config))

    async def add_adapter(self, name: str, path: str) -> None:
        await self._on_engine_thread(lambda: self.steps.weights.load_adapter(name, path))

    async def remove_adapter(self, name: str) -> None:
        await self._on_engine_thread(lambda: self.steps.weights.unload_adapter(name))

    # ---------------------------------------------------------------- in-place weights, pause, sleep

    async def update_weights(self, adapter: str | None, path: str, version: int) -> None:
        update = await asyncio.to_thread(read_update, path)  # read and parse off the engine thread
        await self._on_engine_thread(lambda: self.steps.weights.update(adapter, update, version))

    async def check_weights(self, adapter: str | None, path: str) -> None:
        update = await asyncio.to_thread(read_update, path)
        await self._on_engine_thread(lambda: self.steps.weights.check(adapter, update))

    def weight_version(self, adapter: str | None) -> int:
        return self.steps.weights.version_of(adapter)

    async def reset_prefix_cache(self) -> None:
        await self._on_engine_thread(self.steps.prefixes.clear)

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"unknown pause mode '{mode}': use one of {', '.join(PAUSE_MODES)}")
        await self._on_engine_thread(lambda: self.steps.pause(mode))
        while mode == "wait" and len(self.steps.batch) and self.is_healthy():  # the running rows decode to the end
            await asyncio.sleep(0.01)

    async def resume(self) -> None:
        if self._sleeping:
            raise EngineError("the engine is asleep: POST /wake_up resumes it")
        await self._on_engine_thread(self.steps.resume)

    @property
    def paused(self) -> bool:
        return self.steps.pause_mode is not None

    def check_sleep(self, level: int, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"unknown pause mode '{mode}': use one of {', '.join(PAUSE_MODES)}")
        if level not in (0, 1):
            raise EngineError(f"sleep level {level} is not served: on CPU the weights have nowhere to be offloaded "
                              "to, so the transformers engine keeps them (level 1 releases its KV cache and packed "
                              "weight copies; level 0 only pauses)")
        if level >= 1 and mode == "keep":
            raise EngineError("sleep level 1 releases the KV cache that pause mode keep would keep: use mode abort "
                              "or wait (or level 0)")

    async def sleep(self, level: int, mode: str) -> None:
        self.check_sleep(level, mode)
        await self.pause(mode)
        if level >= 1:
            await self._on_engine_thread(self.steps.release_caches)
        self._sleeping = True

    async def wake_up(self) -> None:
        self._sleeping = False
        await self._on_engine_thread(self.steps.resume)

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    async def _on_engine_thread(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the engine thread between two steps (the model is never changed under a forward)."""
        if not self.is_healthy():
            raise EngineError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.steps.cv:
            self.steps.control.append((work, future))
            self.steps.cv.notify()
        await asyncio.wrap_future(future)

    async def shutdown(self, timeout: float) -> None:
        self._accepting = False
        deadline = time.monotonic() + timeout
        while (self.num_running or self.num_waiting) and time.monotonic() < deadline and self.steps.dead is None:
            await asyncio.sleep(0.05)
        with self.steps.cv:
            self.steps.stopping = True
            self.steps.cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def is_healthy(self) -> bool:
        return self.steps.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.steps.batch) + self.steps.prefilling

    @property
    def num_waiting(self) -> int:
        return len(self.steps.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Cached token positions of the running rows over ``max_batch_size × max_model_len``: vLLM's block usage
        with a block of one token (padding columns hold no token and are not counted; prefills in flight are not
        yet in the cache)."""
        # Read off the step loop's thread without its lock: a scrape during a compaction may count a moved row
        # twice, for that scrape only.
        mask = self.steps.batch.mask
        return float(mask.sum()) / (self.steps.max_batch_size * self.max_model_len)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self.steps.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.steps.dead}")
        if not self._accepting:
            raise EngineError("the server is shutting down")
        sampling = request.sampling
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self._eos_ids)
        seq = RunningSequence(request=request, queue=asyncio.Queue(), generator=generator, stop_ids=stop_ids,
                   stop=StopChecker(self._decode, sampling.stop))
        if sampling.grammar is not None:
            seq.matcher = await asyncio.to_thread(self._grammar_matcher, sampling.grammar)
        with self.steps.cv:
            self.steps.waiting.append(seq)
            self.steps.cv.notify()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not seq.finished:
                self._abort(seq)

    def _grammar_matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher for ``grammar``; llguidance's tokenizer view is built on first use (off the loop)."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, sorted(self._eos_ids))
        try:
            return self._grammar_tokenizer.matcher(grammar)
        except ValueError as exc:
            raise RequestFailedError(f"the output grammar does not compile: {exc}") from None

    def _abort(self, seq: RunningSequence) -> None:
        """Called when the consumer stopped listening: free the slot at the next step (or the queue place now)."""
        seq.aborted = True
        with self.steps.cv:
            # Already running if it is not in the queue: the engine thread drops it before its next forward.
            with contextlib.suppress(ValueError):
                self.steps.waiting.remove(seq)
            self.steps.cv.notify()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

