"""Reward-model training: ``verl rm`` — a Bradley–Terry model on preference pairs.

The model is the causal LM's backbone with a one-output head (``AutoModelForSequenceClassification``,
``num_labels=1``): the score of a text is the head's output at its last token. For a pair the loss is
``-log sigmoid(r_chosen - r_rejected)``, the negative log-likelihood of the observed preference under
Bradley–Terry (P(chosen > rejected) = sigmoid of the score difference), as TRL's ``RewardTrainer`` trains it.
Full fine-tuning or LoRA (``model.lora.rank``; the head is always trained in full and checkpoints are merged, so
every checkpoint loads with ``AutoModelForSequenceClassification.from_pretrained``).

The run directory is the one every other command knows: ``config.yaml``, ``verl_logs.jsonl`` (scopes ``train``
and ``eval``), trackers, ``checkpoints/global_step_N`` with ``latest`` and ``best`` (highest held-out pairwise
accuracy) pointers. Logged: the pairwise loss, accuracy (share of pairs with ``r_chosen > r_rejected``; ties count
as wrong) and mean margin ``r_chosen - r_rejected``, on training batches and on the held-out pairs.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, TaskType, get_peft_model
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from verl.config import RMConfig
from verl.data.dataset import read_rows
from verl.data.pairs import Pair, read_pair
from verl.errors import DataError, ModelError
from verl.models.loader import DTYPES, resolve_model_path
from verl.models.sequence_scores import sequence_scores
from verl.protocol import pad_tokens
from verl.trainer.checkpoint import write_pointer
from verl.trainer.run import Run, set_up
from verl.utils import log
from verl.workers.optim import build_optimizer, build_scheduler

VALIDATION_METRIC = "eval/pairwise_accuracy"  # what `verl rm` validates on, and ranks its checkpoints by


class PairData:
    """Preference pairs as token ids: ``(chosen ids, rejected ids)`` per pair, pairs longer than ``max_length``
    tokens on either side dropped (counted in ``num_dropped``)."""

    def __init__(self, files: list[str], config_key: str, tokenizer, config: RMConfig, max_pairs: int | None = None):
        data = config.data
        rows = read_rows(files, config_key, data.arithmetic, layout="pairs")
        if max_pairs is not None:
            rows = rows[:max_pairs]
        self.pairs: list[Pair] = []
        self.ids: list[tuple[list[int], list[int]]] = []
        self.num_dropped = 0
        pairs = [read_pair(row, tokenizer, data.prompt_key, data.chosen_key, data.rejected_key) for row in rows]
        # One batched call per side: per-text calls cost ~1.5 ms each (a minute for 20,000 pairs).
        def encode(texts: list[str]) -> list[list[int]]:
            return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        chosen_ids = encode([p.prompt + p.chosen for p in pairs])
        rejected_ids = encode([p.prompt + p.rejected for p in pairs])
        for pair, chosen, rejected in zip(pairs, chosen_ids, rejected_ids, strict=True):
            if max(len(chosen), len(rejected)) > data.max_length:
                self.num_dropped += 1
                continue
            self.pairs.append(pair)
            self.ids.append((chosen, rejected))
        if not self.ids:
            raise DataError(f"{config_key}: no pair fits data.max_length={data.max_length} tokens "
                            f"({self.num_dropped} dropped); raise data.max_length")
        self.pad_id = tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``attention_mask``, (2 * batch, len), right-padded: the chosen sides of the pairs in
        order, then their rejected sides."""
        ids, mask = pad_tokens([self.ids[i][0] for i in indices] + [self.ids[i][1] for i in indices], self.pad_id,
                               left=False)
        return {"input_ids": ids, "attention_mask": mask}


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley–Terry negative log-likelihood, mean over pairs; ``chosen``, ``rejected``: (pairs,) scores."""
    return -F.logsigmoid(chosen - rejected).mean()


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Loss, accuracy (strictly higher chosen score) and margins of (pairs,) scores."""
    margin = (chosen - rejected).float()
    return {"loss": float(pairwise_loss(chosen.float(), rejected.float())),
            "accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean()),
            "reward_chosen": float(chosen.float().mean()), "reward_rejected": float(rejected.float().mean())}


def pair_scores(model, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores, each (pairs,), of a ``PairData.batch`` (chosen sides first, then rejected)."""
    logits = sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))[:, 0]
    half = logits.shape[0] // 2
    return logits[:half], logits[half:]


@torch.no_grad()
def score_pairs(model, data: PairData, device: torch.device, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores, each (len(data),), of every pair of ``data``, ``batch_size`` pairs a forward."""
    chosen, rejected = [], []
    for start in range(0, len(data), batch_size):
        c, r = pair_scores(model, data.batch(list(range(start, min(start + batch_size, len(data))))), device)
        chosen.append(c)
        rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


def load_reward_model(path: str, dtype: str, device: torch.device, pad_token_id: int):
    """A sequence-classification model with one output from ``path`` (a causal LM checkpoint gets a new, seeded
    head; a reward model keeps its own)."""
    local = resolve_model_path(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights newly initialized": the head, by design
    try:
        model = AutoModelForSequenceClassification.from_pretrained(local, num_labels=1, dtype=DTYPES[dtype])
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"model.path: cannot build a reward model from '{path}': {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id  # transformers' own forward needs it; we read by the mask
    return model.to(device)


class RewardModelTrainer:
    """``verl rm``: see the module docstring."""

    def __init__(self, config: RMConfig, quiet: bool = False):
        self.config = config
        self.quiet = quiet
        self.device, self.tokenizer = set_up(config)
        self.model = load_reward_model(config.model.path, config.model.dtype, self.device, self.tokenizer.pad_token_id)
        if config.model.lora.rank > 0:
            self.model = self._with_lora(self.model)
        self.train_data = PairData(config.data.train_files, "data.train_files", self.tokenizer, config,
                                   config.data.train_max_samples)
        self.val_data = (PairData(config.data.val_files, "data.val_files", self.tokenizer, config,
                                  config.data.val_max_samples) if config.data.val_files else None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.trainer.total_steps)
        self.run = Run(config, quiet).open()
        self.run_dir, self.logger = self.run.dir, self.run.logger
        self.best_accuracy = -1.0

    def _with_lora(self, model):
        lora = self.config.model.lora
        # SEQ_CLS keeps the new head ("score") trainable in full beside the adapters.
        return get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=lora.rank, lora_alpha=lora.alpha,
                                                lora_dropout=lora.dropout, target_modules=lora.target_modules))

    def scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores, each (pairs,), of a ``PairData.batch``."""
        return pair_scores(self.model, batch, self.device)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        assert self.val_data is not None
        self.model.eval()
        chosen, rejected = score_pairs(self.model, self.val_data, self.device)
        self.model.train()
        metrics = pair_metrics(chosen, rejected)
        metrics["pairwise_accuracy"] = metrics.pop("accuracy")
        return metrics

    def _save(self, step: int, metrics: dict[str, float]) -> Path:
        model = self.model
        if self.config.model.lora.rank > 0:  # a merged copy: the checkpoint loads without peft
            model = copy.deepcopy(self.model).merge_and_unload()
        path = self.run.save_checkpoint(step, model, self.tokenizer, {"step": step, "kind": "reward_model"}, metrics)
        accuracy = metrics.get(VALIDATION_METRIC)
        if accuracy is not None and accuracy > self.best_accuracy:
            self.best_accuracy = accuracy
            write_pointer(self.run_dir, path, "best")
        return path

    def _train_step(self, indices: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        chosen, rejected = self.scores(self.train_data.batch(indices))
        loss = pairwise_loss(chosen, rejected)
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = pair_metrics(chosen.detach(), rejected.detach())
        metrics.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0],
                       step_time=time.perf_counter() - start)
        return metrics

    def fit(self) -> Path:
        """Train ``trainer.total_steps`` steps of ``data.batch_size`` pairs; the last checkpoint's path."""
        cfg = self.config.trainer
        rng = np.random.default_rng(cfg.seed)
        order, cursor = rng.permutation(len(self.train_data)), 0
        batch_size = min(self.config.data.batch_size, len(self.train_data))
        validating = self.val_data is not None and cfg.test_freq > 0
        self.model.train()
        progress = Progress(TextColumn("rm"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            disable=self.quiet)
        last_path = self.run_dir
        try:
            with progress, self.run.bound():
                task = progress.add_task("rm", total=cfg.total_steps)
                # started / finished, as the policy trainer logs them: the dashboard and `verl eval --watch` read them
                self.logger.event("train", step=0, status="started", run_dir=str(self.run_dir))
                self.logger.log_step(0, {"data/train_pairs": len(self.train_data),
                                         "data/dropped_pairs": self.train_data.num_dropped,
                                         **(log.scoped("eval", self.validate()) if validating else {})})
                for step in range(1, cfg.total_steps + 1):
                    if cursor + batch_size > len(order):
                        order, cursor = rng.permutation(len(self.train_data)), 0
                    self.logger.set_step(step)
                    metrics = log.scoped("train", self._train_step(order[cursor: cursor + batch_size].tolist()))
                    cursor += batch_size
                    last = step == cfg.total_steps
                    if validating and (step % cfg.test_freq == 0 or last):
                        metrics.update(log.scoped("eval", self.validate()))
                    if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
                        last_path = self._save(step, metrics)
                    self.logger.log_step(step, metrics)
                    progress.advance(task)
                self.logger.event("train", step=cfg.total_steps, status="finished", reason="total_steps")
        finally:
            self.run.close()
        return last_path
