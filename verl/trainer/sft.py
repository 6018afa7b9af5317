"""Supervised fine-tuning: next-token loss on responses only (the warm start before RL).

``verl sft --config configs/sft_tiny.yaml`` trains ``builtin:tiny-arith-base`` on the arithmetic task's
mixed-format answers; the result, copied to ``verl/models/assets/tiny-arith``, is ``builtin:tiny-arith``, the
default model of ``verl train``. Validation generates greedily and reports strict and flexible accuracy exactly
as the RL trainer does.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from verl.config import DataConfig, RewardConfig, SFTConfig, build_config
from verl.data.dataset import RLHFDataset, get_nested, prompt_text, read_rows
from verl.errors import ConfigError, DataError
from verl.models.loader import load_causal_lm
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.registry import tools_for_row
from verl.tools.templates import ConversationTokens, ToolPrompting
from verl.trainer.run import Run, set_up
from verl.trainer.validation import generate_and_score, validation_metrics
from verl.utils import log
from verl.utils.fs import atomic_dir
from verl.workers.optim import build_optimizer, build_scheduler
from verl.workers.reward import RewardManager


class SFTDataset:
    """Supervised examples as token ids with a loss mask, from either

    - prompt/response pairs: ``template(prompt) + response + eos``, the loss on the response; or
    - whole conversations (``data.messages_key``, tool calls and results included): built turn by turn exactly as
      the multi-turn rollout builds a trajectory (``ConversationTokens.conversation``), the loss on the assistant
      turns only, so the warm start and RL see the same tokens.
    """

    def __init__(self, files: list[str], tokenizer, config: SFTConfig, tools: ToolPrompting | None = None):
        data = config.data
        rows = read_rows(files, "data.train_files", data.arithmetic)
        conversations = data.messages_key in rows[0]
        if not conversations and (data.response_key not in rows[0] or data.prompt_key not in rows[0]):
            columns = [c for c in rows[0] if not c.startswith("__")]
            raise DataError(
                f"{rows[0]['__source_file__']}: SFT needs columns '{data.prompt_key}' (data.prompt_key) and "
                f"'{data.response_key}' (data.response_key), or conversations in '{data.messages_key}' "
                f"(data.messages_key); columns are {columns}"
            )
        self.examples: list[tuple[list[int], list[int]]] = []  # (token ids, loss mask)
        self.num_dropped = 0
        for row in rows:
            where = f"{row['__source_file__']} row {row['__row__']}"
            ids, mask = (self._conversation(row, tokenizer, data.messages_key, tools, where) if conversations
                         else self._pair(row, tokenizer, data, where))
            if len(ids) > data.max_length:
                self.num_dropped += 1
                continue
            self.examples.append((ids, mask))
        self.pad_id = tokenizer.pad_token_id

    @staticmethod
    def _pair(row: dict, tokenizer, data, where: str) -> tuple[list[int], list[int]]:
        prompt = prompt_text(row[data.prompt_key], tokenizer, True, where)
        response = get_nested(row, data.response_key)
        if not isinstance(response, str):
            raise DataError(f"{where}: '{data.response_key}' must be a string")
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(response + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
        return p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids)

    @staticmethod
    def _conversation(row: dict, tokenizer, key: str, tools: ToolPrompting | None,
                      where: str) -> tuple[list[int], list[int]]:
        messages = row[key]
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: '{key}' is not JSON ({exc.msg})") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f"{where}: '{key}' must be a list of {{role, content}} messages")
        if tools is None:
            template, schemas = tokenizer.chat_template, None
        else:
            names, _ = tools_for_row(row, tools.tool_set, where)
            template, schemas = tools.template, tools.tool_set.schemas(names)
        try:
            return ConversationTokens(tokenizer, template, schemas).conversation(messages)
        except ConfigError as exc:
            raise DataError(f"{where}: {exc}") from None

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the loss mask), (batch, len)."""
        width = max(len(self.examples[i][0]) for i in indices)
        ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(indices):
            tokens, loss_mask = self.examples[i]
            ids[row, : len(tokens)] = torch.as_tensor(tokens)
            mask[row, : len(tokens)] = 1
            labels[row, : len(tokens)] = torch.where(torch.as_tensor(loss_mask, dtype=torch.bool),
                                                      torch.as_tensor(tokens), -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SFTTrainer:
    def __init__(self, config: SFTConfig, quiet: bool = False):
        self.config = config
        self.quiet = quiet
        self.device, self.tokenizer = set_up(config)
        self.model = load_causal_lm(config.model.path, config.model.dtype, self.device)
        tools = ToolPrompting.from_config(config.rollout.multi_turn, self.tokenizer)
        self.train_data = SFTDataset(config.data.train_files, self.tokenizer, config, tools)
        val_config = DataConfig(val_files=config.data.val_files, max_prompt_length=config.data.max_prompt_length,
                                max_response_length=config.data.max_response_length, arithmetic=config.data.arithmetic,
                                ground_truth_key=config.data.ground_truth_key, prompt_key=config.data.prompt_key)
        self.val_data = (
            RLHFDataset(config.data.val_files, self.tokenizer, val_config, "data.val_files", tools=tools)
            if config.data.val_files else None
        )
        self.reward = RewardManager(self.tokenizer, RewardConfig())
        self.engine = HFRollout(self.model, self.tokenizer)
        if tools is not None:  # validate as the RL rollout runs: tools called, results fed back
            self.engine = AgentRollout(self.engine, config.rollout.multi_turn, config.data.max_response_length)
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.trainer.total_steps)
        self.run = Run(config, quiet).open()
        self.run_dir, self.logger = self.run.dir, self.run.logger

    def validate(self) -> dict[str, float]:
        assert self.val_data is not None
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.config.data.max_response_length)
        batch, scores, extras, _ = generate_and_score(self.engine, self.val_data, self.reward, params, batch_size=256,
                                                      max_samples=self.config.data.val_max_samples)
        return validation_metrics(batch, scores, extras)

    def fit(self) -> Path:
        cfg = self.config.trainer
        rng = np.random.default_rng(cfg.seed)
        order = rng.permutation(len(self.train_data))
        cursor = 0
        batch_size = self.config.data.batch_size
        self.model.train()
        progress = Progress(TextColumn("sft"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            disable=self.quiet)
        try:
            with progress, self.run.bound():
                task = progress.add_task("sft", total=cfg.total_steps)
                # started / finished, as the policy trainer logs them: the dashboard and `verl eval --watch` read them
                self.logger.event("train", step=0, status="started", run_dir=str(self.run_dir))
                if self.val_data is not None and cfg.test_freq > 0:
                    self.logger.set_step(0)
                    self.logger.log_step(0, log.scoped("eval", self.validate()))
                for step in range(1, cfg.total_steps + 1):
                    start = time.perf_counter()
                    if cursor + batch_size > len(order):
                        order, cursor = rng.permutation(len(self.train_data)), 0
                    batch = self.train_data.batch(order[cursor : cursor + batch_size].tolist())
                    cursor += batch_size
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    loss = self.model(**batch).loss
                    loss.backward()
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    self.logger.set_step(step)
                    metrics = log.scoped("train", {"loss": loss.item(), "grad_norm": float(grad_norm),
                                               "lr": self.scheduler.get_last_lr()[0],
                                               "step_time": time.perf_counter() - start})
                    last = step == cfg.total_steps
                    if self.val_data is not None and cfg.test_freq > 0 and (step % cfg.test_freq == 0 or last):
                        metrics.update(log.scoped("eval", self.validate()))
                    if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
                        self.run.save_checkpoint(step, self.model, self.tokenizer,
                                                 {"step": step, "optimizer": self.optimizer.state_dict()})
                    self.logger.log_step(step, metrics)
                    progress.advance(task)
                self.logger.event("train", step=cfg.total_steps, status="finished", reason="total_steps")
        finally:
            self.run.close()
            self.engine.shutdown()  # the tool runner's threads and processes, when there is one
        return self.run_dir / "checkpoints" / f"global_step_{cfg.total_steps}"


# The SFT settings that rebuild the shipped warm starts: tiny-arith is the SFT defaults (configs/sft_tiny.yaml);
# tiny-agent is configs/sft_agent_tiny.yaml, restated here so a package without configs/ can rebuild it (a test
# keeps the two equal).
AGENT_WARM_START: dict = {
    "model": {"path": "builtin:tiny-agent-base"},
    "data": {"train_files": ["builtin:tool_arithmetic/sft_train"], "val_files": ["builtin:tool_arithmetic/val"],
             "batch_size": 64, "max_length": 192, "max_prompt_length": 64, "max_response_length": 128,
             "val_max_samples": 128},
    "rollout": {"multi_turn": {"enable": True, "tools": ["calculator"]}},
    "optim": {"lr": 1.0e-3, "warmup_steps": 50, "lr_scheduler": "cosine", "min_lr_ratio": 0.1},
    "trainer": {"project_name": "verl-sft", "total_steps": 1600, "test_freq": 400, "seed": 0, "num_threads": 1},
}
WARM_STARTS: dict[str, dict] = {"tiny-arith": {}, "tiny-agent": AGENT_WARM_START}


def train_builtin_warm_start(target: Path, name: str = "tiny-arith") -> None:
    """Reproduce the shipped warm start ``builtin:<name>`` (``WARM_STARTS``) into ``target``."""
    if name not in WARM_STARTS:
        raise ConfigError(f"no shipped warm start named '{name}'; rebuildable: {', '.join(WARM_STARTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        settings = copy.deepcopy(WARM_STARTS[name])
        settings.setdefault("trainer", {}).update(output_dir=tmp, experiment_name="warm-start", logger=["jsonl"],
                                                  test_freq=-1)
        config = build_config(settings, schema=SFTConfig)
        checkpoint = SFTTrainer(config, quiet=False).fit()
        with atomic_dir(target, overwrite=True) as out:
            for item in checkpoint.iterdir():
                if item.name not in ("trainer_state.pt", "meta.json"):
                    shutil.copy2(item, out / item.name)
