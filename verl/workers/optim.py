"""Optimizer and learning-rate schedule shared by the actor, the critic and the SFT trainer."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from verl.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    trainable = [p for p in params if p.requires_grad]
    # The fused CPU AdamW kernel is markedly faster than the per-tensor loop on small models.
    fused = all(p.device.type in ("cpu", "cuda") for p in trainable) and all(p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(trainable, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay, fused=fused or None)


def lr_multiplier(step: int, config: OptimConfig, total_steps: int) -> float:
    """Warmup to 1.0 over ``warmup_steps``, then constant / cosine / linear decay to ``min_lr_ratio``."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = config.lr_scheduler == "cosine"
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cosine else 1.0 - progress
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, config, total_steps))
