"""``verl eval`` on a reward model (a ``verl rm`` checkpoint or run, or an exported reward model).

A reward model does not generate, so it is not evaluated as a policy is: it scores both sides of held-out
preference pairs (the run's ``data.val_files`` unless ``--data``) and the evaluation reports

- ``eval/pairwise_accuracy``: the share of pairs with r(chosen) > r(rejected) (a tie counts as wrong, as in
  training, so it equals the run's own ``eval/pairwise_accuracy`` on the same pairs),
- ``eval/margin``: mean r(chosen) − r(rejected); ``eval/loss``: the Bradley–Terry NLL −log σ(margin);
- ``eval/reward_chosen`` / ``eval/reward_rejected``: the mean scores of each side,

each with its standard error and 95% CI over pairs. ``samples.jsonl`` holds one row per pair; its ``prompt_id`` is a
hash of the pair's texts, so two reward models (even with different tokenizers) pair up in ``verl compare``
(McNemar on pairwise accuracy, paired bootstrap on the margin). Results go where a policy's go
(``<run>/eval/<checkpoint>/``; other data under ``<run>/eval/<tag>/``) and are reused while the weights and the data
are unchanged; on a run every checkpoint is scored and the best by pairwise accuracy written to ``best.json``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn.functional as F

from eval.report import write_pair_report, write_run_report
from eval.results import (
    DEFAULT_SELECT,
    METRIC_PREFIX,
    SCHEMA,
    model_hash,
    parse_select,
    reusable_results,
    versions,
    write_results,
    write_run_summary,
)
from verl.batch import content_ids
from verl.config import RMConfig, build_config, load_yaml
from verl.errors import CheckpointError, ConfigError
from verl.evaluators.stats import mean_metric
from verl.models.loader import load_tokenizer, pick_device
from verl.trainer.checkpoint import list_checkpoints
from verl.trainer.rm import VALIDATION_METRIC, PairData, load_reward_model, score_pairs
from verl.utils.seeding import set_num_threads

KIND = "reward_model"
# Per pair: metric -> (samples.jsonl column, higher is better, a 0/1 outcome).
PAIR_METRICS: dict[str, tuple[str, bool | None, bool]] = {"pairwise_accuracy": ("correct", True, True),
                                                          "margin": ("margin", True, False),
                                                          "loss": ("loss", False, False),
                                                          "reward_chosen": ("reward_chosen", None, False),
                                                          "reward_rejected": ("reward_rejected", None, False)}
# What a policy's evaluation samples and a reward model has no use for: given, they are refused, not ignored.
POLICY_ONLY = {"evaluators": "-e", "n": "--n", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
               "max_new_tokens": "--max-new-tokens", "reference": "--reference", "tools": "--tools",
               "tool_config": "--tool-config", "max_turns": "--max-turns", "max_prompt_length": "--max-prompt-length"}


def check_settings(settings: Any, what: str) -> None:
    """Refuse, in one line, flags that only mean something for a generator."""
    given = [flag for name, flag in POLICY_ONLY.items() if getattr(settings, name) is not None]
    if settings.engine != "hf":
        given.append("--engine")
    if settings.executor != "local":
        given.append("--executor")
    if given:
        raise ConfigError(f"'{what}' is a reward model: it is scored on preference pairs (pairwise accuracy, "
                          f"margin), not sampled, so {', '.join(given)} do not apply; options that do: --data "
                          "(pair files), --max-samples (pairs), --batch-size (pairs a forward), --select, --out")


def rm_config_of(run_dir: Path | None) -> tuple[RMConfig, dict | None]:
    """The ``verl rm`` run's config (its pair columns, lengths and validation files) and its raw dict, or the
    defaults and None."""
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return RMConfig(), None
    raw = load_yaml(run_dir / "config.yaml")
    return build_config(raw, str(run_dir / "config.yaml"), schema=RMConfig), raw


@dataclass
class PairEvaluation:
    """Scores checkpoints of one reward model on one set of pairs (the data are tokenized once, by the first
    checkpoint's tokenizer; a run's checkpoints share it)."""

    settings: Any  # eval.runner.EvalSettings: the flags that apply to pairs (data, max_samples, batch_size, ...)
    config: RMConfig
    raw_config: dict | None = None  # the run's config.yaml, as written (compare diffs it)
    console: Any = None

    def __post_init__(self) -> None:
        self.files = list(self.settings.data or self.config.data.val_files)
        if not self.files:
            raise ConfigError("the reward model's run has no data.val_files to score; give pairs with --data "
                              "(parquet with prompt/chosen/rejected, or builtin:arithmetic/pairs_val)")
        self.max_pairs = self.settings.max_samples or self.config.data.val_max_samples
        self.device = pick_device(self.settings.device)
        self.data: PairData | None = None
        set_num_threads(self.settings.num_threads or self.config.trainer.num_threads)

    @property
    def results_settings(self) -> dict[str, Any]:
        d = self.config.data
        return {"kind": KIND, "data_files": self.files, "max_samples": self.max_pairs, "max_length": d.max_length,
                "keys": [d.prompt_key, d.chosen_key, d.rejected_key]}

    @property
    def fingerprint(self) -> str:
        return hashlib.sha1(json.dumps(self.results_settings, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def is_run_default(self) -> bool:
        return not self.settings.data and not self.settings.max_samples

    def results_root(self, run_dir: Path) -> Path:
        """``<run>/eval`` for the run's own held-out pairs, ``<run>/eval/pairs-<hash>`` for any other."""
        return run_dir / "eval" if self.is_run_default else run_dir / "eval" / f"pairs-{self.fingerprint[:8]}"

    def pairs(self, tokenizer_path: str) -> PairData:
        if self.data is None:
            key = "--data" if self.settings.data else "data.val_files"
            self.data = PairData(self.files, key, load_tokenizer(tokenizer_path), self.config, self.max_pairs)
        return self.data

    def evaluate(self, model_path: str, out_dir: Path, label: str, step: int | None = None,
                 run_dir: Path | None = None) -> dict[str, Any]:
        """Score every pair with the reward model at ``model_path``; write and return ``results.json``'s content."""
        t0 = time.perf_counter()
        digest = model_hash(model_path)
        cached = reusable_results(out_dir, self.fingerprint, digest) if not self.settings.force else None
        if cached is not None:
            self._say(f"{label}: reusing {out_dir / 'results.json'} (same weights and pairs; --force recomputes)")
            return cached
        data = self.pairs(model_path)
        model = load_reward_model(model_path, self.settings.dtype or self.config.model.dtype, self.device, data.pad_id)
        model.eval()
        t1 = time.perf_counter()
        chosen, rejected = score_pairs(model, data, self.device, self.settings.batch_size or 64)
        scoring = time.perf_counter() - t1
        chosen, rejected = chosen.double().cpu(), rejected.double().cpu()
        margin = chosen - rejected
        columns = {"correct": (margin > 0).double(), "margin": margin, "loss": -F.logsigmoid(margin),
                   "reward_chosen": chosen, "reward_rejected": rejected}
        columns = {k: v.numpy() for k, v in columns.items()}
        metrics = {f"{METRIC_PREFIX}{name}": mean_metric(columns[column], column=column, binary=binary,
                                                         higher_is_better=better, evaluator="pairwise").to_dict()
                   for name, (column, better, binary) in PAIR_METRICS.items()}
        samples = self._sample_rows(data, columns)
        total = time.perf_counter() - t0
        results = {
            "schema": SCHEMA, "kind": KIND, "label": label, "checkpoint": str(model_path), "step": step,
            "run_dir": str(run_dir) if run_dir else None, "model_hash": digest,
            "created": datetime.now().isoformat(timespec="seconds"), "sampling": None,
            "data": {"files": self.files, "num_pairs": len(data), "num_dropped": data.num_dropped,
                     "max_samples": self.max_pairs, "max_length": self.config.data.max_length,
                     # compare's table reads num_prompts: a pair is the unit here
                     "num_prompts": len(data), "num_samples": len(data)},
            "evaluators": ["pairwise"], "metrics": metrics, "config": self.raw_config,
            "notes": ([f"{data.num_dropped} pairs longer than data.max_length={self.config.data.max_length} tokens "
                       "on a side were dropped"] if data.num_dropped else []),
            "settings_fingerprint": self.fingerprint, "versions": versions(), "device": str(self.device),
            "timing": {"load_seconds": t1 - t0, "scoring_seconds": scoring, "total_seconds": total,
                       "pairs_per_second": len(data) / scoring if scoring else None},
        }
        write_results(out_dir, results, samples)
        write_pair_report(out_dir, results, samples)
        self._say(f"{label}: {summary_line(results)}  -> {out_dir}")
        return results

    @staticmethod
    def _sample_rows(data: PairData, columns: dict[str, np.ndarray]) -> list[dict]:
        ids = content_ids([[p.prompt, p.chosen, p.rejected] for p in data.pairs])
        rows = []
        for i, pair in enumerate(data.pairs):
            row = {"prompt_id": ids[i], "index": i, "prompt": pair.prompt, "chosen": pair.chosen,
                   "rejected": pair.rejected, "where": pair.where}
            row.update({name: float(values[i]) for name, values in columns.items()})
            rows.append(row)
        return rows

    def _say(self, text: str) -> None:
        if self.console is not None and not self.settings.quiet:
            self.console.print(text, soft_wrap=True, highlight=False)


def summary_line(results: dict) -> str:
    d, m = results["data"], results["metrics"]
    parts = [f"{d['num_pairs']} pairs from {', '.join(d['files'])}"]
    for key in ("eval/pairwise_accuracy", "eval/margin"):
        value, se = m[key]["value"], m[key]["se"]
        parts.append(f"{key[5:]} {value:.4g}" + (f" ± {1.96 * se:.2g}" if se is not None else ""))
    rate = results["timing"].get("pairs_per_second")
    if rate:
        parts.append(f"{rate:.0f} pairs/s")
    return ", ".join(parts)


def evaluate_reward_model(target: Any, settings: Any, out: str | Path | None, console: Any) -> dict:
    """``verl eval --ckpt`` on a reward model: one checkpoint (or exported model), or every checkpoint of a run
    (``target``: eval.runner's CheckpointRef; ``settings``: its EvalSettings)."""
    check_settings(settings, target.path)
    evaluation = PairEvaluation(settings, *rm_config_of(target.run_dir), console)
    if target.kind != "run":
        if out is not None:
            out_dir = Path(out)
        elif target.run_dir is not None:
            out_dir = evaluation.results_root(target.run_dir) / target.label
        else:
            out_dir = Path("outputs") / "eval" / target.label
        return evaluation.evaluate(target.path, out_dir, target.label, target.step, target.run_dir)

    run_dir = Path(target.path)
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"run '{run_dir}' has no complete checkpoints (checkpoints/global_step_N with "
                              "meta.json); `verl rm` saves one at every validation and at the end")
    metric, mode = parse_select(settings.select if settings.select != DEFAULT_SELECT else VALIDATION_METRIC)
    out_dir = Path(out) if out is not None else evaluation.results_root(run_dir)
    per_checkpoint = [evaluation.evaluate(str(path), out_dir / path.name, path.name, step, run_dir)
                      for step, path in checkpoints]
    summary = write_run_summary(out_dir, run_dir, per_checkpoint, settings.select, metric, mode,
                                {**evaluation.results_settings, "tag": out_dir.name,
                                 "run_defaults": evaluation.is_run_default}, None, kind=KIND,
                                data=per_checkpoint[-1]["data"])
    best = summary["best"]
    write_run_report(out_dir, summary, run_dir)
    if console is not None and not settings.quiet:
        console.print(f"best by {metric}:{mode}: {best['label']} ({best['value']:.4g}) on "
                      f"{summary['data']['num_pairs']} pairs -> {out_dir / 'best.json'}", highlight=False,
                      soft_wrap=True)
    return summary
