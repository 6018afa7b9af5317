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
- Non-streamed requests get one aggregated output at the end (with per-token times for the latency metrics),
  and their text is decoded once unless stop strings need it per step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase
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
    SamplingOptions,
    StopChecker,
    TokenLogprob,
)
from serve.settings import ServeSettings
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.kv_cache import GrowingLayer, Joining, RowBatch, left_padded, new_growing_cache
from verl.models.loader import load_causal_lm, pick_device
from verl.models.packed_linear import packed_weights
from verl.rollout.sampler import draw_categorical
from verl.utils.allocator import keep_freed_memory

log = logging.getLogger("uvicorn.error.serve.engine")  # shows in the uvicorn server log
FAILURES_BEFORE_DEAD = 8  # consecutive requests that fail alone before the engine declares itself dead


@dataclass(eq=False)
class _Seq:
    """One sequence's state; fields written by the engine thread, ``aborted`` also by the event loop."""

    request: EngineRequest
    queue: asyncio.Queue
    stop: StopChecker
    stop_ids: set[int]
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    scheduled_time: float | None = None
    aborted: bool = False
    finished: bool = False
    # Non-streamed sequences: text and token times collected here and delivered once, at the end.
    text_parts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # non-streamed sequences that asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # computed at admission when asked for
    failure: BaseException | None = None  # this sequence alone could not be computed (see _sample)
    matcher: GrammarMatcher | None = None  # constrained decoding: the tokens its grammar allows next

    @property
    def sampling(self) -> SamplingOptions:
        return self.request.sampling


class TransformersEngine(Engine):
    """Continuous batching over ``AutoModelForCausalLM`` (any model whose cache is a plain ``DynamicCache``)."""

    name = "transformers"
    supports_adapters = True
    BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch

    def __init__(self, settings: ServeSettings, tokenizer: PreTrainedTokenizerBase, model_path: str,
                 max_model_len: int):
        super().__init__(tokenizer, max_model_len, model_path)
        self.settings = settings
        self.max_batch_size = settings.max_batch_size
        self.model: PreTrainedModel | None = None
        self.device = torch.device("cpu")
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._batch = RowBatch()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._accepting = True
        self._dead: BaseException | None = None
        self._failures_in_a_row = 0
        self._sampler = torch.Generator().manual_seed(settings.seed)
        self._prefilling = 0
        self._admitted: list[_Seq] = []  # taken from the queue for the prefill in progress
        self._eos_ids = self.eos_token_ids()
        self._grammar_lock = threading.Lock()
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built by the first constrained request
        self._peft: PeftModel | None = None  # set once an adapter is loaded; wraps self.model
        self.mixed_adapter_steps = 0  # forwards whose rows used more than one adapter (or adapter and base)
        self.shared_prefix_tokens = 0  # prompt tokens not recomputed: prefixes shared within a prefill
        self._control: collections.deque[tuple[Callable[[], None], concurrent.futures.Future]] = collections.deque()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="verl-serve-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        hf_logging.disable_progress_bar()  # a server log wants one line per load, not a progress bar
        torch.set_num_threads(self.settings.torch_threads)
        keep_freed_memory()  # recycle activation-sized blocks from the heap (verl/utils/allocator.py)
        self.device = pick_device(self.settings.device)
        model = load_causal_lm(self.model_path, dtype=self.settings.dtype, device=self.device,
                               trust_remote_code=self.settings.trust_remote_code)
        self.model = model.eval().requires_grad_(False)  # never trained here: frozen layers use packed weights
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
            ids = torch.tensor([[self.tokenizer.bos_token_id or 0]], device=self.device)
            model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config))

    # ---------------------------------------------------------------- LoRA adapters

    @property
    def adapters(self) -> list[str]:
        return list(self._peft.peft_config) if self._peft is not None else []

    async def add_adapter(self, name: str, path: str) -> None:
        await self._on_engine_thread(lambda: self._load_adapter(name, path))

    async def remove_adapter(self, name: str) -> None:
        await self._on_engine_thread(lambda: self._unload_adapter(name))

    async def _on_engine_thread(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the engine thread between two steps (the model is never changed under a forward)."""
        if not self.is_healthy():
            raise EngineError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._control.append((work, future))
            self._cv.notify()
        await asyncio.wrap_future(future)

    def _load_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise EngineError(f"an adapter named '{name}' is already loaded")
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
        else:
            self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
        self._peft.eval()

    def _unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(f"no adapter named '{name}' is loaded")
        if len(self.adapters) == 1:
            self.model = self._peft.unload()  # the last one: back to the plain model, no PEFT hooks per forward
            self._peft = None
        else:
            self._peft.delete_adapter(name)

    def _forward(self, rows: list[_Seq], **kwargs):
        """The model's forward for ``rows`` (one batch row each), each with its own adapter when any is loaded;
        frozen linear layers multiply by oneDNN-packed weights (verl/models/packed_linear.py) and the decoder layers'
        small operations run fused (verl/models/fused_decoder.py)."""
        with packed_weights(), fused_decoder_layers():
            if self._peft is None:
                return self.model(**kwargs)
            names = [row.request.adapter or self.BASE_ADAPTER for row in rows]
            if len(set(names)) > 1:
                self.mixed_adapter_steps += 1
            return self._peft(**kwargs, adapter_names=names)

    def _run_control(self) -> None:
        while True:
            with self._cv:
                if not self._control:
                    return
                work, future = self._control.popleft()
            try:
                work()
            except Exception as exc:  # a bad adapter fails its load call, never the engine
                future.set_exception(exc)
            else:
                future.set_result(None)

    async def shutdown(self, timeout: float) -> None:
        self._accepting = False
        deadline = time.monotonic() + timeout
        while (self.num_running or self.num_waiting) and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self._batch) + self._prefilling

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---------------------------------------------------------------- requests (event-loop side)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineError("the server is shutting down")
        sampling = request.sampling
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self._eos_ids)
        seq = _Seq(request=request, queue=asyncio.Queue(), generator=generator, stop_ids=stop_ids,
                   stop=StopChecker(self._decode, sampling.stop))
        if sampling.grammar is not None:
            seq.matcher = await asyncio.to_thread(self._grammar_matcher, sampling.grammar)
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify()
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

    def _abort(self, seq: _Seq) -> None:
        """Called when the consumer stopped listening: free the slot at the next step (or the queue place now)."""
        seq.aborted = True
        with self._cv:
            # Already running if it is not in the queue: the engine thread drops it before its next forward.
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
            self._cv.notify()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not (self._stopping or self._waiting or self._batch.rows or self._control):
                            self._cv.wait()
                        if self._stopping:
                            break
                    self._run_control()
                    with self._cv:
                        free = self.max_batch_size - len(self._batch)
                        admitted = self._admitted = []
                        while free > 0 and self._waiting:
                            seq = self._waiting.popleft()
                            if not seq.aborted:
                                admitted.append(seq)
                                free -= 1
                        self._prefilling = len(admitted)
                    self._drop_aborted()
                    deliveries: list[tuple[_Seq, EngineOutput | BaseException]] = []
                    if admitted:
                        self._prefill(admitted, deliveries)
                        self._admitted = []
                    if self._batch.rows:
                        self._decode_step(deliveries)
                    self._deliver(deliveries)
        except BaseException as exc:  # the worker must never die silently: fail every request and report it
            self._dead = exc
            log.exception("the transformers engine stopped")
            self._deliver([(seq, EngineDeadError(f"the engine failed: {exc!r}"))
                           for seq in [*self._admitted, *self._batch.rows, *self._waiting]])
        finally:
            self._abort_everything()

    def _abort_everything(self) -> None:
        """At stop: every sequence still known gets a final ``abort`` so no client waits forever."""
        with self._cv:
            pending = [*self._admitted, *self._batch.rows, *self._waiting]
            controls, self._control = list(self._control), collections.deque()
            self._waiting.clear()
            self._admitted = []
            self._prefilling = 0
        self._batch = RowBatch()
        for _, future in controls:
            future.set_exception(EngineError("the engine stopped"))
        self._deliver([(seq, EngineOutput("", [], len(seq.generated), finish_reason="abort")) for seq in pending
                       if not seq.finished])

    def _drop_aborted(self) -> None:
        keep = [i for i, seq in enumerate(self._batch.rows) if not seq.aborted]
        self._batch.keep(keep)

    def _prefill(self, seqs: list[_Seq], deliveries: list) -> None:
        """Prefill ``seqs`` together; if that fails, each one alone, so only a request that fails by itself fails
        (with ``RequestFailedError``) and the engine goes on."""
        try:
            self._prefill_batch(seqs, deliveries)
            self._failures_in_a_row = 0
        except Exception as exc:
            if len(seqs) > 1:
                log.warning("prefill of %d requests failed (%r); retrying each alone", len(seqs), exc)
                for seq in seqs:
                    self._prefill([seq], deliveries)
                return
            log.exception("a request failed in prefill; the engine goes on")
            self._fail(seqs, exc, deliveries)
            # Every request failing on its own means the model, not the requests, is broken: stop, so /health
            # turns 503 and the supervisor restarts the process.
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= FAILURES_BEFORE_DEAD:
                raise EngineDeadError(f"{FAILURES_BEFORE_DEAD} requests in a row failed alone; last: {exc!r}") \
                    from exc

    def _fail(self, seqs: list[_Seq], exc: BaseException, deliveries: list) -> None:
        for seq in seqs:
            if not seq.finished:
                seq.finished = True
                deliveries.append((seq, RequestFailedError(f"generation failed for this request: {exc!r}")))

    def _prefill_batch(self, seqs: list[_Seq], deliveries: list) -> None:
        """One forward over the new prompts (left-padded), after their shared prefix (``_prefill_shared_prefix``);
        sample each one's first token; join the batch."""
        now = time.perf_counter()
        for seq in seqs:
            seq.scheduled_time = now
        prompts = [seq.request.prompt_token_ids for seq in seqs]
        cache = new_growing_cache(self.model.config)
        prefix = self._prefill_shared_prefix(seqs, cache)
        ids, suffix_mask = left_padded([prompt[prefix:] for prompt in prompts], self.tokenizer.pad_token_id or 0)
        ids, suffix_mask = ids.to(self.device), suffix_mask.to(self.device)
        # Columns: the shared prefix, then each row's left-padded rest (padding mid-row, masked like any padding;
        # positions count real tokens only, so each row's positions are what a lone prefill gives it).
        mask = torch.cat([suffix_mask.new_ones(len(seqs), prefix), suffix_mask], dim=1)
        positions = prefix + (suffix_mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(seqs, input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float().cpu()
        tokens = self._sample(logits, seqs)
        if len(seqs) > 1 and any(seq.failure is not None for seq in seqs):
            raise RuntimeError("a row failed to sample")  # prefill again one by one: only that one fails
        if seqs[0].failure is not None:
            raise seqs[0].failure
        for seq in seqs:
            if seq.sampling.prompt_logprobs is not None:
                seq.prompt_logprobs = self._prompt_logprobs(seq, seq.sampling.prompt_logprobs)
        self._prefilling = 0
        keep = self._after_sampling(seqs, tokens, deliveries, _token_logprobs(logits, tokens, seqs))
        if keep:
            self._batch.rebuild(None, [Joining([seqs[i] for i in keep], cache, mask, tokens.to(self.device),
                                               None if len(keep) == len(seqs) else keep)])

    def _prefill_shared_prefix(self, seqs: list[_Seq], cache) -> int:
        """When the prompts start with the same ``shared_prefix_tokens`` or more tokens (a chat template's system
        prompt, a few-shot preamble), one row computes that prefix and ``cache`` gets its keys and values for every
        row; returns the prefix length (0: nothing shared). Each prompt keeps at least one token to prefill, and
        rows with different LoRA adapters share nothing (the adapter changes the keys and values)."""
        minimum = self.settings.shared_prefix_tokens
        if minimum == 0 or len(seqs) < 2 or len({seq.request.adapter for seq in seqs}) > 1:
            return 0
        prompts = [seq.request.prompt_token_ids for seq in seqs]
        prefix = len(os.path.commonprefix(prompts))
        prefix = min(prefix, min(len(prompt) for prompt in prompts) - 1)
        if prefix < minimum:
            return 0
        ids = torch.tensor([prompts[0][:prefix]], dtype=torch.long, device=self.device)
        positions = torch.arange(prefix, device=self.device).unsqueeze(0)
        self._forward(seqs[:1], input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
        rest = max(len(prompt) for prompt in prompts) - prefix
        for layer in cache.layers:  # the one row's prefix for every row, with room for the rest of the prompts
            layer.set_state(layer.keys.expand(len(seqs), -1, -1, -1), layer.values.expand(len(seqs), -1, -1, -1),
                            headroom=rest + GrowingLayer.HEADROOM)
        self.shared_prefix_tokens += prefix * (len(seqs) - 1)
        return prefix

    def _decode_step(self, deliveries: list) -> None:
        """One token for every running row. A row whose sampling fails fails alone; a failed forward fails the
        batch's rows (their cache is no longer consistent), and the engine goes on with new requests."""
        batch = self._batch
        mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
        positions = batch.mask.sum(-1, keepdim=True)
        try:
            out = self._forward(batch.rows, input_ids=batch.next_tokens.unsqueeze(-1), attention_mask=mask,
                                position_ids=positions, past_key_values=batch.cache, use_cache=True)
        except Exception as exc:
            log.exception("a decode step failed; its %d requests fail, the engine goes on", len(batch))
            self._fail(batch.rows, exc, deliveries)
            self._batch = RowBatch()
            return
        batch.mask = mask
        logits = out.logits[:, -1, :].float().cpu()
        tokens = self._sample(logits, batch.rows)
        batch.next_tokens = tokens.to(self.device)
        keep = self._after_sampling(batch.rows, tokens, deliveries, _token_logprobs(logits, tokens, batch.rows))
        batch.keep(keep)

    def _prompt_logprobs(self, seq: _Seq, top: int) -> list[TokenLogprob | None]:
        """Log-probs of each prompt token given the ones before it (one extra forward, only when asked for)."""
        prompt = seq.request.prompt_token_ids
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = self._forward([seq], input_ids=ids, use_cache=False).logits[0, :-1].float().cpu()
        targets = torch.tensor(prompt[1:], dtype=torch.long)
        return [None, *_logprob_entries(logits, targets, [top] * len(targets))]

    def _after_sampling(self, seqs: list[_Seq], tokens: torch.Tensor, deliveries: list,
                        logprobs: dict[int, TokenLogprob]) -> list[int]:
        """Append each row's token, check stops, queue its output; returns the rows that go on."""
        keep = []
        now = time.perf_counter()
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
            if seq.aborted:
                continue
            if seq.failure is not None:
                self._fail([seq], seq.failure, deliveries)
                continue
            output = self._advance(seq, token, now, logprobs.get(i))
            if output is not None:
                deliveries.append((seq, output))
            if seq.finished:
                continue
            keep.append(i)
        return keep

    def _advance(self, seq: _Seq, token: int, now: float, logprob: TokenLogprob | None = None
                 ) -> EngineOutput | None:
        """One token for ``seq``: a delta (streamed), the aggregated result (non-streamed, at the end) or None."""
        seq.generated.append(token)
        sampling = seq.sampling
        finish, stop_reason = None, None
        if seq.matcher is not None:
            seq.matcher.advance(token)
        if token in seq.stop_ids:
            finish, stop_reason = "stop", token
        elif len(seq.generated) >= sampling.max_tokens or (
            len(seq.request.prompt_token_ids) + len(seq.generated) >= self.max_model_len
        ):
            finish = "length"
        text = ""
        # Text is needed per step only to stream it or to look for stop strings; otherwise once, at the end.
        if seq.request.stream or sampling.stop or finish is not None:
            # The stop token itself is not text (vLLM convention); it still counts as a generated token.
            text_ids = seq.generated[:-1] if finish == "stop" else seq.generated
            text, matched = seq.stop.update(text_ids, final=finish is not None)
            if matched is not None:
                finish, stop_reason = "stop", matched
        seq.finished = finish is not None
        first = len(seq.generated) == 1
        if seq.request.stream:
            return EngineOutput(text=text, token_ids=[token], num_generated_tokens=len(seq.generated),
                                finish_reason=finish, stop_reason=stop_reason,
                                scheduled_time=seq.scheduled_time if first else None,
                                logprobs=[logprob] if logprob is not None else None,
                                prompt_logprobs=seq.prompt_logprobs if first else None)
        seq.text_parts.append(text)
        seq.token_times.append(now)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if finish is None:
            return None
        return EngineOutput(text="".join(seq.text_parts), token_ids=list(seq.generated),
                            num_generated_tokens=len(seq.generated), finish_reason=finish,
                            stop_reason=stop_reason, scheduled_time=seq.scheduled_time,
                            token_times=seq.token_times,
                            logprobs=seq.logprobs if seq.sampling.logprobs is not None else None,
                            prompt_logprobs=seq.prompt_logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """Next token per row; a row that cannot be sampled gets ``seq.failure`` set (token 0) instead of failing
        the others: the batch is sampled at once, and row by row only after an error."""
        try:
            return self._sample_rows(logits, seqs)
        except Exception:
            tokens = torch.zeros(len(seqs), dtype=torch.long)
            for i, seq in enumerate(seqs):
                try:
                    tokens[i] = self._sample_rows(logits[i : i + 1], [seq])[0]
                except Exception as exc:
                    log.warning("sampling failed for one request (%r); it fails alone", exc)
                    seq.failure = exc
            return tokens

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """Next token per row (``logits``: (rows, vocab) float32 on CPU): penalties first, then greedy rows take
        the argmax and the others sample after temperature/top-k/top-p."""
        penalized = [i for i, seq in enumerate(seqs) if seq.sampling.penalized]
        if penalized:
            logits = logits.clone()  # the raw logits stay untouched for the log-probs
            for i in penalized:
                _apply_penalties(logits[i], seqs[i].request.prompt_token_ids, seqs[i].generated, seqs[i].sampling)
            # Extreme penalties (repetition_penalty=1e-300 divides a logit into inf) must not become NaN
            # probabilities: +inf -> the largest float, NaN -> never chosen.
            logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if constrained:
            logits = logits.clone() if not penalized else logits
            for i in constrained:
                seqs[i].matcher.mask_logits(logits[i])
        tokens = logits.argmax(-1)
        sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
        if not sampled:
            return tokens
        rows = [seqs[i].sampling for i in sampled]
        index = torch.tensor(sampled)
        scores = logits.index_select(0, index) / torch.tensor([[s.temperature] for s in rows])
        if any(s.top_k > 0 or s.top_p < 1.0 for s in rows):
            scores = _filter_top_k_top_p(scores, [s.top_k for s in rows], [s.top_p for s in rows])
        probs = scores.softmax(-1)
        shared = [j for j, i in enumerate(sampled) if seqs[i].generator is None]
        if shared:
            tokens[index[shared]] = draw_categorical(probs[shared], self._sampler)
        for j, i in enumerate(sampled):
            generator = seqs[i].generator
            if generator is not None:
                tokens[i] = draw_categorical(probs[j : j + 1], generator)[0]
        return tokens

    def _deliver(self, deliveries: list[tuple[_Seq, EngineOutput | BaseException]]) -> None:
        """Hand this step's outputs to the event loop in one thread-safe call."""
        if not deliveries or self._loop is None or self._loop.is_closed():
            return

        def put_all() -> None:
            for seq, item in deliveries:
                seq.queue.put_nowait(item)

        # RuntimeError: the event loop closed under us (process exiting); nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(put_all)


def _apply_penalties(row: torch.Tensor, prompt: list[int], generated: list[int], sampling: SamplingOptions) -> None:
    """vLLM's penalties on one row of logits ``(vocab,)``, in place: repetition over prompt and output tokens,
    then frequency (per occurrence) and presence (once) over output tokens, then OpenAI's ``logit_bias``."""
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        values = row[seen]
        penalty = sampling.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if generated and (sampling.frequency_penalty or sampling.presence_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=row.shape[0]).to(row.dtype)
        row -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).to(row.dtype)
    if sampling.logit_bias:
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(sampling.logit_bias.values()), dtype=row.dtype)


def _logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """``logits`` (rows, vocab) and the chosen ``tokens`` (rows,) -> each row's log-prob and its ``tops[r]`` best."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    k = max(tops, default=0)
    best_values, best_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    entries = []
    for r, (token, value) in enumerate(zip(tokens.tolist(), chosen, strict=True)):
        top = [] if not tops[r] else list(zip(best_ids[r, : tops[r]].tolist(), best_values[r, : tops[r]].tolist(),
                                              strict=True))
        entries.append(TokenLogprob(int(token), float(value), top))
    return entries


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[_Seq]) -> dict[int, TokenLogprob]:
    """Row -> the sampled token's raw log-prob (+ alternatives), for the rows that asked (others cost nothing)."""
    wanted = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted)
    entries = _logprob_entries(logits.index_select(0, index), tokens.index_select(0, index),
                               [seqs[i].sampling.logprobs for i in wanted])
    return dict(zip(wanted, entries, strict=True))


def _filter_top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf what falls outside each row's top-k and nucleus (top-p); the best token always survives.

    ``scores``: (rows, vocab) temperature-scaled logits.
    """
    vocab = scores.shape[-1]
    ordered, order = scores.sort(-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k]).unsqueeze(-1)  # top_k=1e29 is "all"
    ordered = ordered.masked_fill(ranks >= k, float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(-1)
    # The most likely token always stays, so a tiny top_p (5e-324 rounds to 0 in float32) means greedy, not NaN.
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
