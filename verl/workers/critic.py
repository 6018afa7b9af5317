"""The critic role: a value head on a copy of the policy model, trained with the clipped value loss.

The critic is an HF ``AutoModelForTokenClassification`` with one label, initialised from the policy's weights
(the classification head is new), so it saves and loads like any HF model.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from verl.algos.losses import value_loss
from verl.algos.masked import masked_mean
from verl.config import CriticConfig
from verl.errors import ModelError
from verl.models.loader import DTYPES, resolve_model_path
from verl.protocol import DataProto
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
        model = AutoModelForTokenClassification.from_pretrained(
            local, config=config, dtype=DTYPES[dtype], use_safetensors=True
        )
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
                 total_steps: int):
        self.model = model
        self.config = config
        self.ppo_epochs = config.ppo_epochs or ppo_epochs
        self.micro_batch_size = config.ppo_micro_batch_size or micro_batch_size
        self.optimizer = build_optimizer(model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.device = next(model.parameters()).device

    def _micro(self, data: DataProto) -> list[DataProto]:
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

    def update(self, data: DataProto, mini_batch_size: int) -> dict[str, float]:
        """Clipped value regression onto ``returns``; needs ``values`` (old) and ``returns``."""
        metrics: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(data))
            for start in range(0, len(data), mini_batch_size):
                mini = data.index(order[start : start + mini_batch_size])
                mask_all = mini.batch["response_mask"]
                agg = {"num_tokens": float(mask_all.sum().clamp(min=1)), "num_seqs": float(len(mini))}
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum, clip_sum, vpred_sum = 0.0, 0.0, 0.0
                for micro in self._micro(mini):
                    batch = {k: v.to(self.device) for k, v in micro.batch.items()}
                    mask = batch["response_mask"].float()
                    weight = float(mask.sum()) / agg["num_tokens"]
                    vpreds = response_values(self.model, batch)
                    loss, clipfrac = value_loss(vpreds, batch["values"], batch["returns"], mask,
                                                self.config.cliprange_value, self.config.loss_agg_mode, **agg)
                    loss.backward()
                    loss_sum += loss.item()
                    clip_sum += weight * clipfrac.item()
                    vpred_sum += weight * masked_mean(vpreds.detach(), mask).item()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                metrics["value_loss"].append(loss_sum)
                metrics["value_clipfrac"].append(clip_sum)
                metrics["vpred_mean"].append(vpred_sum)
                metrics["grad_norm"].append(float(grad_norm))
        self.scheduler.step()
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
