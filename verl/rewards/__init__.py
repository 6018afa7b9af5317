"""Reward functions (rule-based, custom, reward model)."""

from verl.rewards.registry import REWARD_FNS, get_reward_fn, register_reward, reward_for_data_source

__all__ = ["REWARD_FNS", "get_reward_fn", "register_reward", "reward_for_data_source"]
