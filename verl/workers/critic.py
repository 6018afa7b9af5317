"""The critic role: a value head on a copy of the policy model, trained with the clipped value loss.

The critic is an HF ``AutoModelForTokenClassification`` with one label, initialised from the policy's weights
(the classification head is new), so it saves and loads like any HF model.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from verl.algos.losses import global_agg_denominators, value_loss
from verl.algos.masked import masked_mean
from verl.batch import TrainBatch
from verl.config import CriticConfig
from verl.errors import ModelError
from verl.models.loader import DTYPES, resolve_model_path
from verl.protocol import DataProto
from verl.workers.dist import DistInfo, all_reduce_gradients, all_reduce_sums, grad_norm_value, local_shard
from verl.workers.forward import response_values
from verl.workers.optim import build_optimizer, build_scheduler

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def load_critic_model(path: str, dtype: str, device: torch.device) -> torch.nn.Module:
    local = resolve_model_path(path)
    try:
        config = AutoConfig.from_pretrained(local, num_labels=1)
        # No dropout on the value head: value targets are regression targets, noise only slows the fit.
        for key in ("classifier_dropout", "hidden_dropout", "hidden_dropout_prob"):
            if hasattr(config, key):
                setattr(config, key, 0.0)
        model = AutoModelForTokenClassification.from_pretrained(local, config=config, dtype=DTYPES[dtype],
                                                                use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot build a critic (token-classification head) from '{path}': {exc}") from None
    # A zero-initialised head starts every value at 0: a neutral baseline instead of random noise.
    head = model.score if hasattr(model, "score") else model.classifier
    torch.nn.init.zeros_(head.weight)
    if getattr(head, "bias", None) is not None:
        torch.nn.init.zeros_(head.bias)
    return model.to(device)


class Critic:
    def __init__(self, model: torch.nn.Module, config: CriticConfig, ppo_epochs: int, micro_batch_size: int | None,
                 total_steps: int, dist_info: DistInfo | None = None, seed: int = 0):
        self.model = model
        self.dist = dist_info or DistInfo()
        self.shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.config = config
        self.ppo_epochs = config.ppo_epochs or ppo_epochs
        self.micro_batch_size = config.ppo_micro_batch_size or micro_batch_size
        self.optimizer = build_optimizer(model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.device = next(model.parameters()).device

    def _micro(self, data: DataProto | TrainBatch) -> list[DataProto | TrainBatch]:
        return data.split(self.micro_batch_size) if self.micro_batch_size else [data]

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values ``(batch, response_len)``, zero outside the response mask."""
        self.model.eval()
        parts = []
        for micro in self._micro(data):
            batch = {k: micro.batch[k].to(self.device) for k in MODEL_KEYS}
            parts.append(response_values(self.model, batch).cpu() * micro.batch["response_mask"])
        self.model.train()
        return torch.cat(parts)

    def update(self, data: TrainBatch, mini_batch_size: int) -> dict[str, float]:
        """Clipped value regression onto ``returns``; needs ``values`` (old) and ``returns``."""
        metrics: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(data), generator=self.shuffle_generator)
            for start in range(0, len(data), mini_batch_size):
                mini = data.index(order[start : start + mini_batch_size])
                agg = global_agg_denominators(mini.response_mask)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum, clip_sum, vpred_sum = 0.0, 0.0, 0.0
                for micro in self._micro(local_shard(mini, self.dist)):
                    micro = micro.to(self.device)
                    mask = micro.response_mask.float()
                    weight = float(mask.sum()) / agg["num_tokens"]
                    vpreds = response_values(self.model, micro.tensors(MODEL_KEYS))
                    loss, clipfrac = value_loss(vpreds, micro.values, micro.returns, mask,
                                                self.config.cliprange_value, self.config.loss_agg_mode, **agg)
                    (loss * self.dist.loss_scale).backward()
                    loss_sum += loss.item()
                    clip_sum += weight * clipfrac.item()
                    vpred_sum += weight * masked_mean(vpreds.detach(), mask).item()
                params = [p for p in self.model.parameters() if p.requires_grad]
                all_reduce_gradients(params, self.dist)
                grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(params, self.config.optim.grad_clip))
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                sums = all_reduce_sums({"value_loss": loss_sum, "value_clipfrac": clip_sum, "vpred_mean": vpred_sum},
                                       self.dist)
                for key, value in sums.items():
                    metrics[key].append(value)
                metrics["grad_norm"].append(grad_norm)
        self.scheduler.step()
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "shuffle_generator": self.shuffle_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "shuffle_generator" in state:
            self.shuffle_generator.set_state(state["shuffle_generator"])
