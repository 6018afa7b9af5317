"""Parquet prompt datasets: ``RLHFDataset`` (prompts for RL) and ``SFTDataset`` (prompt + response pairs).

``RLHFDataset``: parquet -> chat template -> token ids, filtered or truncated to ``max_prompt_length``
(counts kept in ``num_filtered`` / ``num_truncated``). ``collate(indices)`` returns a ``DataProto`` of
left-padded ``input_ids``/``attention_mask``/``position_ids`` of shape ``(batch, longest prompt in batch)`` plus
the raw prompt text, ground truth, data source and extra info as non-tensor fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from verl.batch import content_ids
from verl.config import ArithmeticTaskConfig, DataConfig
from verl.data.exports import Layout, export_file
from verl.data.sources import resolve_data_file
from verl.data.tasks.arithmetic import ArithmeticSpec
from verl.errors import DataError
from verl.protocol import DataProto, pad_tokens
from verl.tools.registry import environment_tools, tools_for_row
from verl.tools.templates import ToolPrompting


def arithmetic_spec(task: ArithmeticTaskConfig) -> ArithmeticSpec:
    return ArithmeticSpec(min_digits=task.min_digits, max_digits=task.max_digits, ops=tuple(task.ops),
                          num_train=task.num_train, num_val=task.num_val, seed=task.seed)


def read_rows(files: Sequence[str], config_key: str, task: ArithmeticTaskConfig | None = None,
              layout: Layout = "prompts", disjoint_from: Sequence[str] = ()) -> list[dict]:
    """Read every row of ``files`` (parquet, a source name such as ``builtin:TASK/SPLIT`` or
    ``reasoning_gym:DATASET``, or a ``verl data from-records`` export directory: its prompts or, with
    ``layout="pairs"``, its preference pairs), naming the config key in any error. ``disjoint_from``: the training
    sources when ``files`` are validation data (verl.data.sources)."""
    if not files:
        raise DataError(f"{config_key} is empty; give at least one parquet file")
    spec = arithmetic_spec(task or ArithmeticTaskConfig())
    rows: list[dict] = []
    for name in files:
        path = resolve_data_file(str(name), spec, disjoint_from)
        if path.is_dir():
            path = export_file(path, config_key, layout)
        if not path.is_file():
            raise DataError(f"{config_key}: file '{path}' does not exist")
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several unrelated types for bad files
            raise DataError(f"{config_key}: cannot read '{path}' as parquet ({exc})") from None
        for index, row in enumerate(table.to_pylist()):
            row["__source_file__"] = str(path)
            row["__row__"] = index  # the row number inside its own file, for error messages
            row["__source__"] = str(name)  # as the config names it: the sample identity's source
            rows.append(row)
    return rows


def generated_key(row: dict) -> str | None:
    """``items@seed+index`` of a row a generated source wrote (``extra_info`` has the three: ``items`` names the
    generator and its config), else None."""
    info = row.get("extra_info")
    if isinstance(info, dict) and all(info.get(k) is not None for k in ("items", "seed", "index")):
        return f"{info['items']}@{info['seed']}+{info['index']}"
    return None


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A row's prompt as chat messages (a plain string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")} for m in prompt]


def get_nested(row: dict, dotted: str) -> Any:
    """``row['a']['b']`` for ``'a.b'``; a literal key containing dots wins; None when absent."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def prompt_text(prompt: Any, tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool, where: str,
                tools: list[dict] | None = None, template: str | None = None) -> str:
    """The exact text fed to the model for one prompt (chat template applied to message lists); with ``tools``
    (OpenAI schemas) rendered by the tool ``template``."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in prompt):
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    else:
        raise DataError(f"{where}: prompt must be a string or a list of {{role, content}} messages, got {prompt!r:.80}")
    if tools is not None:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             add_generation_prompt=True, tokenize=False)
    if apply_chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens: ``(batch, seq)``; padding positions are 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask


class RLHFDataset:
    """Prompts for RL training and validation, tokenized once up front."""

    def __init__(self, data_files: Sequence[str] | str, tokenizer: PreTrainedTokenizerBase,
                 config: DataConfig | dict | None = None, config_key: str = "data.train_files",
                 require_ground_truth: bool = True, tools: ToolPrompting | None = None,
                 disjoint_from: Sequence[str] = ()):
        """``require_ground_truth``: every row must hold ``data.ground_truth_key`` (rule rewards score a row
        without one as 0, silently); the trainer turns it off for reward models and custom reward functions.
        ``tools`` (multi-turn rollouts): each prompt is rendered with its row's tools (``tools_for_row``), whose
        names and hidden arguments travel with it (``tool_names``, ``tool_kwargs``). ``disjoint_from``: the
        training sources, for validation data (generated sources then hold none of their items)."""
        if isinstance(data_files, (str, Path)):
            data_files = [str(data_files)]
        self.config = config if isinstance(config, DataConfig) else DataConfig(**(config or {}))
        self.tokenizer = tokenizer
        rows = read_rows(list(data_files), config_key, self.config.arithmetic, disjoint_from=disjoint_from)
        self._check_columns(rows, config_key)
        if require_ground_truth:
            self._check_ground_truth(rows)
        self.num_filtered = 0
        self.num_truncated = 0
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.tools = tools
        texts = []
        for r in rows:
            where = f"{r['__source_file__']} row {r['__row__']}"
            schemas, template = None, None
            if tools is not None:
                r["__tool_names__"], r["__tool_kwargs__"] = tools_for_row(r, tools.tool_set, where)
                brought = environment_tools(r, where)  # an env: class's methods
                schemas = tools.tool_set.schemas(r["__tool_names__"]) + brought
                template = tools.template_for(brought)
            texts.append(prompt_text(r[self.config.prompt_key], tokenizer, self.config.apply_chat_template, where,
                                     schemas, template))
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        limit = self.config.max_prompt_length
        for row, text, ids in zip(rows, texts, encoded, strict=True):
            if len(ids) > limit:
                mode = self.config.truncation
                if mode == "error":
                    raise DataError(
                        f"{row['__source_file__']} row {row['__row__']}: prompt has {len(ids)} tokens > "
                        f"data.max_prompt_length={limit}; raise the limit or set data.truncation=filter|left|right"
                    )
                if mode == "filter":
                    self.num_filtered += 1
                    continue
                ids = ids[-limit:] if mode == "left" else ids[:limit]
                self.num_truncated += 1
            row["__prompt_text__"] = text
            self.rows.append(row)
            self.prompt_ids.append(list(ids))
        # The identity key of each row: a generated source's (seed, index) (reasoning_gym: rows), else its raw prompt's
        # content (not the rendering, which a template changes), so two runs on the same items pair.
        content = content_ids([r.get(self.config.prompt_key) for r in self.rows])
        self.sample_keys = [generated_key(r) or key for r, key in zip(self.rows, content, strict=True)]
        if not self.rows:
            raise DataError(
                f"{config_key}: no prompt fits data.max_prompt_length={limit} ({self.num_filtered} filtered); "
                "raise the limit or set data.truncation=left"
            )

    def _check_columns(self, rows: list[dict], config_key: str) -> None:
        if not rows:
            raise DataError(f"{config_key}: the parquet files hold no rows")
        # Files can differ in their columns: find any row (i.e. any file) without the prompt column.
        first = next((r for r in rows if self.config.prompt_key not in r), None)
        if first is not None:
            columns = [c for c in first if not c.startswith("__")]
            raise DataError(
                f"{first['__source_file__']}: no prompt column '{self.config.prompt_key}' (data.prompt_key); "
                f"columns are {columns}; set data.prompt_key=<column>"
            )

    def _check_ground_truth(self, rows: list[dict]) -> None:
        key = self.config.ground_truth_key
        missing = next((r for r in rows if get_nested(r, key) is None and r.get("ground_truth") is None), None)
        if missing is not None:
            columns = [c for c in missing if not c.startswith("__")]
            raise DataError(
                f"{missing['__source_file__']} row {missing['__row__']}: no ground truth at '{key}' "
                f"(data.ground_truth_key; columns are {columns}); a rule reward would score it 0. Set "
                "data.ground_truth_key=<column>, or use reward.model.path / reward.custom_reward for rewards that "
                "need none"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def ground_truth(self, i: int) -> Any:
        row = self.rows[i]
        value = get_nested(row, self.config.ground_truth_key)
        if value is None and "ground_truth" in row:
            value = row["ground_truth"]
        return value

    def collate(self, indices: Sequence[int]) -> DataProto:
        ids, mask = pad_tokens([self.prompt_ids[i] for i in indices], self.tokenizer.pad_token_id)
        rows = [self.rows[i] for i in indices]
        return DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)},
            non_tensors={
                "raw_prompt": [r["__prompt_text__"] for r in rows],
                "ground_truth": [self.ground_truth(i) for i in indices],
                "data_source": [r.get("data_source") or "unknown" for r in rows],
                "extra_info": [r.get("extra_info") or {} for r in rows],
                "index": np.asarray(indices, dtype=np.int64),
                "sample_source": [r["__source__"] for r in rows],
                "sample_key": [self.sample_keys[i] for i in indices],
                "sample_index": np.asarray([r["__row__"] for r in rows], dtype=np.int64),
                # the conversation an environment or a gateway agent reads: the prompt's messages, not rendered
                "prompt_messages": [as_messages(r[self.config.prompt_key]) for r in rows],
                **({"tool_names": [r["__tool_names__"] for r in rows],
                    "tool_kwargs": [r["__tool_kwargs__"] for r in rows]}
                   if self.tools is not None else {}),
            },
            stage="dataset",
        )


class PromptSampler:
    """Yields index batches epoch after epoch; its state (epoch, position) makes resume exact."""

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int = 0):
        if size < batch_size:
            raise DataError(f"the dataset has {size} prompts, fewer than data.train_batch_size={batch_size}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.size)

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.size:  # drop the ragged tail, start a new epoch
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position : self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
