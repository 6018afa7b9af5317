"""DataProto: the batch's wire format between processes and roles (verl's, so verl users' reward functions read it).

A DataProto holds ``batch`` (tensors sharing the leading batch dimension), ``non_tensor`` (numpy object
arrays of the same length: prompt text, ground truth, uids ...) and ``meta`` (plain dict: temperature,
step ...). The training step itself works on the typed ``verl.batch.TrainBatch``, which converts to and from this.

Under ``VERL_STRICT_DATA_CHECK=1`` every construction and union checks the batch dimension and the shapes
of the well-known per-token fields (all ``(batch, response_len)``) and dtypes, raising
``DataProtoValidationError`` that names the field, expected vs actual shape and the producing stage.
The check is off by default because it costs a little on every call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl.errors import DataProtoValidationError

# Fields that are per response token: shape (batch, response_len) where response_len = responses.shape[1].
RESPONSE_FIELDS = ("response_mask", "old_log_probs", "ref_log_prob", "log_probs", "values", "token_level_scores",
                   "token_level_rewards", "advantages", "returns", "entropys")
# Fields that span the whole sequence: shape (batch, prompt_len + response_len).
SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")
FLOAT_FIELDS = ("old_log_probs", "ref_log_prob", "log_probs", "values", "token_level_scores",
                "token_level_rewards", "advantages", "returns", "entropys")


def strict_checks_enabled() -> bool:
    return os.environ.get("VERL_STRICT_DATA_CHECK", "0") not in ("", "0", "false", "False")


@dataclass
class DataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    stage: str = "init"

    def __post_init__(self) -> None:
        self.non_tensor = {k: _as_object_array(v) for k, v in self.non_tensor.items()}
        if strict_checks_enabled():
            self.validate(self.stage)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict[str, Sequence] | None = None,
                  meta: dict[str, Any] | None = None, stage: str = "init") -> DataProto:
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta or {}), stage)

    # ------------------------------------------------------------------ basic facts

    def __len__(self) -> int:
        for value in self.batch.values():
            return int(value.shape[0])
        for value in self.non_tensor.values():
            return len(value)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.batch:
            return self.batch[key]
        if key in self.non_tensor:
            return self.non_tensor[key]
        raise KeyError(f"DataProto has no field '{key}' (fields: {sorted(self.batch) + sorted(self.non_tensor)})")

    def keys(self) -> list[str]:
        return list(self.batch) + list(self.non_tensor)

    # ------------------------------------------------------------------ validation

    def validate(self, stage: str | None = None) -> None:
        """Check batch dimension, per-token shapes and float dtypes; raise naming field, shapes and stage."""
        stage = stage or self.stage
        size = len(self)
        for name, value in list(self.batch.items()) + list(self.non_tensor.items()):
            if value.shape[0] != size:
                raise DataProtoValidationError(
                    f"Shape mismatch in '{name}': expected batch size {size} but got {tuple(value.shape)} "
                    f"(source: {stage})"
                )
        responses = self.batch.get("responses")
        if responses is not None:
            expected = (size, responses.shape[1])
            for name in RESPONSE_FIELDS:
                value = self.batch.get(name)
                if value is not None and tuple(value.shape) != expected:
                    raise DataProtoValidationError(
                        f"Shape mismatch in '{name}': expected {expected} (batch, response_len) but got "
                        f"{tuple(value.shape)} (source: {stage})"
                    )
        seq = self.batch.get("input_ids")
        if seq is not None:
            for name in SEQUENCE_FIELDS:
                value = self.batch.get(name)
                if value is not None and value.shape != seq.shape:
                    raise DataProtoValidationError(
                        f"Shape mismatch in '{name}': expected {tuple(seq.shape)} like input_ids but got "
                        f"{tuple(value.shape)} (source: {stage})"
                    )
        for name in FLOAT_FIELDS:
            value = self.batch.get(name)
            if value is not None and not value.is_floating_point():
                raise DataProtoValidationError(
                    f"Dtype mismatch in '{name}': expected a floating-point tensor but got {value.dtype} "
                    f"(source: {stage})"
                )

    # ------------------------------------------------------------------ combination

    def union(self, other: DataProto, stage: str | None = None) -> DataProto:
        """Merge ``other``'s fields into this one (in place, returned). Shared keys must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise DataProtoValidationError(
                f"cannot union batches of size {len(self)} and {len(other)} (source: {stage or other.stage})"
            )
        for name, value in other.batch.items():
            if name in self.batch and not torch.equal(self.batch[name], value):
                raise DataProtoValidationError(
                    f"union conflict on '{name}': both batches hold different values (source: {stage or other.stage})"
                )
            self.batch[name] = value
        for name, value in other.non_tensor.items():
            if name in self.non_tensor and not np.array_equal(self.non_tensor[name], value):
                raise DataProtoValidationError(
                    f"union conflict on '{name}': both batches hold different values (source: {stage or other.stage})"
                )
            self.non_tensor[name] = value
        self.meta.update(other.meta)
        if strict_checks_enabled():
            self.validate(stage or other.stage)
        return self

    def select(self, keys: Iterable[str] | None = None, non_tensor_keys: Iterable[str] | None = None) -> DataProto:
        """A new DataProto with only the named fields (tensors shared, not copied); ``None`` keeps all of a kind."""
        tensors = {k: self.batch[k] for k in keys} if keys is not None else dict(self.batch)
        non = {k: self.non_tensor[k] for k in non_tensor_keys} if non_tensor_keys is not None else dict(self.non_tensor)
        return DataProto(tensors, non, dict(self.meta), self.stage)

    def index(self, idx: torch.Tensor | np.ndarray | slice | Sequence[int]) -> DataProto:
        """Rows ``idx`` of every field."""
        if isinstance(idx, slice):
            tensors = {k: v[idx] for k, v in self.batch.items()}
            non = {k: v[idx] for k, v in self.non_tensor.items()}
        else:
            index_np = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx)
            # A boolean mask selects rows; casting it to int64 would silently pick rows 0 and 1 instead.
            index_np = np.flatnonzero(index_np) if index_np.dtype == bool else index_np.astype(np.int64)
            index_t = torch.as_tensor(index_np)
            tensors = {k: v[index_t.to(v.device)] for k, v in self.batch.items()}
            non = {k: v[index_np] for k, v in self.non_tensor.items()}
        return DataProto(tensors, non, dict(self.meta), self.stage)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts; the batch size must divide evenly."""
        size = len(self)
        if chunks <= 0 or size % chunks:
            raise DataProtoValidationError(f"cannot split a batch of {size} into {chunks} equal chunks")
        step = size // chunks
        return [self.index(slice(i * step, (i + 1) * step)) for i in range(chunks)]

    def split(self, size: int) -> list[DataProto]:
        """Consecutive pieces of at most ``size`` rows."""
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Stack batches along the batch dimension; they must have the same fields."""
        if not parts:
            return DataProto()
        keys, non_keys = set(parts[0].batch), set(parts[0].non_tensor)
        for part in parts[1:]:
            if set(part.batch) != keys or set(part.non_tensor) != non_keys:
                raise DataProtoValidationError(
                    f"cannot concat batches with different fields: {sorted(keys)} vs {sorted(part.batch)}"
                )
        tensors = {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch}
        non = {k: np.concatenate([p.non_tensor[k] for p in parts]) for k in parts[0].non_tensor}
        return DataProto(tensors, non, dict(parts[0].meta), parts[0].stage)

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Repeat every row ``times`` times: interleaved (a a b b) or tiled (a b a b)."""
        if interleave:
            tensors = {k: v.repeat_interleave(times, dim=0) for k, v in self.batch.items()}
            non = {k: np.repeat(v, times, axis=0) for k, v in self.non_tensor.items()}
        else:
            tensors = {k: v.repeat((times,) + (1,) * (v.dim() - 1)) for k, v in self.batch.items()}
            non = {k: np.tile(v, (times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor.items()}
        return DataProto(tensors, non, dict(self.meta), self.stage)

    def to(self, device: torch.device | str) -> DataProto:
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    def pop(self, keys: Iterable[str]) -> DataProto:
        """Remove the named tensor fields and return them as a new DataProto."""
        return DataProto({k: self.batch.pop(k) for k in keys}, {}, dict(self.meta), self.stage)


def pad_tokens(sequences: Sequence[Sequence[int]], pad_id: int, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists padded to the longest: ``(input_ids, attention_mask)``, each ``(batch, longest)``; left-padded
    (right-aligned, as generation reads prompts) or right-padded (what a sequence classifier reads at each row's
    last attended token)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[i, cols] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


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


def _as_object_array(value: Sequence | np.ndarray) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    array = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        array[i] = item
    return array
