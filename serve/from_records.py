"""``verl data from-records``: a service's online records into the trainer's parquet files (docs/architecture.md §14).

Input: records files (``records_path``), or running services (their ``/admin/records``: a fleet's is the merged log
of every replica). Only request rows that carry their texts (the service's ``record_texts``) can become training
data. The steps, each counted in ``summary.json`` with the reason a row went where it went:

1. **never for training**: rows the client or the service marked ``not_for_training``; then failed requests
   (an error, or aborted), rows without texts, prompts of the other kind (chat messages by default, or completion
   prompts: one file holds one kind), and rows the filters leave out (route, model, time window);
2. **rewards**: late reward rows (feedback, a reward model, a judge) are joined to their requests by completion id,
   one ``reward_source`` only (``verl.data.records.join_rewards``: sources are never mixed); prompts left with fewer
   than ``min_rewards`` rewarded answers (after step 4) are dropped;
3. **duplicates**: prompts equal after normalisation (case, whitespace) are one prompt (their answers pooled); then
   near duplicates — MinHash of character 5-grams, Jaccard ≥ ``near_dup_threshold`` found by LSH (``datasketch``) —
   keep the earliest;
4. **a split by user**: each user is drawn to one side (a seeded hash, ``val_fraction`` of the users); a prompt
   goes to the side of its earliest asker and the other side's answers to it are dropped (counted): no user and no
   prompt is in both files.

Output (written to a temporary directory, then renamed): ``train.parquet`` / ``val.parquet`` in the trainer's
format — ``prompt`` (the chat messages as sent, or the completion prompt), ``data_source: records``, and in
``extra_info`` the recorded rewards, their source, the answering models, their lineage (run, step, weights) and the
completion ids; ``pairs/train.parquet`` / ``pairs/val.parquet`` for ``verl rm`` where a prompt got two answers with
different rewards (chosen: the best-rewarded, rejected: the worst); ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from verl.data.exports import SUMMARY_FILE
from verl.data.records import join_rewards, load_records
from verl.errors import ConfigError
from verl.utils.fs import atomic_dir, atomic_write_json

DATA_SOURCE = "records"
SHINGLE = 5  # characters per shingle for near-duplicate detection (prompts are short: words would be too coarse)
NUM_PERM = 64  # MinHash permutations: Jaccard estimated to about ±0.06 at 0.8
# Why a record did not become training data, in the order the steps apply (summary.json counts each).
DROP_REASONS = ("not_for_training", "failed", "no_text", "other_prompt_kind", "filtered_route", "filtered_model",
                "filtered_time", "near_duplicates", "answers_of_the_other_split", "too_few_rewards")


@dataclass
class RecordFilters:
    """Which records may become training data (None: any)."""

    routes: list[str] | None = None
    models: list[str] | None = None
    since: float | None = None
    until: float | None = None
    reward_source: str | None = None
    min_rewards: int = 1
    # One file holds one kind (the trainer templates chat messages, not a completion prompt): chat or completion.
    prompts: str = "chat"


@dataclass
class PromptGroup:
    """Every recorded answer to one (normalised) prompt."""

    key: str
    prompt: Any
    text: str  # the prompt's text, for near-duplicate detection
    answers: list[dict] = field(default_factory=list)

    @property
    def rewarded(self) -> list[dict]:
        return [a for a in self.answers if a.get("reward") is not None]

    @property
    def first_time(self) -> float:
        return min(float(a.get("time") or 0.0) for a in self.answers)


def prompt_text(prompt: Any) -> str:
    """The words of a recorded prompt: chat messages' contents joined, or the completion prompt."""
    if is_chat(prompt):
        return "\n".join(str(m.get("content") or "") for m in prompt)
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def is_chat(prompt: Any) -> bool:
    """Chat messages (``/v1/chat/completions``), not a completion prompt (``/v1/completions``)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)


def normalise(text: str) -> str:
    """Lower case, runs of whitespace as one space, stripped: what "the same prompt" means here."""
    return re.sub(r"\s+", " ", text).strip().lower()


def _keep(row: dict, filters: RecordFilters, counts: dict[str, int]) -> bool:
    """Whether a request row may be exported; counts why not."""
    reasons = (
        ("not_for_training", bool(row.get("not_for_training"))),
        ("failed", row.get("error") is not None or row.get("finish_reason") == "abort"),
        ("no_text", row.get("prompt") is None or row.get("answer") is None),
        ("other_prompt_kind", is_chat(row.get("prompt")) != (filters.prompts == "chat")),
        ("filtered_route", filters.routes is not None and row.get("route") not in filters.routes),
        ("filtered_model", filters.models is not None and row.get("model") not in filters.models),
        ("filtered_time", (filters.since is not None and float(row.get("time") or 0) < filters.since)
         or (filters.until is not None and float(row.get("time") or 0) > filters.until)),
    )
    for reason, hit in reasons:
        if hit:
            counts[reason] += 1
            return False
    return True


def pick_source(rows: list[dict], wanted: str | None) -> str | None:
    """The one reward source to export: ``wanted``, or the only one the records hold (several: an error)."""
    if wanted is not None:
        return wanted
    sources = sorted({r["reward_source"] for r in rows if r.get("reward_source") and r.get("reward") is not None})
    if len(sources) > 1:
        raise ConfigError(f"the records hold rewards from {len(sources)} sources ({', '.join(sources)}); they are not "
                          "comparable: pick one with --reward-source (rule, feedback, rm:NAME, judge:NAME)")
    return sources[0] if sources else None


def group_prompts(rows: list[dict]) -> list[PromptGroup]:
    """Requests by normalised prompt (exact duplicates pooled), earliest first."""
    groups: dict[str, PromptGroup] = {}
    for row in rows:
        text = prompt_text(row["prompt"])
        key = hashlib.sha1(normalise(text).encode()).hexdigest()
        group = groups.get(key)
        if group is None:
            group = groups[key] = PromptGroup(key, row["prompt"], text)
        group.answers.append(row)
    return sorted(groups.values(), key=lambda g: g.first_time)


def near_duplicates(groups: list[PromptGroup], threshold: float) -> set[str]:
    """Keys of the groups that are near duplicates of an earlier one (MinHash LSH over character shingles)."""
    if threshold >= 1.0 or len(groups) < 2:
        return set()
    from datasketch import MinHash, MinHashLSH  # noqa: PLC0415  (a dependency of this command only)

    def shingles(text: str) -> list[bytes]:
        text = normalise(text)
        return [text[i:i + SHINGLE].encode() for i in range(max(1, len(text) - SHINGLE + 1))]

    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    hashes = MinHash.bulk([shingles(g.text) for g in groups], num_perm=NUM_PERM)
    dropped: set[str] = set()
    for group, minhash in zip(groups, hashes, strict=True):  # earliest first: the first of a cluster stays
        if lsh.query(minhash):
            dropped.add(group.key)
        else:
            lsh.insert(group.key, minhash)
    return dropped


def split_by_user(groups: list[PromptGroup], val_fraction: float, seed: int) -> tuple[list, list, int]:
    """(train, val, answers dropped): each user is drawn to one side (a seeded hash); a prompt goes to the side of
    its earliest asker, and answers to it from users of the other side are dropped — so no user and no prompt is in
    both files. A request without a user is a user of its own."""

    def side(answer: dict) -> bool:  # True: validation
        user = answer.get("user") or f"anon:{answer.get('id')}"
        return int(hashlib.sha256(f"{seed}\0{user}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < val_fraction

    train, val, dropped = [], [], 0
    for group in groups:
        first = min(group.answers, key=lambda a: float(a.get("time") or 0.0))
        to_val = side(first)
        kept = [a for a in group.answers if side(a) == to_val]
        dropped += len(group.answers) - len(kept)
        group.answers = kept
        (val if to_val else train).append(group)
    return train, val, dropped


def stored_prompt(prompt: Any) -> Any:
    """A prompt as the trainer reads it: chat messages as ``{role, content}`` (content as text), or the completion
    prompt's text."""
    if is_chat(prompt):
        return [{"role": str(m.get("role") or "user"), "content": m.get("content") if isinstance(m.get("content"), str)
                 else json.dumps(m.get("content") or "")} for m in prompt]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def training_rows(groups: list[PromptGroup], source: str | None) -> list[dict]:
    """The trainer's rows: the prompt, and what was recorded about its answers in ``extra_info``."""
    out = []
    for group in groups:
        rewarded = group.rewarded
        first = group.answers[0]
        out.append({
            "prompt": stored_prompt(group.prompt),
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "model", "ground_truth": None},  # none: a rule reward refuses these rows
            "extra_info": {"rewards": [float(a["reward"]) for a in rewarded], "reward_source": source or "",
                           "models": sorted({str(a.get("model")) for a in group.answers}),
                           "lineage": json.dumps({k: first.get(k) for k in ("run", "step", "weights")}),
                           "completion_ids": [str(a.get("id")) for a in group.answers], "answers": len(group.answers),
                           "users": len({a.get("user") for a in group.answers if a.get("user")}),
                           "first_time": group.first_time},
        })
    return out


def pair_rows(groups: list[PromptGroup], source: str | None) -> list[dict]:
    """Preference pairs (TRL's prompt / chosen / rejected) where two answers to a prompt got different rewards."""
    out = []
    for group in groups:
        rewarded = sorted(group.rewarded, key=lambda a: float(a["reward"]))
        if len(rewarded) < 2 or float(rewarded[0]["reward"]) == float(rewarded[-1]["reward"]):
            continue
        best, worst = rewarded[-1], rewarded[0]
        out.append({"prompt": stored_prompt(group.prompt), "chosen": best["answer"], "rejected": worst["answer"],
                    "extra_info": {"chosen_score": float(best["reward"]), "rejected_score": float(worst["reward"]),
                                   "reward_source": source or "", "chosen_id": str(best.get("id")),
                                   "rejected_id": str(worst.get("id"))}})
    return out


def export_records(sources: list[str], out: str | Path, filters: RecordFilters | None = None, val_fraction: float = 0.1,
                   near_dup_threshold: float = 0.8, seed: int = 0, admin_key: str | None = None) -> dict:
    """Records of ``sources`` into training files under ``out``; returns the summary (also ``summary.json``)."""
    filters = filters or RecordFilters()
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {val_fraction} must lie in [0, 1)")
    if filters.prompts not in ("chat", "completion"):
        raise ConfigError(f"--prompts {filters.prompts!r} must be chat or completion")
    if filters.min_rewards < 0:
        raise ConfigError(f"--min-rewards {filters.min_rewards} must be >= 0")
    rows = [row for source in sources for row in load_records(source, admin_key)]
    source = pick_source(rows, filters.reward_source)
    counts: dict[str, int] = defaultdict(int)
    requests = join_rewards(rows, source)
    counts["requests"] = len(requests)
    kept = [r for r in requests if _keep(r, filters, counts)]
    groups = group_prompts(kept)
    counts["prompts"] = len(groups)
    counts["exact_duplicates"] = len(kept) - len(groups)  # requests pooled into an earlier one's prompt
    near = near_duplicates(groups, near_dup_threshold)
    counts["near_duplicates"] = len(near)
    groups = [g for g in groups if g.key not in near]
    train, val, counts["answers_of_the_other_split"] = split_by_user(groups, val_fraction, seed)
    if filters.min_rewards:
        counts["too_few_rewards"] = sum(len(g.rewarded) < filters.min_rewards for g in train + val)
        train = [g for g in train if len(g.rewarded) >= filters.min_rewards]
        val = [g for g in val if len(g.rewarded) >= filters.min_rewards]
    files = {"train.parquet": training_rows(train, source), "val.parquet": training_rows(val, source),
             "pairs/train.parquet": pair_rows(train, source), "pairs/val.parquet": pair_rows(val, source)}
    times = [float(r.get("time") or 0) for r in kept]
    summary = {"sources": sources, "reward_source": source,
               "filters": {k: v for k, v in vars(filters).items() if v is not None},
               "time_window": [min(times), max(times)] if times else None, "counts": dict(counts),
               "written": {name: len(rows_) for name, rows_ in files.items()},
               "models": sorted({str(r.get("model")) for r in kept}), "val_fraction": val_fraction,
               "near_dup_threshold": near_dup_threshold, "seed": seed}
    with atomic_dir(Path(out), overwrite=True) as tmp:
        for name, rows_ in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if rows_:
                pq.write_table(pa.Table.from_pylist(rows_), path)
        atomic_write_json(tmp / SUMMARY_FILE, summary)
    return summary


def summary_line(summary: dict) -> str:
    """One line saying which records went where (the command's output)."""
    c, w = summary["counts"], summary["written"]
    dropped = ", ".join(f"{c[k]} {k.replace('_', ' ')}" for k in DROP_REASONS if c.get(k))
    return (f"{c['requests']} requests -> {c['prompts']} prompts ({c.get('exact_duplicates', 0)} exact duplicates "
            f"pooled); dropped: {dropped or 'none'}; wrote {w['train.parquet']} train / {w['val.parquet']} val "
            f"prompts, {w['pairs/train.parquet']} / {w['pairs/val.parquet']} pairs; rewards: "
            f"{summary['reward_source'] or 'none recorded'}")

