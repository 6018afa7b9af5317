"""Metrics per group of prompts (``verl eval --group-by extra_info.kind``, ``data.val_group_by`` in training), as
lm-evaluation-harness reports a task's subtasks: every metric of the whole evaluation, recomputed on each group's
samples with its own CI.

Means are recomputed from their per-sample column (clustered by prompt, as the whole's); corpus metrics (distinct-n,
percentiles, per-token ratios) by the evaluator that made them, on the group's responses and columns. Nothing is
generated or scored again, so a judge or a reward model is not called twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from verl.errors import ConfigError
from verl.evaluators.base import corpus_metrics
from verl.evaluators.stats import Metric, mean_metric

# What `data.val_group_by: auto` groups by, when every validation row has it (the built-in tasks' kinds).
AUTO_GROUP_COLUMN = "extra_info.kind"
MISSING = "(missing)"


def lookup(row: Mapping[str, Any], column: str) -> tuple[bool, Any]:
    """``(found, value)`` of a dotted ``column`` (``extra_info.kind``) in one dataset row."""
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def group_labels(rows: Sequence[Mapping[str, Any]], column: str, where: str) -> list[str]:
    """Each row's group under ``column`` as a string. A column that no row has is an error naming the keys the
    first row does have; rows without it (some have it) form the group ``(missing)``."""
    found = [lookup(row, column) for row in rows]
    if rows and not any(ok for ok, _ in found):
        first = rows[0]
        keys = sorted(first)
        nested = [f"{k}.{sub}" for k in keys if isinstance(first[k], Mapping) for sub in sorted(first[k])]
        raise ConfigError(f"{where}: no row of the data has the column '{column}'; row 0 has "
                          f"{', '.join(keys + nested) or 'no columns'} (a dotted path reads inside a dict column, "
                          "e.g. extra_info.kind)")
    return [label(value) if ok else MISSING for ok, value in found]


def label(value: Any) -> str:
    """A group value as a label: whole floats without their ".0" (a parquet int column read as float), else str()."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def has_column(rows: Sequence[Mapping[str, Any]], column: str) -> bool:
    """Whether every row has ``column`` (what ``auto`` grouping asks before it groups)."""
    return bool(rows) and all(lookup(row, column)[0] for row in rows)


def metrics_by_group(groups: Sequence[str], metrics: Mapping[str, Metric], columns: Mapping[str, np.ndarray],
                     responses: Sequence[str], prompt_index: np.ndarray, evaluators: Mapping[str, Any],
                     n_bootstrap: int, seed: int) -> dict[str, dict[str, Metric]]:
    """``{group: {metric: Metric}}`` for every metric of ``metrics`` on each group's samples.

    ``groups``, ``responses`` and ``prompt_index`` are per sample ``(N,)``; ``columns`` the per-sample values the
    evaluators produced (``(N,)`` each); ``evaluators`` maps an evaluator's spec to the evaluator, for corpus
    metrics. A metric whose column or evaluator is not at hand (a plug-in's plain number) is left out of the groups.
    """
    groups = np.asarray(list(groups), dtype=object)
    if len(groups) != len(responses):
        raise ValueError(f"{len(groups)} group labels for {len(responses)} samples")
    index = np.asarray(prompt_index)
    out: dict[str, dict[str, Metric]] = {}
    for group in sorted(set(groups.tolist()), key=_natural):
        rows = np.flatnonzero(groups == group)
        sub_columns = {name: np.asarray(values, dtype=np.float64)[rows] for name, values in columns.items()}
        sub_responses = [responses[i] for i in rows]
        per_group: dict[str, Metric] = {}
        corpus_done: dict[str, dict[str, Metric]] = {}
        for name, metric in metrics.items():
            if metric.aggregate == "mean" and metric.column in sub_columns:
                per_group[name] = mean_metric(sub_columns[metric.column], index[rows], aggregate="mean",
                                              column=metric.column, binary=metric.binary,
                                              higher_is_better=metric.higher_is_better, evaluator=metric.evaluator)
            elif metric.aggregate == "corpus" and metric.evaluator in evaluators:
                if metric.evaluator not in corpus_done:
                    corpus_done[metric.evaluator] = corpus_metrics(evaluators[metric.evaluator], sub_responses,
                                                                   sub_columns, index[rows], n_bootstrap, seed)
                if name in corpus_done[metric.evaluator]:
                    per_group[name] = corpus_done[metric.evaluator][name]
        out[group] = per_group
    return out


def _natural(text: str) -> tuple:
    """Sort ``2`` before ``10`` and the ``(missing)`` group last."""
    return (text == MISSING, 0, int(text), "") if text.lstrip("-").isdigit() else (text == MISSING, 1, 0, text)


def metric_key_part(group: str) -> str:
    """A group label as one part of a logged metric name (``eval/kind/two_step/accuracy``): no slashes or spaces."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in group) or "_"
