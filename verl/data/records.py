"""The rows a service records per request (the online A/B report, ``verl ship``'s canary and training data read
them): which model answered which request, for whom, under which config version, how fast, how many tokens,
whether it failed, and its reward.

Two kinds of rows, both JSON objects:

- a **request** row (``kind: "request"``) per finished sequence: the completion ``id`` the client saw and the
  choice ``index``, the routed ``user`` (a hash, never the raw id), ``arrival`` and finish ``time``, the
  ``config_version`` and the answering model's ``route_share`` when it was routed, latencies, tokens, the finish
  reason, an ``error`` (an engine failure, a request refused at capacity, a timeout), ``reward_expected`` (the
  request asked for a reward), its ``reward``, ``reward_source`` and ``scorer_version`` when one was scored at once,
  ``not_for_training`` (the client's ``verl.not_for_training`` or the service's setting: never exported for
  training), and — only where the service keeps texts (``record_texts``, off by default) — the ``prompt`` as sent
  (chat messages, or the completion prompt) and the ``answer``;
- a **reward** row (``kind: "reward"``) for a reward that arrives later (a checker run afterwards, a judge, a reward
  model, a user's feedback), joined to its request row by ``(id, index)``, with its
  ``reward_source`` and ``scorer_version``. ``join_rewards`` folds them in, one source at a time.

``verl serve`` writes them; ``verl data from-records``, ``verl compare --online``, the canary and
the load test's replay read them through this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from verl.errors import ConfigError, VerlError

ADMIN_KEY_ENV = "VERL_SERVE_ADMIN_API_KEY"  # the service's admin key (serve.settings admin_api_key)


@dataclass
class OnlineRecord:
    """One finished sequence (a request with ``n`` > 1 gives ``n`` rows)."""

    time: float  # when it finished (wall clock)
    model: str
    route: str | None
    prompt_id: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float
    finish_reason: str
    error: str | None = None
    reward: float | None = None
    replica: str | None = None  # verl serve --replicas: which replica answered
    run: str | None = None  # lineage of the weights that answered (serve.lineage)
    step: int | None = None
    weights: str | None = None
    shadow: bool = False  # a mirrored request: answered by this model, recorded, never returned to the client
    kind: str = "request"
    id: str | None = None  # the completion id the client saw (a mirror carries its original's)
    index: int = 0  # the choice index within the completion
    choices: int = 1  # the completion's choices (prompts x n): the rows its one routing draw gave
    user: str | None = None  # the routed user, hashed (user_hash)
    arrival: float | None = None  # when the request arrived (wall clock)
    config_version: int | None = None  # the service's models-and-routes version it was routed under
    route_share: float | None = None  # the answering model's share of the route then
    reward_expected: bool = False  # the request asked for a reward (the `verl` field)
    reward_source: str | None = None  # e.g. "rule:arithmetic"
    scorer_version: str | None = None  # the version of what scored it (a rule: verl's version)
    not_for_training: bool = False  # the client or the service said: never export this for training
    prompt: Any = None  # record_texts only: the chat messages or the completion prompt, as sent
    answer: str | None = None  # record_texts only: the generated text
    texts_truncated: bool = False  # record_texts: the prompt or answer was cut at record_texts_max_chars
    # Training traffic only (serve's training_api_key and an episode id): what a trainer learns from, token-exact.
    episode: str | None = None  # the episode id (X-Session-ID or verl.episode_id)
    prompt_ids: list[int] | None = None  # the prompt's ids as rendered (the chat template applied)
    token_ids: list[int] | None = None  # the sampled ids (the stop token included)
    logprobs: list[float] | None = None  # each sampled id's log-prob, the engine's own (raw, before temperature)
    weight_version: int | None = None  # the served weights' version that sampled the ids (the first one's)
    weight_versions: list[int] | None = None  # per sampled id, only when an in-place update came mid-answer
    tool_calls: list[dict] | None = None  # the tool calls parsed from the answer (chat with tools)


def user_hash(user: str | None) -> str | None:
    """The recorded form of a user id: enough to tell users apart, not to recover them."""
    return None if user is None else hashlib.sha256(f"verl-user\0{user}".encode()).hexdigest()[:16]


def reward_row(completion_id: str, index: int, reward: float, source: str, model: str | None = None,
               route: str | None = None, shadow: bool = False, at: float | None = None,
               scorer_version: str | None = None, **extra: Any) -> dict:
    """A reward that arrived after its request (see the module docstring); ``extra`` adds fields (feedback's
    ``comment`` and ``feedback_source``, the answering model's lineage)."""
    return {"kind": "reward", "time": time.time() if at is None else at, "id": completion_id, "index": index,
            "reward": float(reward), "reward_source": source, "scorer_version": scorer_version, "model": model,
            "route": route, "shadow": shadow, **extra}


def source_matches(recorded: str | None, wanted: str | None) -> bool:
    """Whether a row's ``reward_source`` is the ``wanted`` one: equal, or ``wanted`` names its family (``rule``
    matches ``rule:arithmetic``, ``rm`` any reward model); ``wanted`` None matches any source."""
    if wanted is None:
        return True
    return recorded is not None and (recorded == wanted or recorded.startswith(wanted + ":"))


def join_rewards(rows: list[dict], source: str | None = None) -> list[dict]:
    """Request rows with their reward from ``source`` (``source_matches``; None: any): the request's own when it
    matches, else the latest reward row that does, per ``(id, index, shadow)``. With a ``source``, a request row
    whose own reward is another source's carries none — sources are never mixed. Reward rows whose request is not
    among ``rows`` are dropped."""
    late = {(r.get("id"), r.get("index", 0), bool(r.get("shadow"))): r for r in rows
            if r.get("kind") == "reward" and source_matches(r.get("reward_source"), source)}
    out = []
    for row in rows:
        if row.get("kind", "request") != "request":
            continue
        if row.get("reward") is not None and not source_matches(row.get("reward_source"), source):
            row = {**row, "reward": None, "reward_source": None}
        extra = late.get((row.get("id"), row.get("index", 0), bool(row.get("shadow"))))
        if extra is not None and row.get("id") is not None and row.get("reward") is None:
            row = {**row, "reward": extra["reward"], "reward_source": extra.get("reward_source")}
        out.append(row)
    return out


def load_records(source: str, admin_key: str | None = None) -> list[dict]:
    """Rows from ``source``: a service URL (its ``/admin/records``) or a JSONL file the service appended to."""
    if source.startswith(("http://", "https://")):
        key = admin_key or os.environ.get(ADMIN_KEY_ENV)
        if not key:
            raise ConfigError(f"reading records from {source} needs the admin key: --admin-key or {ADMIN_KEY_ENV}")
        try:
            response = httpx.get(source.rstrip("/") + "/admin/records", timeout=60,
                                 headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:
            raise VerlError(f"cannot reach {source}: {exc}") from None
        if response.status_code != 200:
            raise VerlError(f"{source}/admin/records answered {response.status_code}: {response.text[:200]} (the "
                            "service needs admin_api_key set, and the same key here)")
        return response.json()["records"]
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{source}: neither a service URL (http://...) nor a records file")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}, line {number}: not JSON (a records file has one JSON object per line)") \
                from None
        if isinstance(row, dict) and row.get("kind") == "reward" and "id" in row and "reward" in row:
            rows.append(row)
            continue
        if not isinstance(row, dict) or "model" not in row or "e2e_s" not in row:
            raise ConfigError(f"{path}, line {number}: not a service record (needs 'model' and 'e2e_s', or a reward "
                              "row: kind 'reward' with 'id' and 'reward')")
        rows.append(row)
    return rows
