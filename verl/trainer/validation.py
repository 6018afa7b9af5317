"""Validation: generate on the validation prompts (greedy by default), score with the run's reward, and run
the evaluators of ``trainer.evaluators`` on the same batch.

The same functions serve the PPO trainer and the SFT trainer, so ``eval/accuracy`` means the same thing in
both: the strict-format accuracy (``acc`` of the reward function), with ``accuracy_flexible`` beside it. The
evaluators are ``verl eval``'s (``verl.evaluators``), so a name means the same numbers in training and offline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verl.config import EvalTaskConfig, RewardConfig, VerlConfig
from verl.data.contamination import TrainingIndex, summary, text_of
from verl.data.dataset import RLHFDataset
from verl.errors import ConfigError
from verl.evaluators import EvalBatch, Metric, build_evaluator, run_evaluators
from verl.evaluators.groups import AUTO_GROUP_COLUMN, group_labels, has_column, metric_key_part, metrics_by_group
from verl.evaluators.registry import evaluator_label, evaluator_needs
from verl.evaluators.stats import mean_metric
from verl.protocol import DataProto, pad_responses
from verl.rollout.base import RolloutEngine, SamplingParams
from verl.rollout.recorded_episodes import episode_last_rows
from verl.workers.reward import RewardManager


def generate_and_score(
    engine: RolloutEngine,
    dataset: RLHFDataset,
    reward: RewardManager,
    params: SamplingParams,
    batch_size: int,
    max_samples: int | None = None,
) -> tuple[DataProto, np.ndarray, dict[str, np.ndarray], list[str]]:
    """Generate for the first ``max_samples`` prompts; return (batch, scores, extras, response texts)."""
    count = min(len(dataset), max_samples or len(dataset))
    outputs, scores, texts = [], [], []
    extras: dict[str, list[np.ndarray]] = {}
    for start in range(0, count, batch_size):
        prompts = dataset.collate(list(range(start, min(start + batch_size, count))))
        out = final_samples(engine.generate(prompts, params))
        token_scores, ex, txt = reward.compute(out)
        outputs.append(out)
        scores.append(token_scores.sum(-1).numpy())
        texts.extend(txt)
        for key, value in ex.items():
            extras.setdefault(key, []).append(value)
    batch = DataProto.concat(pad_responses(outputs, dataset.tokenizer.pad_token_id))
    return batch, np.concatenate(scores), {k: np.concatenate(v) for k, v in extras.items()}, texts


def final_samples(batch: DataProto) -> DataProto:
    """A gateway batch scored once per episode: each episode's last sample (its final answer; an agent that
    rewrote its history gave several, ``verl.rollout.recorded_episodes``). Other batches as they are."""
    if "episode" not in batch.non_tensor:
        return batch
    last = np.unique(episode_last_rows(batch.non_tensor["episode"]))
    return batch if len(last) == len(batch) else batch.index(last)


def accuracy_of(scores: np.ndarray, acc: np.ndarray | None) -> float:
    """Validation accuracy: the reward function's strict ``acc`` where it gives one, else the share of positive
    scores (shapes ``(responses,)``)."""
    return float(np.nanmean(acc)) if acc is not None else float((scores > 0).mean())


def validation_metrics(batch: DataProto, scores: np.ndarray, extras: dict[str, np.ndarray]) -> dict[str, float]:
    """``eval`` scope fields: accuracy (strict), accuracy_flexible, reward_mean, response length."""
    metrics: dict[str, float] = {"reward_mean": float(scores.mean()), "num_samples": float(len(scores))}
    acc = extras.get("acc")
    metrics["accuracy"] = accuracy_of(scores, acc)
    if "acc_flexible" in extras:
        metrics["accuracy_flexible"] = float(np.nanmean(extras["acc_flexible"]))
    lengths = batch.batch["response_mask"].sum(-1).float()
    metrics["response_length_mean"] = float(lengths.mean())
    return metrics


# ---------------------------------------------------------------------------------------------- contamination

def validation_overlap(config: VerlConfig, train: RLHFDataset, val: RLHFDataset) -> tuple[list[str | None], dict]:
    """Per validation prompt, how it overlaps the training prompts (``"exact"``, ``"13-gram"`` or None), and the
    summary ``verl eval`` records; ``data.contamination=strict`` refuses any overlap before the run starts."""
    key = config.data.prompt_key
    index = TrainingIndex.of(text_of(row[key]) for row in train.rows)
    kinds = index.overlaps_rows(val.rows, key)
    info = summary(kinds, config.data.train_files, index.n)
    if config.data.contamination == "strict" and info["overlapping"]:
        raise ConfigError(
            f"data.contamination=strict: {info['overlapping']} of {info['checked']} validation prompts "
            f"(data.val_files) overlap the training data ({info['exact']} exactly, {info['ngram']} by a shared "
            f"{index.n}-gram); remove them with `verl data decontaminate TRAIN --against VAL --out CLEAN`, or set "
            "data.contamination=warn to train anyway and read eval/clean/* beside the whole")
    return kinds, info


def clean_validation_metrics(overlap: list[str | None], scores: np.ndarray, extras: dict[str, np.ndarray]
                             ) -> dict[str, float]:
    """``eval/clean/*``: accuracy and reward mean on the validation prompts the training data does not hold.

    ``overlap`` is per validated prompt; ``scores`` and ``extras`` are per response, a prompt's n responses adjacent
    (shape ``(prompts * n,)``)."""
    n = len(scores) // max(len(overlap), 1)
    clean = np.repeat(np.array([kind is None for kind in overlap]), n)
    metrics = {"num_samples": float(clean.sum()), "overlapping_prompts": float(sum(k is not None for k in overlap))}
    if clean.any():
        metrics["reward_mean"] = float(scores[clean].mean())
        acc = extras.get("acc")
        metrics["accuracy"] = accuracy_of(scores[clean], None if acc is None else acc[clean])
    return metrics


def sample_rows(columns: dict[str, np.ndarray], texts: list[str], scores, limit: int, stride: int = 1
                ) -> list[dict[str, Any]]:
    """Up to ``limit`` generations, every ``stride``-th, as ``sample`` rows (prompt, response, ground truth, score);
    ``columns``: the batch's dataset columns (``raw_prompt``, ``ground_truth``), each ``(N,)``.

    With ``stride = n`` (a prompt's n responses are adjacent) the rows show different prompts.
    """
    prompts, truths = columns["raw_prompt"], columns["ground_truth"]
    return [{"prompt": str(prompts[i]), "response": texts[i], "ground_truth": str(truths[i]), "score": float(scores[i])}
            for i in list(range(0, len(texts), stride))[:limit]]


class EvalTask:
    """A ``trainer.eval_tasks`` entry at run time: its prompts (the run's training prompts left out, as validation
    leaves them out), its own data sources' rewards (``reward.name=auto``: never the training reward, its custom
    function or reward model), its evaluators, and when it runs."""

    def __init__(self, spec: EvalTaskConfig, config: VerlConfig, tokenizer: Any):
        self.spec, self.tokenizer = spec, tokenizer
        if spec.lm_eval_task:  # lm-eval's own prompts and metrics, on the policy in memory
            from verl.evaluators.lm_eval import LmEvalRequest  # noqa: PLC0415

            self.lm_eval = LmEvalRequest.parse([spec.lm_eval_task], spec.lm_eval_include, spec.lm_eval_args)
            return
        self.lm_eval = None
        key = f"trainer.eval_tasks.{spec.name}.data"
        data_cfg = config.data.model_copy(update={
            "max_prompt_length": spec.max_prompt_length or config.data.max_prompt_length})
        self.dataset = RLHFDataset(spec.data, tokenizer, data_cfg, key, True, disjoint_from=config.data.train_files)
        self.reward = RewardManager(tokenizer, RewardConfig(sandbox=config.reward.sandbox))
        self.evaluators = []
        for evaluator_spec in spec.evaluators:
            evaluator = build_evaluator(evaluator_spec)
            check_validation_needs(evaluator, f"trainer.eval_tasks.{spec.name}: {evaluator_spec}", config)
            self.evaluators.append(evaluator)

    def due(self, step: int) -> bool:
        return self.spec.every is None or step % self.spec.every == 0

    def run(self, config: VerlConfig, engine: RolloutEngine, params: SamplingParams,
            kl_terms: Callable[[DataProto], dict[str, torch.Tensor]], policy: Any = None) -> dict[str, float]:
        """Generate on the task's prompts and score them: ``{<name>/<metric>: value}`` for the ``eval`` scope.
        ``policy``: the model in this process (an lm-eval task runs on it)."""
        if self.lm_eval is not None:
            return self._run_lm_eval(policy)
        if self.spec.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=self.spec.max_new_tokens)
        batch, scores, extras, texts = generate_and_score(engine, self.dataset, self.reward, params,
                                                          config.data.val_batch_size, self.spec.max_samples)
        metrics = validation_metrics(batch, scores, extras)
        evaluated, _ = run_validation_evaluators(config, self.evaluators, batch, texts, scores, extras, kl_terms)
        metrics.update({name: metric.value for name, metric in evaluated.items()})
        return {f"{self.spec.name}/{name}": value for name, value in metrics.items()}

    def _run_lm_eval(self, policy: Any) -> dict[str, float]:
        from verl.evaluators.lm_eval import PREFIX, convert, in_memory_lm, run_lm_eval  # noqa: PLC0415

        if policy is None:
            raise ConfigError(f"trainer.eval_tasks.{self.spec.name}: an lm_eval_task runs on the policy in the "
                              "trainer's process; the Ray executor holds it in its workers: run `verl eval "
                              "--lm-eval-task` on the checkpoints instead")
        was_training = policy.training
        device = str(next(policy.parameters()).device)
        try:
            with torch.no_grad():
                lm = in_memory_lm(policy, self.tokenizer, self.lm_eval.args.get("batch_size", 1), device)
                out = run_lm_eval(lm, self.lm_eval, device)
        finally:
            policy.train(was_training)  # lm-eval puts the model in eval mode
        metrics, _, _ = convert(out)
        return {f"{self.spec.name}/{name[len(PREFIX):]}": m["value"] for name, m in metrics.items()}


class Validator:
    """A policy run's validation: its prompts, reward, evaluators (``trainer.evaluators`` and registered ones),
    ``data.val_group_by`` groups, the prompts that overlap the training data, and ``trainer.eval_tasks``."""

    def __init__(self, config: VerlConfig, dataset: RLHFDataset, reward_manager: Any,
                 overlap: list[str | None] | None, contamination: dict | None):
        self.config, self.dataset, self.reward_manager = config, dataset, reward_manager
        self.overlap, self.contamination = overlap, contamination
        # data.val_group_by: (column, each validation row's group), or None; refused now if no row has the column.
        self.groups = validation_group_labels(config, dataset)
        self.registered: list[Any] = []  # register_evaluator() objects
        self._configured: list[Any] | None = None  # trainer.evaluators, built on first use
        # Built now: a task's missing data or unknown evaluator fails before the first step.
        self.tasks = [EvalTask(spec, config, dataset.tokenizer) for spec in config.trainer.eval_tasks]

    def register(self, evaluator: Any) -> None:
        """Run ``evaluator`` at every validation; refused at once if validation cannot compute what it needs."""
        check_validation_needs(evaluator, getattr(evaluator, "name", type(evaluator).__name__), self.config)
        self.registered.append(evaluator)

    def evaluators(self) -> list[Any]:
        """``trainer.evaluators`` (built once: an unknown one fails on the first call) and the registered ones."""
        if self._configured is None:
            self._configured = build_validation_evaluators(self.config)
        return [*self._configured, *self.registered]

    def run(self, engine: RolloutEngine, params: SamplingParams,
            kl_terms: Callable[[DataProto], dict[str, torch.Tensor]], step: int = 0, policy: Any = None
            ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Generate on the validation split and score it, then the eval tasks due at ``step``: the ``eval`` scope's
        metrics (without the scope) and the sample rows to log."""
        cfg = self.config
        batch, scores, extras, texts = generate_and_score(engine, self.dataset, self.reward_manager, params,
                                                          cfg.data.val_batch_size, cfg.data.val_max_samples)
        metrics = validation_metrics(batch, scores, extras)
        # The same evaluator code as `verl eval`, so eval/accuracy here equals its accuracy on this checkpoint.
        evaluators = self.evaluators()
        evaluated, columns = run_validation_evaluators(cfg, evaluators, batch, texts, scores, extras, kl_terms)
        metrics.update({name: metric.value for name, metric in evaluated.items()})
        if self.groups is not None:  # data.val_group_by: eval/<column>/<group>/<metric>, beside the whole
            column, labels = self.groups
            metrics.update(grouped_validation_metrics(column, labels, batch, texts, scores, extras, evaluated,
                                                      columns, evaluators))
        if self.contamination and self.contamination["overlapping"]:
            # Beside the whole, never instead of it: the curve a user already watches keeps its meaning.
            validated = self.overlap[:cfg.data.val_max_samples]  # the prompts generate_and_score used
            metrics.update({f"clean/{k}": v for k, v in clean_validation_metrics(validated, scores, extras).items()})
        for task in self.tasks:
            if task.due(step):
                metrics.update(task.run(cfg, engine, params, kl_terms, policy))
        return metrics, sample_rows(batch.non_tensor, texts, scores, cfg.trainer.num_samples_to_log)


# ---------------------------------------------------------------------------------------------- evaluators

def check_validation_needs(evaluator: Any, label: str, config: VerlConfig) -> None:
    """Refuse, with the fix, an evaluator whose inputs this run's validation cannot compute. Validation computes
    every input of ``verl.evaluators.batch.NEEDS`` (the one list; the registry refuses others), tool calls only in
    multi-turn and gateway runs (a gateway's calls are the served policy's) and reference log-probs only where a
    reference is loaded."""
    needs = evaluator_needs(evaluator)
    if "tool_calls" in needs and not (config.rollout.multi_turn.enable or config.rollout.gateway.enabled):
        raise ConfigError(
            f"trainer.evaluators: '{label}' measures tool calls, which only multi-turn rollouts make; set "
            "rollout.multi_turn.enable=true (with rollout.multi_turn.tools) or drop it"
        )
    if "ref_logprobs" in needs and not config.use_reference:
        raise ConfigError(
            f"trainer.evaluators: '{label}' needs the reference model, which this run does not load "
            "(actor.use_kl_loss and algorithm.use_kl_in_reward are off); set reference.enable=true, or run "
            f"`verl eval --evaluators {label}` on the checkpoints"
        )


def build_validation_evaluators(config: VerlConfig) -> list[Any]:
    """The evaluators ``trainer.evaluators`` names, each checked against what validation can compute."""
    evaluators = []
    for spec in config.trainer.evaluators:
        evaluator = build_evaluator(spec)
        check_validation_needs(evaluator, spec, config)
        evaluators.append(evaluator)
    return evaluators


def run_validation_evaluators(config: VerlConfig, evaluators: list[Any], batch: DataProto, texts: list[str],
                              scores: np.ndarray, extras: dict[str, np.ndarray],
                              kl_terms: Callable[[DataProto], dict[str, torch.Tensor]]
                              ) -> tuple[dict[str, Metric], dict[str, np.ndarray]]:
    """Run ``evaluators`` on a validation batch; returns their metrics and per-sample columns ``(N,)`` each.

    ``batch`` is the validation rollout (``(N, response_len)`` tensors), ``scores`` ``(N,)`` the reward scores,
    ``extras`` the reward function's per-sample values, and ``kl_terms(batch)`` the roles' forward passes for an
    evaluator that needs reference log-probs (called only then).
    """
    v = config.rollout.val_kwargs
    sampling = {"n": v.n, "temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k,
                "max_new_tokens": config.data.max_response_length, "seed": config.trainer.seed}
    eval_batch = EvalBatch.from_rollout(batch, texts, scores, extras, n=v.n,
                                        max_new_tokens=config.data.max_response_length, sampling=sampling,
                                        n_bootstrap=0, seed=config.trainer.seed)
    for evaluator in evaluators:
        check_validation_needs(evaluator, evaluator_label(evaluator), config)
    if any("ref_logprobs" in evaluator_needs(e) for e in evaluators):
        eval_batch.kl_terms = kl_terms(batch)
    metrics, columns, _ = run_evaluators(evaluators, eval_batch)
    return metrics, columns


# ---------------------------------------------------------------------------------------------- groups

def validation_group_labels(config: VerlConfig, val: RLHFDataset) -> tuple[str, list[str]] | None:
    """``data.val_group_by``: the column and each validation row's group, or None (off, or ``auto`` on data without
    ``extra_info.kind``). A column no row has is refused before the run starts."""
    column = config.data.val_group_by
    if column == "auto":
        if not has_column(val.rows, AUTO_GROUP_COLUMN):
            return None
        column = AUTO_GROUP_COLUMN
    if column is None:
        return None
    return column, group_labels(val.rows, column, f"data.val_group_by ({', '.join(config.data.val_files)})")


def grouped_validation_metrics(column: str, labels: list[str], batch: DataProto, texts: list[str], scores: np.ndarray,
                               extras: dict[str, np.ndarray], evaluated: dict[str, Metric],
                               columns: dict[str, np.ndarray], evaluators: list[Any]) -> dict[str, float]:
    """Every validation metric per group: ``{<column leaf>/<group>/<metric>: value}`` for the ``eval`` scope
    (``eval/kind/two_steps/accuracy``). ``labels`` is per dataset row; the rest per response ``(N,)``, as
    ``run_validation_evaluators`` got and returned them."""
    index = np.asarray(batch.non_tensor["index"], dtype=np.int64)
    lengths = batch.batch["response_mask"].sum(-1).float().numpy().astype(np.float64)
    acc = extras.get("acc")
    base = {"accuracy": np.asarray(acc, np.float64) if acc is not None else (scores > 0).astype(np.float64),
            "reward_mean": np.asarray(scores, np.float64), "response_length_mean": lengths}
    if "acc_flexible" in extras:
        base["accuracy_flexible"] = np.asarray(extras["acc_flexible"], np.float64)
    whole = {name: mean_metric(values, index, aggregate="mean", column=f"_base_{name}") for name, values in
             base.items()}
    whole.update(evaluated)  # the evaluators' accuracy is the same number (the same reward extras)
    all_columns = {**{f"_base_{k}": v for k, v in base.items()}, "response_length": lengths, **columns}
    per_sample = [labels[i] for i in index]
    grouped = metrics_by_group(per_sample, whole, all_columns, texts, index,
                               {getattr(e, "spec", evaluator_label(e)): e for e in evaluators}, n_bootstrap=0, seed=0)
    leaf = metric_key_part(column.rsplit(".", 1)[-1])
    counts = {group: float(per_sample.count(group)) for group in grouped}
    out = {}
    for group, metrics in grouped.items():
        prefix = f"{leaf}/{metric_key_part(group)}"
        out[f"{prefix}/num_samples"] = counts[group]
        out.update({f"{prefix}/{name}": metric.value for name, metric in metrics.items()})
    return out
