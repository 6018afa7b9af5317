"""The transformers engine's thread (``serve/engines/hf_engine.py``): one loop that owns the model and, each
iteration, runs queued control work (adapter loads, weight updates, pause and resume), admits waiting sequences into
free rows with one batched prefill, runs one decode step for every row and hands the outputs to the event loop. A
request that fails alone fails alone (``RequestFailedError``); ``FAILURES_BEFORE_DEAD`` of them in a row stop the
engine.

Paused (vLLM's ``/pause`` modes): ``abort`` ends every running and queued sequence with ``finish_reason`` "abort";
``wait`` admits nothing new and decodes the running rows to their end; ``keep`` freezes the running rows with their
KV cache where they are. New requests queue until ``resume``. Every sampled token is stamped with the version of the
weights that sampled it (``versions``: the full model's, or its adapter's), so a sequence that a weight update
interrupted under ``keep`` says which tokens each version produced."""

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
from transformers import PreTrainedTokenizerBase

from serve.engines.base import EngineDeadError, EngineError, EngineOutput, RequestFailedError, TokenLogprob
from serve.engines.rows import RowSampler, RunningSequence, logprob_entries, token_logprobs
from serve.engines.weights import ServedWeights
from serve.settings import ServeSettings
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.kv_cache import GrowingLayer, Joining, RowBatch, new_growing_cache
from verl.models.packed_linear import packed_weights, refresh_packed_linear
from verl.protocol import pad_tokens

log = logging.getLogger("uvicorn.error.serve.engine")  # shows in the uvicorn server log
FAILURES_BEFORE_DEAD = 8  # consecutive requests that fail alone before the engine declares itself dead
PAUSE_MODES = ("abort", "wait", "keep")


def admit(waiting: collections.deque[RunningSequence], free: int, running: list[RunningSequence],
          training_rows: int) -> list[RunningSequence]:
    """Up to ``free`` waiting sequences for the next prefill, in arrival order, taken off ``waiting``; aborted ones
    dropped. Training traffic (``EngineRequest.training``) never holds more than ``training_rows`` rows with
    ``running``: its sequences past that stay waiting, in order, and the user requests behind them go first."""
    admitted: list[RunningSequence] = []
    held: list[RunningSequence] = []
    training = sum(row.request.training for row in running)
    while free > 0 and waiting:
        seq = waiting.popleft()
        if seq.aborted:
            continue
        if seq.request.training and training >= training_rows:
            held.append(seq)
            continue
        admitted.append(seq)
        training += seq.request.training
        free -= 1
    waiting.extendleft(reversed(held))
    return admitted


class PrefixCache:
    """Prompt prefixes' keys and values kept across prefills (vLLM's automatic prefix caching, at token rather than
    block granularity: a chat template's 24-token system prompt is shared, which vLLM's 128-token CPU blocks never
    share). A prefix is kept once two prompts were seen to start with it (``seen_prefix``: the longest prefix this
    prompt shares with one of the last ``RECENT`` prompts) and no kept one served; a later prompt uses as much of a
    kept prefix as it shares; up to ``entries`` prefixes, least recently used out.
    Keys are (adapter, prefix ids); everything goes at any control work (new weights, adapters, sleep)."""

    RECENT = 32

    def __init__(self, entries: int):
        self.entries = entries
        self.kept: collections.OrderedDict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = collections.OrderedDict()
        self.recent: collections.deque[tuple[str | None, list[int]]] = collections.deque(maxlen=self.RECENT)

    def lookup(self, adapter: str | None, prompt: list[int], limit: int
               ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The longest run of ``prompt``'s first ids (at most ``limit``) that a kept prefix starts with: (its
        length, that prefix's layers' (keys, values), each (1, heads, >= length, head_dim): the first ``length``
        columns are the run's, attention being causal), or None."""
        best, length = None, 0
        for key in self.kept:
            if key[0] == adapter:
                shared = min(len(os.path.commonprefix([prompt, list(key[1])])), limit)
                if shared > length:
                    best, length = key, shared
        if best is None:
            return None
        self.kept.move_to_end(best)
        return length, self.kept[best]

    def plan(self, adapter: str | None, prompts: list[list[int]], minimum: int
             ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """What ``prompts`` (one prefill) share: (prefix length, its kept layers) to reuse, (length, None) to
        compute and keep, (0, None) for nothing. Each prompt keeps at least one id to prefill."""
        longest = min(len(prompt) for prompt in prompts) - 1
        common = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else longest
        kept = self.lookup(adapter, prompts[0], min(common, longest))
        if kept is not None and kept[0] >= minimum:
            return kept
        prefix = min(common if len(prompts) > 1 else self.seen_prefix(adapter, prompts[0]), longest)
        return (prefix, None) if prefix >= minimum else (0, None)

    def seen_prefix(self, adapter: str | None, prompt: list[int]) -> int:
        """The longest prefix ``prompt`` shares with a recent prompt of the same adapter (0: none, or caching off)."""
        if not self.entries:
            return 0
        return max((len(os.path.commonprefix([prompt, other])) for a, other in self.recent if a == adapter), default=0)

    def keep(self, adapter: str | None, prefix: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.entries:
            return
        self.kept[(adapter, tuple(prefix))] = [(k[:1].clone(), v[:1].clone()) for k, v in layers]
        while len(self.kept) > self.entries:
            self.kept.popitem(last=False)

    def saw(self, adapter: str | None, prompts: list[list[int]]) -> None:
        if self.entries:
            self.recent.extend((adapter, list(p)) for p in prompts)

    def clear(self) -> None:
        self.kept.clear()
        self.recent.clear()


class StepLoop:
    """The engine thread's state and loop (``run``). The event loop side (``TransformersEngine``) appends to
    ``waiting`` and ``control`` under ``cv``; everything else is touched by this thread alone."""

    def __init__(self, settings: ServeSettings, tokenizer: PreTrainedTokenizerBase, max_model_len: int):
        self.settings, self.tokenizer, self.max_model_len = settings, tokenizer, max_model_len
        self.max_batch_size = settings.max_batch_size
        # Training traffic's rows at most (training_max_slots_share): user requests are admitted ahead of it.
        self.training_rows = max(1, int(settings.max_batch_size * settings.training_max_slots_share))
        self.weights = ServedWeights()  # its model is set by the engine's load, before the thread starts
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
        self.mixed_adapter_steps = 0  # forwards whose rows used more than one adapter (or adapter and base)
        self.shared_prefix_tokens = 0  # prompt tokens not recomputed: prefixes shared within or across prefills
        self.prefixes = PrefixCache(settings.prefix_cache_entries)
        self.pause_mode: str | None = None  # one of PAUSE_MODES while paused

    # The model, its adapters and their weight versions (serve/engines/weights.py).
    model = property(lambda self: self.weights.model, lambda self, model: setattr(self.weights, "model", model))
    adapters = property(lambda self: self.weights.adapters)

    def pause(self, mode: str) -> None:
        """Stop stepping (see the module docstring); ``abort`` ends every sequence now."""
        self.pause_mode = mode
        if mode == "abort":
            with self.cv:
                pending = [*self.batch.rows, *self.waiting]
                self.waiting.clear()
            self.batch = RowBatch()
            self._end(pending)

    def resume(self) -> None:
        self.pause_mode = None

    def release_caches(self) -> None:
        """Sleep (level 1 on CPU): drop the KV cache and the packed weight copies; both are rebuilt on demand."""
        if self.batch.rows:
            raise EngineError(f"{len(self.batch.rows)} sequence(s) are kept with their KV cache (pause mode keep); "
                              "sleep with mode abort or wait")
        self.batch = RowBatch()
        self.prefixes.clear()
        refresh_packed_linear(self.model)

    def _stepping(self) -> bool:
        """Whether there is generation work this iteration (paused: only ``wait`` decodes its running rows)."""
        if self.pause_mode is None:
            return bool(self.waiting or self.batch.rows)
        return self.pause_mode == "wait" and bool(self.batch.rows)

    def forward(self, rows: list[RunningSequence], **kwargs):
        """The model's forward for ``rows`` (one batch row each), each with its own adapter when any is loaded;
        frozen linear layers multiply by oneDNN-packed weights (verl/models/packed_linear.py) and the decoder layers'
        small operations run fused (verl/models/fused_decoder.py)."""
        with packed_weights(), fused_decoder_layers():
            if self.weights.peft is None:
                return self.model(**kwargs)
            names = self.weights.adapter_names([row.request.adapter for row in rows])
            if len(set(names)) > 1:
                self.mixed_adapter_steps += 1
            return self.weights.peft(**kwargs, adapter_names=names)

    def run_control(self) -> None:
        while True:
            with self.cv:
                if not self.control:
                    return
                work, future = self.control.popleft()
            self.prefixes.clear()  # control work may change weights or adapters: kept keys and values go stale
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
                        while not (self.stopping or self.control or self._stepping()):
                            self.cv.wait()
                        if self.stopping:
                            break
                    self.run_control()
                    if not self._stepping():
                        continue
                    with self.cv:
                        free = self.max_batch_size - len(self.batch) if self.pause_mode is None else 0
                        admitted = self.admitted = admit(self.waiting, free, self.batch.rows, self.training_rows)
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
        self._end(pending)

    def _end(self, seqs: list[RunningSequence]) -> None:
        """A final ``abort`` for each sequence not finished yet, so no client waits forever."""
        ended = [seq for seq in seqs if not seq.finished]
        for seq in ended:
            seq.finished = True
        self.deliver([(seq, EngineOutput("", [], len(seq.generated), finish_reason="abort")) for seq in ended])

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
        prompt, a few-shot preamble), that prefix is computed once and ``cache`` gets its keys and values for every
        row; returns the prefix length (0: nothing shared). The prefix is shared within the prefill (the prompts'
        common prefix) and across prefills (``PrefixCache``: a prefix an earlier prompt shared with this one, kept
        from when it was first computed). Each prompt keeps at least one token to prefill, and rows with different
        LoRA adapters share nothing (the adapter changes the keys and values)."""
        minimum = self.settings.shared_prefix_tokens
        adapters = {seq.request.adapter for seq in seqs}
        if minimum == 0 or len(adapters) > 1:
            return 0
        adapter = adapters.pop()
        prompts = [seq.request.prompt_token_ids for seq in seqs]
        prefix, layers = self.prefixes.plan(adapter, prompts, minimum)
        self.prefixes.saw(adapter, prompts)
        if prefix == 0:
            return 0
        computed = layers is None
        if computed:
            ids = torch.tensor([prompts[0][:prefix]], dtype=torch.long, device=self.device)
            positions = torch.arange(prefix, device=self.device).unsqueeze(0)
            self.forward(seqs[:1], input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                          logits_to_keep=1)
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            self.prefixes.keep(adapter, prompts[0][:prefix], layers)
        rest = max(len(prompt) for prompt in prompts) - prefix
        for layer, (keys, values) in zip(cache.layers, layers, strict=True):  # the one row's prefix for every row
            layer.set_state(keys[:, :, :prefix].expand(len(seqs), -1, -1, -1),
                            values[:, :, :prefix].expand(len(seqs), -1, -1, -1), headroom=rest + GrowingLayer.HEADROOM)
        self.shared_prefix_tokens += prefix * (len(seqs) - computed)
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
            version = self.weights.version_of(seq.request.adapter)
            output = seq.advance(token, now, self.max_model_len, logprobs.get(i), version)
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
