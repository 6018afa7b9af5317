"""Training samples from a gateway's recorded calls (docs/architecture.md §18), token-exact.

An agent that is not our loop calls the service's OpenAI API; each of its calls marked as training traffic (the
training key and an episode id) is one record row with ``prompt_ids`` (the prompt as the service rendered it),
``token_ids`` and ``logprobs`` (what the engine sampled) and ``weight_version`` (verl.data.records.OnlineRecord).
This module turns one episode's rows into the agent loop's ``Trajectory`` rows without decoding or re-tokenizing
anything:

- a call whose prompt **extends** an open sample (that sample's prompt + its ids so far) continues it: the ids the
  prompt adds (the template's end of the answer, tool results, the user's next turn) are context (mask 0), then
  the call's sampled ids are actions (mask 1, their recorded log-probs) — one multi-turn sample, as verl's
  AgentLoop builds it;
- a call that extends none starts a **new sample** of the same episode (the agent rewrote or summarised its
  history, or started over), and every sample of the episode shares the episode's reward (AReaL's and verl's
  answer to the same problem). Two reasons are told apart and counted: ``rewritten`` (the prompt departs from every
  sample before its last answer: the agent changed its history) and ``rerendered`` (the prompt keeps a sample's
  history but renders its last answer with ids other than those sampled: a template or a client that re-encodes
  text). A re-rendering is never stitched into the sample it departs from; ``first_difference`` says where the
  first one differs, so the cause can be found.

A call that failed (its row's ``error``) fails the episode: its samples are kept for the counts but masked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto, pad_tokens
from verl.rollout.agent_loop import Trajectory, assemble_trajectories


@dataclass
class EpisodeSamples:
    """One episode's calls as training samples: ``trajectories`` (the agent loop's rows, ``ids`` / ``mask`` /
    ``log_probs`` after each sample's first prompt) with ``versions`` (per sample, the weight version of each id)."""

    episode: str
    trajectories: list[Trajectory] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    calls: int = 0
    extended: int = 0  # calls that continued an open sample
    rewritten: int = 0  # calls that started a sample because the agent's history changed
    rerendered: int = 0  # calls whose prompt rendered an earlier answer with other ids than those sampled
    first_difference: dict[str, Any] | None = None  # the first re-rendering: call id, position, both ids
    error: str | None = None  # the first failed call's error: the episode is masked


def episode_rows(rows: Iterable[dict]) -> dict[str, list[dict]]:
    """Request rows that carry training ids, by episode, each episode's in the order its calls arrived."""
    episodes: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("kind", "request") == "request" and row.get("episode") is not None and row.get("prompt_ids"):
            episodes.setdefault(row["episode"], []).append(row)
    for calls in episodes.values():
        calls.sort(key=lambda r: (r.get("arrival") or r["time"], r["time"], r.get("index", 0)))
    return episodes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _Open:
    """A sample being built: its trajectory, each id's version, and where its last answer starts in ``full``."""

    def __init__(self, row: dict):
        self.row = Trajectory(prompt_ids=list(row["prompt_ids"]), tools=[], hidden_kwargs={}, generator=None)
        self.versions: list[int] = []
        self.answer_start = len(self.row.prompt_ids)
        self.call_id = row.get("id")

    @property
    def full(self) -> list[int]:
        return self.row.prompt_ids + self.row.ids

    def add_call(self, row: dict, context: list[int]) -> None:
        """Append ``context`` (ids the prompt adds, mask 0), then the call's sampled ids with their log-probs."""
        version = int(row.get("weight_version") or 0)
        for token in context:
            self.row.append(int(token), generated=False)
        self.answer_start = len(self.row.prompt_ids) + len(self.row.ids)
        ids, logprobs = row.get("token_ids") or [], row.get("logprobs") or []
        if len(ids) != len(logprobs):
            raise ValueError(f"record {row.get('id')}: {len(ids)} token_ids but {len(logprobs)} logprobs")
        for token, log_prob in zip(ids, logprobs, strict=True):
            self.row.append(int(token), generated=True, log_prob=float(log_prob))
        per_token = row.get("weight_versions")  # an in-place update mid-answer: each id's own version
        if per_token is not None and len(per_token) != len(ids):
            raise ValueError(f"record {row.get('id')}: {len(ids)} token_ids but {len(per_token)} weight_versions")
        self.versions.extend([version] * len(context) + ([int(v) for v in per_token] if per_token is not None
                                                          else [version] * len(ids)))
        self.row.turns += 1
        self.row.calls += len(row.get("tool_calls") or [])
        self.row.valid_calls = self.row.calls
        self.row.finish = row.get("finish_reason") or "stop"
        self.call_id = row.get("id")


def episode_samples(episode: str, calls: list[dict]) -> EpisodeSamples:
    """The samples of one episode's calls, in arrival order (see the module docstring)."""
    out = EpisodeSamples(episode)
    open_samples: list[_Open] = []
    for row in calls:
        out.calls += 1
        if row.get("error") and out.error is None:
            out.error = f"call {row.get('id')}: {row['error']}"[:500]
        prompt = list(row["prompt_ids"])
        extends = [s for s in open_samples if len(s.full) <= len(prompt) and prompt[:len(s.full)] == s.full]
        if extends:
            sample = max(extends, key=lambda s: len(s.full))
            sample.add_call(row, prompt[len(sample.full):])
            out.extended += 1
            continue
        if open_samples:  # a new sample: say why
            nearest = max(open_samples, key=lambda s: _common_prefix(s.full, prompt))
            full = nearest.full
            common = _common_prefix(full, prompt)
            if nearest.answer_start <= common < min(len(full), len(prompt)):
                out.rerendered += 1
                if out.first_difference is None:
                    out.first_difference = {"call": row.get("id"), "answer_of": nearest.call_id,
                                            "position": common - nearest.answer_start,
                                            "sampled": full[common], "rendered": prompt[common]}
            else:
                out.rewritten += 1
        sample = _Open(row)
        sample.add_call(row, [])
        open_samples.append(sample)
    for sample in open_samples:
        if out.error is not None:
            sample.row.env_error = out.error
        out.trajectories.append(sample.row)
        out.versions.append(sample.versions)
    return out


def samples_batch(episodes: list[EpisodeSamples], pad_id: int,
                  row_fields: list[dict[str, Any]] | None = None) -> DataProto:
    """Every episode's samples as one rollout batch (``assemble_trajectories``'s tensors, prompts left-padded,
    ``rollout_log_probs`` the recorded log-probs, ``weight_version`` (rows, response_len) per id); ``episode`` and
    ``sample`` (its number within the episode) as non-tensor fields, so rewards and groups map back.
    ``row_fields``: per episode, non-tensor fields each of its samples carries (the dataset row's ground truth,
    data source and index: what the reward and the advantage groups read)."""
    rows = [t for e in episodes for t in e.trajectories]
    if not rows:
        raise ValueError("no samples: the episodes recorded no training calls")
    input_ids, attention_mask = pad_tokens([t.prompt_ids for t in rows], pad_id, left=True)
    non_tensors: dict[str, Any] = {
        "episode": np.array([e.episode for e in episodes for _ in e.trajectories], dtype=object),
        "sample": np.array([i for e in episodes for i in range(len(e.trajectories))], dtype=np.int64)}
    for key in (row_fields[0] if row_fields else {}):
        values = [fields[key] for e, fields in zip(episodes, row_fields, strict=True) for _ in e.trajectories]
        numbers = all(isinstance(v, int | float | np.number) for v in values)
        non_tensors[key] = np.asarray(values) if numbers else _objects(values)
    prompts = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask},
                                  non_tensors=non_tensors)
    batch = assemble_trajectories(prompts, rows, 1, pad_id, log_probs=True)
    width = batch.batch["responses"].shape[1]
    versions = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, v in enumerate(v for e in episodes for v in e.versions):
        versions[i, :len(v)] = torch.tensor(v, dtype=torch.int64)
    batch.batch["weight_version"] = versions
    return batch


def episode_last_rows(episodes: np.ndarray) -> np.ndarray:
    """For each row of a batch (``episodes`` its episode ids, ``(batch,)``, an episode's samples adjacent and in the
    order they were started), the row of its episode's last sample: the one that holds the final answer."""
    last: dict[Any, int] = {}
    for row, episode in enumerate(episodes.tolist()):
        last[episode] = row
    return np.array([last[e] for e in episodes.tolist()], dtype=np.int64)


def _objects(values: list[Any]) -> np.ndarray:
    """An object array of ``values`` one per row, even where each value is itself a list or a dict."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # one by one: a slice assignment would broadcast lists of equal length
        out[i] = value
    return out
