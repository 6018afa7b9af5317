"""The transformers rollout engine: batched generation with a KV cache (shared prompt prefill, see sampler.py).

In the local executor the engine holds the actor's own module, so the weights it samples from are always the
latest ones (the "sync" is sharing). Sampling draws from a private generator seeded per call, so a run is
reproducible from ``trainer.seed`` and does not disturb the global RNG that dropout or data order use.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verl.config import MultiTurnConfig
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.packed_linear import packed_weights
from verl.models.precision import autocast_context
from verl.protocol import DataProto, pad_responses
from verl.rollout.agent_loop import AgentLoop
from verl.rollout.base import EngineSpec, RolloutEngine, SamplingParams, assemble_rollout
from verl.rollout.sampler import sample_with_shared_prefill, supports_shared_prefill
from verl.tools.registry import ToolSet
from verl.tools.runner import ToolRunner
from verl.utils.allocator import keep_freed_memory


class HFRollout(RolloutEngine):
    name = "hf"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int | None = None,
                 autocast_dtype: torch.dtype | None = None, shared_prefill: bool = True, stop_when=None,
                 max_num_seqs: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_num_seqs = max_num_seqs  # the decode width (vLLM's max_num_seqs); None = every sequence at once
        self.autocast_dtype = autocast_dtype
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        # Our loop prefills each prompt once for its n samples; `generate` stays as the fallback.
        self.shared_prefill = shared_prefill and supports_shared_prefill(model)
        self.stop_when = stop_when  # sharded models: agree across ranks on when decoding stops
        # Recycle tensor-sized blocks from the heap, as the trainer's and the server's processes do: without it a
        # rollout in a plain script page-faults its multi-MB temporaries at every step (sampling from SmolLM2's
        # 49,152-entry vocabulary at 16 rows: 5.6 ms a step against 0.64 ms).
        keep_freed_memory()

    @classmethod
    def build(cls, spec: EngineSpec) -> HFRollout:
        return cls(spec.model, spec.tokenizer, spec.micro_batch_size, spec.autocast_dtype, stop_when=spec.stop_when,
                   max_num_seqs=spec.max_num_seqs)

    @torch.no_grad()
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """``prompts``: ``input_ids``/``attention_mask`` (batch, prompt_len) -> batch*n rows (see base module)."""
        # micro_batch_size and max_num_seqs count sequences (prompts x n); neither set: the whole batch in one call.
        widths = [w for w in (self.micro_batch_size, self.max_num_seqs) if w]
        per_call = max(1, min(widths) // params.n) if widths else len(prompts)
        parts = [self._generate_chunk(part, params) for part in prompts.split(per_call)]
        return DataProto.concat(pad_responses(parts, self.pad_id))

    def _generate_chunk(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        device = next(self.model.parameters()).device
        ids = prompts.batch["input_ids"].to(device)
        mask = prompts.batch["attention_mask"].to(device)
        # Only the columns some prompt uses: a batch padded wider than needed wastes every decode step.
        first = int((mask.sum(0) > 0).nonzero()[0].item()) if mask.any() else 0
        ids, mask = ids[:, first:], mask[:, first:]
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "num_return_sequences": params.n,
                        "eos_token_id": self.eos_id, "pad_token_id": self.pad_id}
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or None)
        was_training = self.model.training
        self.model.eval()
        behaviour = None  # `generate` (the fallback) gives no log-probs: callers compute them with a forward pass
        try:
            if self.shared_prefill:
                with autocast_context(device, self.autocast_dtype):
                    seeds = [int(i) for i in prompts.non_tensor["index"]] if "index" in prompts.non_tensor else None
                    sampled = sample_with_shared_prefill(self.model, ids, mask, params, self.eos_id, self.pad_id,
                                                         prompt_seeds=seeds, stop_when=self.stop_when,
                                                         with_log_probs=params.logprobs)
                responses, behaviour = sampled.tokens, sampled.log_probs
            else:
                if params.greedy:
                    kwargs["num_return_sequences"] = 1  # greedy samples are identical; generate once, repeat
                with self._sampling_rng(params.seed, device), autocast_context(device, self.autocast_dtype), \
                        packed_weights(trainable=True), fused_decoder_layers():
                    out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
                responses = out[:, ids.shape[1] :]
                if params.greedy and params.n > 1:
                    responses = responses.repeat_interleave(params.n, dim=0)
        finally:
            self.model.train(was_training)
        return assemble_rollout(prompts, ids.cpu(), mask.cpu(), responses.cpu(), self.eos_id, self.pad_id, params.n,
                                log_probs=None if behaviour is None else behaviour.cpu())

    def agent_loop(self, runner: ToolRunner, tool_set: ToolSet, config: MultiTurnConfig, max_response_length: int,
                   template: str) -> AgentLoop:
        """Multi-turn decoding on this engine's model: a continuous batch that keeps each waiting row's KV cache."""
        return AgentLoop(self.model, self.tokenizer, runner, tool_set, config, max_response_length, template,
                         self.autocast_dtype, max_num_seqs=self.max_num_seqs)

    @staticmethod
    def _sampling_rng(seed: int | None, device: torch.device):
        """Fork the global RNG for the duration of sampling, seeded by ``seed`` when given."""
        if seed is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def forked():
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield

        return forked()
