"""The rollout-engine interface and its registry.

An engine turns a prompt batch into responses. Input: a ``DataProto`` with left-padded ``input_ids`` and
``attention_mask`` of shape ``(batch, prompt_len)``. Output: a ``DataProto`` of ``batch * n`` rows (each prompt's
samples adjacent) with

- ``prompts``        (batch*n, prompt_len)            the left-padded prompt ids
- ``responses``      (batch*n, response_len)          right-padded with pad id
- ``response_mask``  (batch*n, response_len)          1 for generated tokens up to and including eos
- ``input_ids``      (batch*n, prompt_len+response_len)
- ``attention_mask`` (batch*n, prompt_len+response_len)
- ``position_ids``   (batch*n, prompt_len+response_len)
- ``rollout_log_probs`` (batch*n, response_len)       only when ``SamplingParams.logprobs`` and the engine gives
  them: the behaviour policy's log-prob of each token at the sampling temperature (0 after eos)

and the prompt's non-tensor fields repeated. ``response_len`` is the longest response in the batch
(at most ``max_new_tokens``), not the configured maximum, so no compute is spent on all-padding columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl.errors import ConfigError
from verl.models.precision import at_least_float32
from verl.protocol import DataProto
from verl.registry import Registry

if TYPE_CHECKING:  # annotations only
    from verl.config import MultiTurnConfig
    from verl.tools.registry import ToolSet
    from verl.tools.runner import ToolRunner


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    seed: int | None = None
    logprobs: bool = False  # also return each drawn token's log-prob (``rollout_log_probs``) where the engine can

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RolloutEngine:
    """Generates responses; ``sync_weights`` makes it use the actor's current parameters."""

    name = "base"

    @classmethod
    def build(cls, spec: EngineSpec) -> RolloutEngine:
        """An engine from the one spec every engine takes."""
        raise NotImplementedError

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        raise NotImplementedError

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the actor's weights. In-process engines that share the module need nothing."""

    def agent_loop(self, runner: ToolRunner, tool_set: ToolSet, config: MultiTurnConfig, max_response_length: int,
                   template: str) -> Any:
        """This engine's multi-turn decoding, a ``ToolTurns`` (``rollout.multi_turn``; the agent loop module imports
        this one, so the type is not named here)."""
        raise ConfigError(f"rollout engine '{self.name}' has no multi-turn loop; use rollout.name=hf or vllm")

    def shutdown(self) -> None:
        """Release engine resources."""


@dataclass(frozen=True)
class EngineSpec:
    """What every rollout engine is built from: each entry of ``ROLLOUT_ENGINES`` is a class whose ``build(spec)``
    takes this and reads what it needs (the transformers engine decodes with ``model``; vLLM loads ``model_path``
    and pushes ``model``'s weights), so no call site branches on the engine's name."""

    model: torch.nn.Module  # the actor's (or the evaluated) policy module
    model_path: str
    tokenizer: Any
    config: Any  # the RolloutConfig (vLLM: gpu_memory_utilization, enforce_eager, dtype)
    max_model_len: int
    seed: int = 0
    micro_batch_size: int | None = None  # sequences per generate() call
    max_num_seqs: int | None = None  # the decode width
    autocast_dtype: torch.dtype | None = None
    stop_when: Callable[[bool], bool] | None = None  # sharded models: ranks agree on when decoding stops


# The engines, each imported when first named: vLLM's module imports an optional heavy package, and neither imports
# this one's importers (they import this module without a cycle).
ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", key="rollout.name")
ROLLOUT_ENGINES.lazy("hf", "verl.rollout.hf:HFRollout")
ROLLOUT_ENGINES.lazy("vllm", "verl.rollout.vllm_rollout:VLLMRollout")


# What runs a user's own agent against a served policy (``rollout.gateway``): serve contributes ``serve`` through the
# ``verl.gateways`` entry point (pyproject.toml), so the core names no module of the serving layer.
GATEWAY_ENGINES: Registry[type[RolloutEngine]] = Registry(
    "agent gateway", key="rollout.gateway", group="verl.gateways",
    hint="the gateway is the serve package's: install the project (pip install -e .) so its entry point is known")


def register_rollout(name: str) -> Callable[[type[RolloutEngine]], type[RolloutEngine]]:
    """Register an engine class (its ``build(spec: EngineSpec)`` makes one) as ``rollout.name=NAME``."""
    return ROLLOUT_ENGINES.register(name)


def build_rollout(name: str, spec: EngineSpec) -> RolloutEngine:
    """The engine ``rollout.name=name`` names, built from ``spec``."""
    return ROLLOUT_ENGINES[name].build(spec)


def assemble_rollout(prompts: DataProto, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     eos_id: int, pad_id: int, n: int, log_probs: torch.Tensor | None = None) -> DataProto:
    """Build the engine output from ``responses`` (batch*n, gen_len) as generated (tokens after eos arbitrary).

    The response mask keeps tokens up to and including the first eos; later tokens become pad. ``log_probs``
    (batch*n, gen_len), when given, becomes ``rollout_log_probs``, zeroed where the mask is 0.
    """
    is_eos = responses == eos_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first eos
    response_mask = (~after_eos).long()
    responses = responses.masked_fill(after_eos, pad_id)
    width = int(response_mask.sum(-1).max().item()) if responses.numel() else 0
    responses, response_mask = responses[:, :width], response_mask[:, :width]
    extra: dict[str, torch.Tensor] = {}
    if log_probs is not None:
        extra["rollout_log_probs"] = at_least_float32(log_probs[:, :width]) * response_mask
    if n > 1:
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    out = DataProto.from_dict(
        tensors={"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                 "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
                 "position_ids": position_ids, **extra},
        non_tensors={k: v for k, v in (prompts.repeat(n).non_tensor.items() if n > 1 else prompts.non_tensor.items())},
        meta=dict(prompts.meta),
        stage="rollout",
    )
    return out


