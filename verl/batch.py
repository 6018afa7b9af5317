"""The typed batch of a training step: what rollout, reward, advantage, update and metrics hand each other.

``TrainBatch``'s fields say what a stage receives: a tensor a stage has not produced yet is ``None``, and whose
log-probs anchor the PPO ratio is the ``anchor`` field, not the presence of a key (docs/architecture.md §3). Rows
are prompts x n samples, a prompt's samples adjacent; per-token fields are ``(batch, response_len)``, sequence fields
``(batch, prompt_len + response_len)``.

Between processes (the role workers, Ray, the one-step off-policy worker's shared memory) a batch travels as a
``DataProto`` with verl's key names (``to_proto`` / ``from_proto``), so verl users' reward functions keep reading
``data.batch["responses"]`` and ``data.non_tensor["ground_truth"]`` as they do in verl.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto, pad_responses

SEQUENCE = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
OPTIONAL = ("rollout_log_probs", "behaviour_trainer_log_probs", "old_log_probs", "ref_log_prob", "values",
            "reward_baselines", "token_level_scores", "token_level_rewards", "advantages", "returns",
            "rollout_is_weights", "update_mask")
WIRE_NAMES = {"update_mask": "rollout_rs_mask"}  # the field's name in a DataProto, where it differs
IDENTITY = {"source": "sample_source", "key": "sample_key", "index": "sample_index", "sample": "sample"}
TURN_COLUMNS = {"turns": "num_turns", "tool_calls": "num_tool_calls", "valid_calls": "num_valid_calls",
                "tool_errors": "num_tool_errors", "finish_reason": "finish_reason", "trace": "tool_trace",
                "turn_rewards": "turn_rewards", "env_error": "env_error", "env": "env_name",
                "env_seconds": "env_seconds", "env_steps": "env_steps"}


class Anchor(str, Enum):
    """Whose log-probs the PPO ratio is taken against."""

    CURRENT = "current"  # on-policy: the update's own forward, detached (one epoch, one mini-batch): none carried
    TRAINER = "trainer"  # the trainer's forward at the weights that sampled (several epochs or mini-batches)
    ROLLOUT = "rollout"  # the engine's own (bypass mode, one-step off-policy)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (numpy scalars and arrays to Python ones; anything else by ``str``)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return str(value)


def content_ids(values: list[Any]) -> list[str]:
    """A stable id per value from its content (sha1 of its JSON); a repeated value gets ``#2``, ``#3`` ..."""
    ids, seen = [], {}
    for value in values:
        content = json.dumps(jsonable(value), sort_keys=True, ensure_ascii=False)
        base = hashlib.sha1(content.encode()).hexdigest()[:16]
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return ids


@dataclass
class SampleIds:
    """Which sample a row is, independent of the model's template: ``(source, key, index, sample)``, each
    ``(batch,)``. ``source``: the file (or environment) the prompt came from; ``key``: the seed or document id where
    the source has one, else the content id of the raw prompt (so runs with different chat templates pair);
    ``index``: the row in its source; ``sample``: which of the prompt's n samples."""

    source: np.ndarray
    key: np.ndarray
    index: np.ndarray
    sample: np.ndarray

    def rows(self, idx: np.ndarray) -> SampleIds:
        return SampleIds(self.source[idx], self.key[idx], self.index[idx], self.sample[idx])

    def tuples(self) -> list[tuple[str, str, int, int]]:
        return list(zip(self.source.tolist(), self.key.tolist(), self.index.tolist(), self.sample.tolist(),
                        strict=True))


@dataclass
class Turns:
    """A multi-turn rollout's trajectories (``verl.rollout.agent_loop``), each field ``(batch,)``: model turns, tool
    calls made, calls that parsed and fit a tool's schema, calls whose tool failed, why it ended, the tool trace, and
    the environment's per-turn rewards, failure and name (verl.envs)."""

    turns: np.ndarray
    tool_calls: np.ndarray
    valid_calls: np.ndarray
    tool_errors: np.ndarray
    finish_reason: np.ndarray
    trace: np.ndarray
    turn_rewards: np.ndarray  # each row's [(response position, reward)] from its environment (empty: none)
    env_error: np.ndarray  # why its environment failed (None: it did not)
    env: np.ndarray  # the environment that answered it (None: tools only)
    env_seconds: np.ndarray  # seconds its environment took to start and answer its turns
    env_steps: np.ndarray  # how many of those calls (its start included)

    def rows(self, idx: np.ndarray) -> Turns:
        return Turns(*(getattr(self, name)[idx] for name in TURN_COLUMNS))


@dataclass
class TrainBatch:
    """One step's samples and what the stages have computed for them (module docstring)."""

    prompts: torch.Tensor  # (batch, prompt_len), left-padded
    responses: torch.Tensor  # (batch, response_len), right-padded
    input_ids: torch.Tensor  # (batch, seq_len): prompts ++ responses
    attention_mask: torch.Tensor  # (batch, seq_len)
    position_ids: torch.Tensor  # (batch, seq_len)
    response_mask: torch.Tensor  # (batch, response_len): the model's own tokens (tool results and padding are 0)
    ids: SampleIds
    group: np.ndarray  # (batch,) int64: the advantage group (a prompt's samples; ``uid`` in verl)
    weight_version: torch.Tensor  # (batch, response_len) int64: the policy version that sampled each token
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # the dataset's columns: raw_prompt, ground_truth, ...
    turns: Turns | None = None  # multi-turn rollouts only
    anchor: Anchor = Anchor.CURRENT
    rollout_log_probs: torch.Tensor | None = None  # the engine's own log-probs of its tokens
    behaviour_trainer_log_probs: torch.Tensor | None = None  # the trainer's, at the weights that sampled
    old_log_probs: torch.Tensor | None = None  # the ratio's anchor (``anchor`` says whose); None when CURRENT
    ref_log_prob: torch.Tensor | None = None
    values: torch.Tensor | None = None  # the critic's
    reward_baselines: torch.Tensor | None = None  # (batch,): ReMax's greedy reward
    token_level_scores: torch.Tensor | None = None  # the reward, at each response's last token
    token_level_rewards: torch.Tensor | None = None  # the scores less the KL-in-reward penalty
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None  # rollout correction's importance weights
    update_mask: torch.Tensor | None = None  # rollout correction's rejection: the update's mask, not the rewards'
    # The reward's per-sample extras (``acc``, ...) and the decoded responses: the driver's, never on the wire.
    reward_extras: dict[str, np.ndarray] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.old_log_probs is None) != (self.anchor is Anchor.CURRENT):
            raise ValueError(f"a {self.anchor.value}-anchored batch must carry old_log_probs exactly when it is "
                             "not on-policy")

    def __len__(self) -> int:
        return int(self.responses.shape[0])

    # ------------------------------------------------------------------ the wire format

    @classmethod
    def from_proto(cls, data: DataProto, version: int | None = None) -> TrainBatch:
        """A batch from its ``DataProto`` (a rollout's, or one a role worker received). A rollout without the
        identity or weight-version fields gets them here: samples numbered within their group of adjacent rows,
        every token of version ``version`` (``meta['policy_version']`` when not given)."""
        tensors, non = dict(data.batch), dict(data.non_tensor)
        unknown = sorted(set(tensors) - set(SEQUENCE) - {WIRE_NAMES.get(n, n) for n in OPTIONAL} - {"weight_version"})
        if unknown:
            raise ValueError(f"the batch carries tensors no stage reads: {unknown}; add them to verl.batch.TrainBatch")
        size = int(tensors["responses"].shape[0])
        index = np.asarray(non.get("index", np.arange(size)), dtype=np.int64)
        group = np.asarray(non.pop("uid", index))
        if "weight_version" not in tensors:
            version = int(data.meta.get("policy_version", 0)) if version is None else version
            tensors["weight_version"] = torch.full_like(tensors["responses"], version, dtype=torch.int64)
        ids = SampleIds(*(np.asarray(non.pop(wire)) if wire in non else None for wire in IDENTITY.values()))
        if ids.sample is None:
            ids.sample = _sample_numbers(group)
        if ids.source is None:
            # A batch built without the dataset's identity columns: its rows are known by their index alone.
            ids.source, ids.key, ids.index = np.full(size, "unknown", dtype=object), index.astype(str), index
        turns = Turns(*(np.asarray(non.pop(w)) for w in TURN_COLUMNS.values())) if "num_turns" in non else None
        meta = dict(data.meta)
        has_old = "old_log_probs" in tensors
        anchor = Anchor(meta.pop("anchor", Anchor.TRAINER.value if has_old else Anchor.CURRENT.value))
        optional = {name: tensors.get(WIRE_NAMES.get(name, name)) for name in OPTIONAL}
        return cls(**{name: tensors[name] for name in SEQUENCE}, ids=ids, group=group,
                   weight_version=tensors["weight_version"], rows=non, turns=turns, anchor=anchor, meta=meta,
                   **optional)

    def to_proto(self) -> DataProto:
        """The batch as a ``DataProto`` with verl's key names (tensors shared, not copied)."""
        tensors = {name: getattr(self, name) for name in SEQUENCE}
        tensors["weight_version"] = self.weight_version
        tensors.update({WIRE_NAMES.get(n, n): getattr(self, n) for n in OPTIONAL if getattr(self, n) is not None})
        non = {**self.rows, "uid": self.group, **{wire: getattr(self.ids, name) for name, wire in IDENTITY.items()},
               **({wire: getattr(self.turns, name) for name, wire in TURN_COLUMNS.items()} if self.turns else {})}
        return DataProto(tensors, non, {**self.meta, "anchor": self.anchor.value}, "train_batch")

    # ------------------------------------------------------------------ rows

    def index(self, idx: torch.Tensor | np.ndarray | list[int]) -> TrainBatch:
        """Rows ``idx`` (positions, not a mask) of every field."""
        rows = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
        picked = torch.as_tensor(rows)
        changes: dict[str, Any] = {"ids": self.ids.rows(rows), "group": self.group[rows],
                                   "rows": {k: v[rows] for k, v in self.rows.items()}, "meta": dict(self.meta),
                                   "turns": self.turns.rows(rows) if self.turns is not None else None,
                                   "reward_extras": {k: np.asarray(v)[rows] for k, v in self.reward_extras.items()},
                                   "texts": [self.texts[i] for i in rows] if self.texts else []}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = value[picked.to(value.device)]
        return dataclasses.replace(self, **changes)

    def split(self, size: int) -> list[TrainBatch]:
        """Consecutive pieces of at most ``size`` rows."""
        return [self.index(np.arange(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def chunk(self, chunks: int) -> list[TrainBatch]:
        """``chunks`` equal consecutive parts (the batch size must divide evenly)."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(f"cannot split a batch of {len(self)} into {chunks} equal chunks")
        return self.split(len(self) // chunks)

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor field on ``device`` (a new batch; the same one's tensors where they are already there)."""
        return dataclasses.replace(self, **{n: v.to(device) for n, v in self.tensors().items()})

    def tensors(self, names: tuple[str, ...] | None = None, device: torch.device | None = None
                ) -> dict[str, torch.Tensor]:
        """The named tensor fields (all that are set when ``names`` is None), on ``device``: a forward's inputs."""
        names = names or tuple(f.name for f in dataclasses.fields(self))
        out = {n: getattr(self, n) for n in names if isinstance(getattr(self, n), torch.Tensor)}
        return {n: v.to(device) for n, v in out.items()} if device is not None else out


def concat(parts: list[TrainBatch], pad_id: int) -> TrainBatch:
    """Stack batches along rows, their response fields right-padded to the widest part (padding is masked)."""
    if len(parts) == 1:
        return parts[0]
    out = TrainBatch.from_proto(DataProto.concat(pad_responses([p.to_proto() for p in parts], pad_id)))
    # Extras every part has (a reward may report one only for some batches) and the texts, in row order.
    out.reward_extras = {k: np.concatenate([np.asarray(p.reward_extras[k]) for p in parts])
                         for k in parts[0].reward_extras if all(k in p.reward_extras for p in parts)}
    out.texts = [t for p in parts for t in p.texts]
    return out


def _sample_numbers(group: np.ndarray) -> np.ndarray:
    """Each row's number within its group of adjacent rows with the same id, ``(batch,)``."""
    out = np.zeros(len(group), dtype=np.int64)
    for i in range(1, len(group)):
        out[i] = out[i - 1] + 1 if group[i] == group[i - 1] else 0
    return out
