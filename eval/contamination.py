"""The contamination check of ``verl eval`` (docs/architecture.md §14): the evaluation prompts against the run's
training data
(``verl.data.contamination``: exact after normalisation, or a shared word 13-gram), the count in ``results.json``
and the report, every metric recomputed on the clean prompts beside the whole, and ``--strict`` refusing."""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.data.contamination import NGRAM, TrainingIndex, prompts_of, summary
from verl.errors import ConfigError


def check(rows: list[dict], prompt_key: str, train_files: list[str], train_prompt_key: str, strict: bool
          ) -> tuple[list[str | None], dict]:
    """Per evaluation row: how it overlaps the training data (or None), and the summary."""
    index = TrainingIndex.of(prompts_of(train_files, train_prompt_key))
    kinds = index.overlaps_rows(rows, prompt_key)
    info = summary(kinds, train_files, index.n)
    if strict and info["overlapping"]:
        raise ConfigError(f"--strict: {info['overlapping']} of {info['checked']} evaluation prompts overlap the run's "
                          f"training data ({info['exact']} exactly, {info['ngram']} by a shared {index.n}-gram; "
                          f"{', '.join(train_files)}); remove them from the training data with `verl data "
                          "decontaminate`, or evaluate on other prompts")
    return kinds, info


def clean_metrics(samples: list[dict], metrics: dict[str, dict]) -> dict[str, dict]:
    """Each per-sample mean metric over the samples whose prompt is clean: ``{name: {value, n}}``."""
    clean = [row for row in samples if not row.get("contaminated")]
    out = {}
    for name, meta in metrics.items():
        if meta.get("aggregate", "mean") != "mean":
            continue
        column = meta.get("column") or name.split("/", 1)[-1]
        values = [row[column] for row in clean if isinstance(row.get(column), (int, float))
                  and not isinstance(row.get(column), bool)]
        if values or not clean:
            out[name] = {"value": float(np.mean(values)) if values else None, "n": len(values)}
    return out


def of_samples(samples: list[dict], metrics: dict[str, dict], run_cfg: Any, strict: bool) -> dict[str, Any]:
    """The results' entry for rows another tool generated (lm-eval, Inspect): each row's ``prompt`` against the
    run's training prompts (``run_cfg``; None: not checked), each row marked ``contaminated``, and the clean
    metrics."""
    if run_cfg is None or not run_cfg.data.train_files:
        return not_checked("no training data is known for this checkpoint")
    kinds, info = check(samples, "prompt", list(run_cfg.data.train_files), run_cfg.data.prompt_key, strict)
    for row, kind in zip(samples, kinds, strict=True):
        row["contaminated"] = kind
    return {**info, "clean": clean_metrics(samples, metrics)}


def not_checked(reason: str) -> dict[str, Any]:
    """The results' entry when nothing could be checked (no run, or a run without training files)."""
    return {"checked": 0, "overlapping": 0, "exact": 0, "ngram": 0, "n": NGRAM, "against": [], "clean": {},
            "not_checked": reason}


def line(info: dict[str, Any]) -> str:
    """The report's sentence."""
    if info.get("not_checked"):
        return f"Contamination: not checked ({info['not_checked']})."
    text = (f"Contamination: {info['overlapping']} of {info['checked']} prompts overlap the training data "
            f"({info['exact']} exactly, {info['ngram']} by a shared {info['n']}-gram; checked against "
            f"{', '.join(f'`{f}`' for f in info['against'])}).")
    if info["overlapping"]:
        text += " Every metric on the clean prompts alone, beside the whole:"
    return text
