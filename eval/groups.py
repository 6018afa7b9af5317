"""``verl eval --group-by COLUMN``: every metric per group of prompts (``extra_info.kind``, ``data_source``, any
column), with its CI, in ``results.json`` (``groups``), the report and the console, as lm-evaluation-harness reports
subtasks.

Computed from ``samples.jsonl``'s rows, which carry every per-sample value and the dataset row (``index``): the
same code groups a fresh evaluation and one reused from disk, and no model runs again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from eval.report import headline_metrics
from eval.results import sample_columns
from verl.evaluators.groups import group_labels, metrics_by_group
from verl.evaluators.stats import Metric

PREFIX = "eval/"


def group_results(samples: list[dict], metrics: Mapping[str, dict], column: str,
                  dataset_rows: Sequence[Mapping[str, Any]], evaluator_for: Callable[[str], Any],
                  n_bootstrap: int, seed: int) -> dict[str, Any]:
    """``results.json``'s ``groups`` block: ``{"by": column, "values": {group: {num_prompts, num_samples,
    metrics: {eval/NAME: metric dict}}}}``. ``evaluator_for(spec)`` builds the evaluator of a corpus metric."""
    labels = group_labels(dataset_rows, column, f"--group-by {column}")
    per_sample = [labels[int(row["index"])] for row in samples]
    columns = sample_columns(samples)
    whole = {name[len(PREFIX):]: Metric.from_dict(meta) for name, meta in metrics.items() if name.startswith(PREFIX)}
    specs = {m.evaluator for m in whole.values() if m.aggregate == "corpus" and m.evaluator}
    evaluators = {spec: evaluator_for(spec) for spec in specs}
    grouped = metrics_by_group(per_sample, whole, columns, [row["response"] for row in samples],
                               np.array([int(row["index"]) for row in samples]), evaluators, n_bootstrap, seed)
    prompts = Counter(label for label, row in zip(per_sample, samples, strict=True) if row.get("sample", 0) == 0)
    samples_per_group = Counter(per_sample)
    return {"by": column, "values": {
        group: {"num_prompts": prompts[group], "num_samples": samples_per_group[group],
                "metrics": {PREFIX + name: metric.to_dict() for name, metric in values.items()}}
        for group, values in grouped.items()}}


def group_lines(groups: dict[str, Any]) -> list[str]:
    """One console line per group: ``two_step (32 prompts): accuracy 0.41 ± 0.17, reward_mean ...``."""
    names = headline_metrics(groups, 3)
    lines = []
    for group, entry in groups["values"].items():
        parts = []
        for name in names:
            metric = entry["metrics"].get(name)
            if metric and metric.get("value") is not None:
                se = metric.get("se")
                parts.append(f"{name[len(PREFIX):]} {metric['value']:.3g}"
                             + (f" ± {1.96 * se:.2g}" if se is not None else ""))
        lines.append(f"  {groups['by']}={group} ({entry['num_prompts']} prompts): {', '.join(parts)}")
    return lines
