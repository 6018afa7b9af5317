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

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl.errors import ConfigError
from verl.models.precision import at_least_float32
from verl.protocol import DataProto

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


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_rollout(name: str):
    def decorator(factory):
        ROLLOUT_ENGINES[name] = factory
        return factory

    return decorator


# Engines in modules that import heavy optional packages: name -> module that registers it when imported. A string,
# resolved only when asked for, so this module never imports them (and they import this one without a cycle).
LAZY_ROLLOUT_ENGINES = {"vllm": "verl.rollout.vllm_rollout"}


def get_rollout_factory(name: str) -> Callable[..., RolloutEngine]:
    if name in LAZY_ROLLOUT_ENGINES and name not in ROLLOUT_ENGINES:
        importlib.import_module(LAZY_ROLLOUT_ENGINES[name])  # registers itself; raises if vllm is missing
    if name not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout.name='{name}' is unknown; available: {', '.join(sorted(ROLLOUT_ENGINES))}")
    return ROLLOUT_ENGINES[name]


def assemble_rollout(
    prompts: DataProto, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, eos_id: int,
    pad_id: int, n: int, log_probs: torch.Tensor | None = None,
) -> DataProto:
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
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            **extra,
        },
        non_tensors={k: v for k, v in (prompts.repeat(n).non_tensor.items() if n > 1 else prompts.non_tensor.items())},
        meta=dict(prompts.meta),
        stage="rollout",
    )
    return out


SEQUENCE_KEYS = ("responses", "prompts", "input_ids", "attention_mask", "position_ids")  # padded on their own


def pad_responses(parts: list[DataProto], pad_id: int) -> list[DataProto]:
    """Right-pad every part's response fields to the widest part so they can be concatenated: the token ids and
    masks, and any other per-response-token tensor ``(rows, response_len)`` a later stage added (scores, log-probs)
    with zeros."""
    if len(parts) <= 1:
        return parts
    width = max(p.batch["responses"].shape[1] for p in parts)
    prompt_width = max(p.batch["prompts"].shape[1] for p in parts)
    out = []
    for part in parts:
        b = dict(part.batch)
        extra = width - b["responses"].shape[1]
        lead = prompt_width - b["prompts"].shape[1]
        if extra:
            old_width = b["responses"].shape[1]
            b["responses"] = torch.nn.functional.pad(b["responses"], (0, extra), value=pad_id)
            for key, value in b.items():
                if key not in SEQUENCE_KEYS and value.dim() == 2 and value.shape[1] == old_width:
                    b[key] = torch.nn.functional.pad(value, (0, extra), value=0)
        if lead:
            b["prompts"] = torch.nn.functional.pad(b["prompts"], (lead, 0), value=pad_id)
        if extra or lead:
            b["input_ids"] = torch.nn.functional.pad(b["input_ids"], (lead, extra), value=pad_id)
            b["attention_mask"] = torch.nn.functional.pad(b["attention_mask"], (lead, extra), value=0)
            b["position_ids"] = torch.nn.functional.pad(b["position_ids"], (lead, extra), value=0)
        out.append(DataProto(b, dict(part.non_tensor), dict(part.meta), part.stage))
    return out
