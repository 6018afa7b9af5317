"""The transformers engine's thread (``serve/engines/hf_engine.py``): one loop that owns the model and, each
iteration, runs queued control work (adapter loads), admits waiting sequences into free rows with one batched
prefill, runs one decode step for every row and hands the outputs to the event loop. A request that fails alone
fails alone (``RequestFailedError``); ``FAILURES_BEFORE_DEAD`` of them in a row stop the engine."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serve.engines.base import EngineDeadError, EngineError, EngineOutput, RequestFailedError, TokenLogprob
from serve.engines.rows import RowSampler, RunningSequence, logprob_entries, token_logprobs
from serve.settings import ServeSettings
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.kv_cache import GrowingLayer, Joining, RowBatch, new_growing_cache
from verl.models.packed_linear import packed_weights
from verl.protocol import pad_tokens

log = logging.getLogger("uvicorn.error.serve.engine")  # shows in the uvicorn server log
FAILURES_BEFORE_DEAD = 8  # consecutive requests that fail alone before the engine declares itself dead
BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class StepLoop:
    """The engine thread's state and loop (``run``). The event loop side (``TransformersEngine``) appends to
    ``waiting`` and ``control`` under ``cv``; everything else is touched by this thread alone."""

    def __init__(self, settings: ServeSettings, tokenizer: PreTrainedTokenizerBase, max_model_len: int):
        self.settings, self.tokenizer, self.max_model_len = settings, tokenizer, max_model_len
        self.max_batch_size = settings.max_batch_size
        self.model: PreTrainedModel | None = None  # set by the engine's load, before the thread starts
        self.device = torch.device("cpu")
        self.waiting: collections.deque[RunningSequence] = collections.deque()
        self.batch = RowBatch()
        self.cv = threading.Condition()
        self.control: collections.deque[tuple[Callable[[], None], concurrent.futures.Future]] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None  # where outputs are delivered
        self.stopping = False
        self.dead: BaseException | None = None
        self._failures_in_a_row = 0
        self.sampler = RowSampler(settings.seed)
        self.prefilling = 0
        self.admitted: list[RunningSequence] = []  # taken from the queue for the prefill in progress
        self.peft: PeftModel | None = None  # set once an adapter is loaded; wraps self.model
        self.mixed_adapter_steps = 0  # forwards whose rows used more than one adapter (or adapter and base)
        self.shared_prefix_tokens = 0  # prompt tokens not recomputed: prefixes shared within a prefill

    @property
    def adapters(self) -> list[str]:
        return list(self.peft.peft_config) if self.peft is not None else []

    def load_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise EngineError(f"an adapter named '{name}' is already loaded")
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
        else:
            self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
        self.peft.eval()

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(f"no adapter named '{name}' is loaded")
        if len(self.adapters) == 1:
            self.model = self.peft.unload()  # the last one: back to the plain model, no PEFT hooks per forward
            self.peft = None
        else:
            self.peft.delete_adapter(name)

    def forward(self, rows: list[RunningSequence], **kwargs):
        """The model's forward for ``rows`` (one batch row each), each with its own adapter when any is loaded;
        frozen linear layers multiply by oneDNN-packed weights (verl/models/packed_linear.py) and the decoder layers'
        small operations run fused (verl/models/fused_decoder.py)."""
        with packed_weights(), fused_decoder_layers():
            if self.peft is None:
                return self.model(**kwargs)
            names = [row.request.adapter or BASE_ADAPTER for row in rows]
            if len(set(names)) > 1:
                self.mixed_adapter_steps += 1
            return self.peft(**kwargs, adapter_names=names)

    def run_control(self) -> None:
        while True:
            with self.cv:
                if not self.control:
                    return
                work, future = self.control.popleft()
            try:
                work()
            except Exception as exc:  # a bad adapter fails its load call, never the engine
                future.set_exception(exc)
            else:
                future.set_result(None)

    def run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self.cv:
                        while not (self.stopping or self.waiting or self.batch.rows or self.control):
                            self.cv.wait()
                        if self.stopping:
                            break
                    self.run_control()
                    with self.cv:
                        free = self.max_batch_size - len(self.batch)
                        admitted = self.admitted = []
                        while free > 0 and self.waiting:
                            seq = self.waiting.popleft()
                            if not seq.aborted:
                                admitted.append(seq)
                                free -= 1
                        self.prefilling = len(admitted)
                    self.drop_aborted()
                    deliveries: list[tuple[RunningSequence, EngineOutput | BaseException]] = []
                    if admitted:
                        self._prefill(admitted, deliveries)
                        self.admitted = []
                    if self.batch.rows:
                        self._decode_step(deliveries)
                    self.deliver(deliveries)
        except BaseException as exc:  # the worker must never die silently: fail every request and report it
            self.dead = exc
            log.exception("the transformers engine stopped")
            self.deliver([(seq, EngineDeadError(f"the engine failed: {exc!r}"))
                           for seq in [*self.admitted, *self.batch.rows, *self.waiting]])
        finally:
            self.abort_everything()

    def abort_everything(self) -> None:
        """At stop: every sequence still known gets a final ``abort`` so no client waits forever."""
        with self.cv:
            pending = [*self.admitted, *self.batch.rows, *self.waiting]
            controls, self.control = list(self.control), collections.deque()
            self.waiting.clear()
            self.admitted = []
            self.prefilling = 0
        self.batch = RowBatch()
        for _, future in controls:
            future.set_exception(EngineError("the engine stopped"))
        self.deliver([(seq, EngineOutput("", [], len(seq.generated), finish_reason="abort")) for seq in pending
                       if not seq.finished])

    def drop_aborted(self) -> None:
        keep = [i for i, seq in enumerate(self.batch.rows) if not seq.aborted]
        self.batch.keep(keep)

    def _prefill(self, seqs: list[RunningSequence], deliveries: list) -> None:
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

    def _fail(self, seqs: list[RunningSequence], exc: BaseException, deliveries: list) -> None:
        for seq in seqs:
            if not seq.finished:
                seq.finished = True
                deliveries.append((seq, RequestFailedError(f"generation failed for this request: {exc!r}")))

    def _prefill_batch(self, seqs: list[RunningSequence], deliveries: list) -> None:
        """One forward over the new prompts (left-padded), after their shared prefix (``_prefill_shared_prefix``);
        sample each one's first token; join the batch."""
        now = time.perf_counter()
        for seq in seqs:
            seq.scheduled_time = now
        prompts = [seq.request.prompt_token_ids for seq in seqs]
        cache = new_growing_cache(self.model.config)
        prefix = self._prefill_shared_prefix(seqs, cache)
        ids, suffix_mask = pad_tokens([prompt[prefix:] for prompt in prompts], self.tokenizer.pad_token_id or 0)
        ids, suffix_mask = ids.to(self.device), suffix_mask.to(self.device)
        # Columns: the shared prefix, then each row's left-padded rest (padding mid-row, masked like any padding;
        # positions count real tokens only, so each row's positions are what a lone prefill gives it).
        mask = torch.cat([suffix_mask.new_ones(len(seqs), prefix), suffix_mask], dim=1)
        positions = prefix + (suffix_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.forward(seqs, input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float().cpu()
        tokens = self.sampler.sample(logits, seqs)
        if len(seqs) > 1 and any(seq.failure is not None for seq in seqs):
            raise RuntimeError("a row failed to sample")  # prefill again one by one: only that one fails
        if seqs[0].failure is not None:
            raise seqs[0].failure
        for seq in seqs:
            if seq.sampling.prompt_logprobs is not None:
                seq.prompt_logprobs = self._prompt_logprobs(seq, seq.sampling.prompt_logprobs)
        self.prefilling = 0
        keep = self._after_sampling(seqs, tokens, deliveries, token_logprobs(logits, tokens, seqs))
        if keep:
            self.batch.rebuild(None, [Joining([seqs[i] for i in keep], cache, mask, tokens.to(self.device),
                                               None if len(keep) == len(seqs) else keep)])

    def _prefill_shared_prefix(self, seqs: list[RunningSequence], cache) -> int:
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
        self.forward(seqs[:1], input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
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
        batch = self.batch
        mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
        positions = batch.mask.sum(-1, keepdim=True)
        try:
            out = self.forward(batch.rows, input_ids=batch.next_tokens.unsqueeze(-1), attention_mask=mask,
                                position_ids=positions, past_key_values=batch.cache, use_cache=True)
        except Exception as exc:
            log.exception("a decode step failed; its %d requests fail, the engine goes on", len(batch))
            self._fail(batch.rows, exc, deliveries)
            self.batch = RowBatch()
            return
        batch.mask = mask
        logits = out.logits[:, -1, :].float().cpu()
        tokens = self.sampler.sample(logits, batch.rows)
        batch.next_tokens = tokens.to(self.device)
        keep = self._after_sampling(batch.rows, tokens, deliveries, token_logprobs(logits, tokens, batch.rows))
        batch.keep(keep)

    def _prompt_logprobs(self, seq: RunningSequence, top: int) -> list[TokenLogprob | None]:
        """Log-probs of each prompt token given the ones before it (one extra forward, only when asked for)."""
        prompt = seq.request.prompt_token_ids
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = self.forward([seq], input_ids=ids, use_cache=False).logits[0, :-1].float().cpu()
        targets = torch.tensor(prompt[1:], dtype=torch.long)
        return [None, *logprob_entries(logits, targets, [top] * len(targets))]

    def _after_sampling(self, seqs: list[RunningSequence], tokens: torch.Tensor, deliveries: list,
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
            output = seq.advance(token, now, self.max_model_len, logprobs.get(i))
            if output is not None:
                deliveries.append((seq, output))
            if seq.finished:
                continue
            keep.append(i)
        return keep

    def deliver(self, deliveries: list[tuple[RunningSequence, EngineOutput | BaseException]]) -> None:
        """Hand this step's outputs to the event loop in one thread-safe call."""
        if not deliveries or self.loop is None or self.loop.is_closed():
            return

        def put_all() -> None:
            for seq, item in deliveries:
                seq.queue.put_nowait(item)

        # RuntimeError: the event loop closed under us (process exiting); nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(put_all)
