"""The PPO-family driver loop, written once for every executor (single controller, as in HybridFlow).

One training step (``fit`` -> ``train_step``)::

    prompts -> rollout.generate (n per prompt) -> reward -> [old log-probs] -> [reference log-probs]
      -> [critic values] -> advantages (registry) -> [critic update] -> actor update -> its metrics

and around it, in ``fit``: metrics -> log (JSONL rows, trackers) -> callbacks (health rules, best checkpoint)
-> validation every test_freq -> checkpoint every save_freq. The actor's loss is three calls down:
``train_step`` -> ``roles.update_actor`` -> ``Actor.update_policy`` (``verl/workers/actor.py``), the same on
every executor.

What is *not* computed matters as much as what is: old log-probs only when the update is off-policy
(several epochs or mini-batches) or a KL-in-reward needs them; reference log-probs only with a KL term;
values only with a critic (GAE). Each stage is timed (``timing/<stage>``).

The trainer is concrete. The compute goes through a **roles** object (``Roles`` below): a ``RoleWorker`` in this
process (the local executor) or ``RayRoles`` over Ray worker groups. ``LocalPPOTrainer`` and ``RayPPOTrainer``
only build their roles and inputs and hand them to ``PPOTrainer``; the loop never changes between them.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from verl.algos.advantages import estimator_facts, get_adv_estimator
from verl.algos.kl import build_kl_controller, kl_penalty
from verl.algos.masked import masked_mean
from verl.algos.rollout_correction import correct, mismatch_metrics
from verl.config import VerlConfig
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.data.exports import DATA_LINEAGE_FILE, records_lineage
from verl.errors import ConfigError
from verl.models.loader import load_tokenizer
from verl.protocol import DataProto
from verl.rollout.base import SamplingParams, pad_responses
from verl.tools.templates import ToolPrompting
from verl.tracking import check_trackers
from verl.trainer.callbacks import CallbackList, TrainerCallback
from verl.trainer.checkpoint import (
    checkpoint_step,
    find_resume_checkpoint,
    load_trainer_state,
    write_checkpoint,
)
from verl.trainer.health import callbacks_from_config
from verl.trainer.missing_rewards import Dropped, mask_missing_rewards
from verl.trainer.resume import check_resumable, saved_config
from verl.trainer.run import Run
from verl.trainer.step_metrics import group_metrics, rollout_metrics
from verl.trainer.target import TARGET_SCOPE, Target, TargetClock
from verl.trainer.validation import (
    build_validation_evaluators,
    check_validation_needs,
    clean_validation_metrics,
    generate_and_score,
    grouped_validation_metrics,
    run_validation_evaluators,
    sample_rows,
    validation_group_labels,
    validation_metrics,
    validation_overlap,
)
from verl.utils import log
from verl.utils.fs import atomic_write_json
from verl.utils.profiling import profile_step
from verl.utils.seeding import rng_state, seed_everything, set_num_threads, set_rng_state
from verl.utils.system import SystemMonitor
from verl.utils.timing import StageTimer

MISMATCH_SCOPES = ("rollout_corr/", "training/", "sampling/")  # verl/algos/rollout_correction.py
GROUP_ID_STRIDE = 1_000_000_007  # filter_groups: a step's later generation batches get group ids of their own


def varied_group_rows(batch: DataProto, extras: dict[str, np.ndarray], metric: str | None) -> np.ndarray:
    """Row indices of the groups (``uid``, rows adjacent) whose samples differ in ``metric`` (``acc``: the rule's
    correctness; otherwise the sequence reward), or that hold a single sample — DAPO's filter, as verl keeps them."""
    values = (np.asarray(extras["acc"], dtype=np.float64) if metric in (None, "acc") and "acc" in extras
              else batch.batch["token_level_scores"].sum(-1).double().numpy())
    if metric == "acc" and "acc" not in extras:
        raise ConfigError("algorithm.filter_groups.metric=acc: this reward gives no acc; use score")
    uid = np.asarray(batch.non_tensor["uid"])
    keep = [np.flatnonzero(uid == u) for u in dict.fromkeys(uid.tolist())]
    return np.concatenate([rows for rows in keep if len(rows) == 1 or np.ptp(values[rows]) > 0] or [np.arange(0)])


def subset(batch: DataProto, extras: dict[str, np.ndarray], texts: list[str], rows: np.ndarray
           ) -> tuple[DataProto, dict[str, np.ndarray], list[str]]:
    """The batch, its per-sample reward extras and texts at ``rows``."""
    return (batch.index(rows), {k: np.asarray(v)[rows] for k, v in extras.items()},
            [texts[int(i)] for i in rows])

PPO_METRICS = {  # ppo/<name> <- the actor's update metric of that name
    "policy_loss": "policy_loss", "entropy": "entropy", "kl_div": "kl_div", "approx_kl": "ppo_kl",
    "clip_ratio": "clipfrac", "clip_ratio_lower": "clipfrac_lower", "kl_loss": "kl_loss", "grad_norm": "grad_norm",
    "lr": "lr", "nan_skipped": "nan_skipped",
}


class Roles(Protocol):
    """What the loop asks of the roles (shapes: ``batch`` rows = prompts x n; per-token tensors
    ``(batch, response_len)``)."""

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto: ...
    def compute_reward(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray], list[str]]: ...
    def compute_old_log_prob(self, batch: DataProto) -> torch.Tensor: ...
    def compute_ref_log_prob(self, batch: DataProto) -> torch.Tensor: ...
    def compute_values(self, batch: DataProto) -> torch.Tensor: ...
    def compute_kl_terms(self, batch: DataProto) -> dict[str, torch.Tensor]: ...
    def update_actor(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]: ...
    def update_critic(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]: ...
    def validation_engine(self) -> Any: ...
    def save(self, directory: str | Path) -> None: ...
    def load(self, directory: str | Path) -> None: ...
    def shutdown(self) -> None: ...


@dataclass
class TrainInputs:
    """What a run reads: the tokenizer, the prompt datasets and the sampler over the training prompts."""

    tokenizer: Any
    train_dataset: RLHFDataset
    val_dataset: RLHFDataset
    sampler: PromptSampler
    # Per validation prompt, its overlap with the training prompts (None: clean), and the summary; None when
    # data.contamination=off.
    val_overlap: list[str | None] | None = None
    contamination: dict | None = None


def prepare_inputs(config: VerlConfig, tokenizer: Any = None, train_dataset: RLHFDataset | None = None,
                   val_dataset: RLHFDataset | None = None) -> TrainInputs:
    """Threads and seeds, then tokenizer, datasets (given ones are used as they are) and the prompt sampler;
    resolves ``trainer.total_epochs`` into steps now that the dataset size is known."""
    cfg = config
    set_num_threads(cfg.trainer.num_threads)
    seed_everything(cfg.trainer.seed)
    tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    tools = ToolPrompting.from_config(cfg.rollout.multi_turn, tokenizer)  # prompts rendered with their tools
    train = train_dataset or RLHFDataset(cfg.data.train_files, tokenizer, cfg.data, "data.train_files",
                                         cfg.needs_ground_truth, tools)
    val = val_dataset or RLHFDataset(cfg.data.val_files, tokenizer, cfg.data, "data.val_files",
                                     cfg.needs_ground_truth, tools)
    sampler = PromptSampler(len(train), cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
    cfg.resolve_total_steps(len(train))  # trainer.total_epochs, as verl counts them
    overlap, contamination = (None, None) if cfg.data.contamination == "off" else validation_overlap(cfg, train, val)
    return TrainInputs(tokenizer, train, val, sampler, overlap, contamination)


class PPOTrainer:
    """The loop, over a ``roles`` object that does the compute (see the module docstring)."""

    def __init__(self, config: VerlConfig, roles: Roles, inputs: TrainInputs, reward_manager: Any,
                 device: torch.device, quiet: bool = False, rollout_worker_factory: Any = None):
        self.config = config
        self.roles = roles
        self.tokenizer, self.sampler = inputs.tokenizer, inputs.sampler
        self.train_dataset, self.val_dataset = inputs.train_dataset, inputs.val_dataset
        self.val_overlap, self.contamination = inputs.val_overlap, inputs.contamination
        # data.val_group_by: (column, each validation row's group), or None; refused now if no row has the column.
        self.val_groups = validation_group_labels(config, self.val_dataset)
        self.reward_manager = reward_manager  # scores validation responses in this process
        self.device = device
        self.quiet = quiet
        self.callbacks = CallbackList(callbacks_from_config(config))  # trainer.health / trainer.callbacks
        self.global_step = 0
        self.stop_reason: str | None = None
        self.skip_update_reason: str | None = None  # set by a health rule (action skip_step) for this step
        self.timer = StageTimer()
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.adv_fn = get_adv_estimator(config.algorithm.adv_estimator)
        self.evaluators: list[Any] = []  # register_evaluator() objects
        self._configured_evaluators: list[Any] | None = None  # trainer.evaluators, built on first use
        # The run's directory, trackers and logger: opened by _open_run, bound for fit, closed by _end_run.
        self.run = Run(config, quiet)
        self.monitor: SystemMonitor | None = None
        self.policy_version = 0  # actor updates applied so far: the version of the weights a rollout samples from
        # trainer.one_step_off_policy: a verl.trainer.overlap.RolloutWorker, started by this factory at the first step
        self.rollout_worker_factory = rollout_worker_factory
        self.rollout_worker: Any = None
        self._sampler_state_before_prefetch: dict[str, Any] | None = None
        # trainer.target: the training clock (validation excluded) and the first step that reaches the target.
        target = config.trainer.target
        self.target_clock = TargetClock(Target.parse(target)) if target else None

    def shutdown(self) -> None:
        """Release the roles' resources (workers, engines)."""
        self._stop_rollout_worker()
        self.roles.shutdown()

    def _stop_rollout_worker(self) -> None:
        if self.rollout_worker is not None:
            self.rollout_worker.shutdown()
            self.rollout_worker = None

    # ------------------------------------------------------------------ public API

    def add_callback(self, callback: TrainerCallback) -> None:
        self.callbacks.add(callback)

    def register_evaluator(self, evaluator: Any) -> None:
        """Run ``evaluator`` at every validation (see ``verl.evaluators``); refused at once if validation cannot
        compute what it needs."""
        label = getattr(evaluator, "name", type(evaluator).__name__)
        check_validation_needs(evaluator, label, self.config)
        self.evaluators.append(evaluator)

    def validation_evaluators(self) -> list[Any]:
        """``trainer.evaluators`` (built once) and the ``register_evaluator`` objects."""
        if self._configured_evaluators is None:
            self._configured_evaluators = build_validation_evaluators(self.config)
        return [*self._configured_evaluators, *self.evaluators]

    def request_stop(self, reason: str) -> None:
        """Stop after the current step: a final checkpoint is written and ``fit`` returns normally."""
        self.stop_reason = self.stop_reason or reason

    def request_skip_update(self, reason: str) -> None:
        """Skip this step's critic and actor updates (call from ``on_rollout_end``; the next step is unaffected)."""
        self.skip_update_reason = self.skip_update_reason or reason

    @property
    def run_dir(self) -> Path:
        return self.run.dir

    @property
    def logger(self) -> log.RunLogger | None:
        return self.run.logger

    @property
    def trackers(self) -> list[Any]:
        return self.run.trackers

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train to ``trainer.total_steps`` (or a requested stop); returns the last step's logged metrics."""
        cfg = self.config
        validating = cfg.trainer.test_freq > 0
        if validating:
            self.validation_evaluators()  # an unknown evaluator fails now, before the run dir or any step
        self._start_run()
        if self.target_clock is not None:
            self.target_clock.start()  # after the models and a resumed checkpoint are loaded, as MLPerf times it
        metrics: dict[str, float] = {}
        try:
            with self.run.bound():  # log.info() from callbacks and rewards: this run's rows
                self.callbacks.on_train_start(self)
                if cfg.trainer.one_step_off_policy and self.global_step < cfg.trainer.total_steps:
                    # Start the rollout worker and its first batch now, so both overlap the first validation.
                    self.rollout_worker = self.rollout_worker_factory()
                    self._submit_rollout(self.global_step + 1)
                if validating and cfg.trainer.val_before_train and self.global_step == 0:
                    self.validate()
                while self.global_step < cfg.trainer.total_steps and self.stop_reason is None:
                    self.global_step += 1
                    step = self.global_step
                    self.logger.set_step(step)
                    profiled = step in cfg.trainer.profile_steps
                    measured = self._profiled_step(step) if profiled else self.train_step(step)
                    if self.target_clock is not None:
                        self.target_clock.mark_update(step)
                    metrics = self.logger.log_step(step, measured)  # JSONL rows + trackers, with log.info() fields
                    self.callbacks.on_log(metrics, step=step)
                    self._check_target(step, metrics)
                    self.callbacks.on_step_end(self, step, metrics)  # health rules may request a stop here
                    final = step == cfg.trainer.total_steps or self.stop_reason is not None
                    if validating and (step % cfg.trainer.test_freq == 0 or final):
                        metrics.update(self.validate())
                        final = final or self.stop_reason is not None  # e.g. the target, reached in validation
                    if final or (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0):
                        self._checkpoint(step, metrics)
                reason = self.stop_reason or "completed"
                self.logger.event("train", step=self.global_step, status="finished", reason=reason)
                self.callbacks.on_train_end(self, reason)
        finally:
            self._stop_rollout_worker()  # a batch generated ahead of a stop is dropped; resume regenerates it
            self._end_run()
        return metrics

    def _profiled_step(self, step: int) -> dict[str, float]:
        """``train_step`` under torch.profiler (trainer.profile_steps); files in <run dir>/profile/."""
        self.timer.profiling = True
        try:
            with profile_step(self.run_dir, step, self.timer.seconds):
                metrics = self.train_step(step)
        finally:
            self.timer.profiling = False
        self.logger.event("profile", step=step, trace=str(self.run_dir / "profile" / f"step_{step}.trace.json"))
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        """One step (the module docstring's list); returns what it measured as ``scope/name`` metrics."""
        cfg = self.config
        n = cfg.rollout.n
        with self.timer("total"):
            batch, extras, texts, dropped, overlap = self._generate_and_score(step)
            # Of the step's (first) generation batch: what the policy solves, before any filter drops groups.
            groups = group_metrics(batch, extras)
            if cfg.algorithm.filter_groups.enable:
                batch, extras, texts, filtered = self._fill_with_varied_groups(step, batch, extras, texts, dropped)
                groups.update(filtered)
            # Not in bypass mode: the rollout's log-probs are its old_log_probs (a trainer forward would be dropped).
            trainer_old = (self.needs_old_log_probs and "old_log_probs" not in batch.batch
                           and not cfg.algorithm.rollout_correction.bypass_mode)
            if trainer_old:
                with self.timer("old_log_prob"):
                    batch.batch["old_log_probs"] = self.roles.compute_old_log_prob(batch)
            mismatch = self._correct_rollout(batch, trainer_old)
            if cfg.use_reference and "ref_log_prob" not in batch.batch:  # the rollout worker may have computed it
                with self.timer("ref"):
                    batch.batch["ref_log_prob"] = self.roles.compute_ref_log_prob(batch)
            if cfg.use_critic:
                with self.timer("values"):
                    batch.batch["values"] = self.roles.compute_values(batch)
            with self.timer("adv"):
                kl_metrics = self._apply_kl_in_reward(batch)
                advantages, returns = self.adv_fn(
                    token_level_rewards=batch.batch["token_level_rewards"],
                    response_mask=batch.batch["response_mask"].float(),
                    values=batch.batch.get("values"),
                    index=batch.non_tensor["uid"],
                    reward_baselines=batch.batch.get("reward_baselines"),
                    gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                )
                batch.batch["advantages"], batch.batch["returns"] = advantages, returns
            rollout = rollout_metrics(batch, extras, cfg.data.max_response_length, self.tokenizer.pad_token_id)
            rollout.update(overlap)
            # Health rules with action skip_step decide here, on the rollout alone (e.g. a batch with no signal).
            self.skip_update_reason = None
            self.callbacks.on_rollout_end(self, step, {f"rollout/{k}": v for k, v in rollout.items()})
            critic_metrics: dict[str, float] = {}
            actor_metrics: dict[str, float] = {}
            if "rollout_rs_mask" in batch.batch:  # rejected tokens leave the update, not the rewards or the groups
                batch.batch["response_mask"] = batch.batch.pop("rollout_rs_mask")
            if self.skip_update_reason is None:
                if cfg.use_critic:
                    with self.timer("update_critic"):
                        critic_metrics = self.roles.update_critic(batch, self.critic_mini_batch_size)
                if step > cfg.critic.warmup_steps or not cfg.use_critic:
                    with self.timer("update_actor"):
                        actor_metrics = self.roles.update_actor(batch, cfg.actor.ppo_mini_batch_size * n)
                    self.policy_version += 1
        self._log_samples(step, batch, texts)
        metrics = self._step_metrics(step, batch, rollout, actor_metrics, critic_metrics, kl_metrics)
        # Mismatch and correction metrics carry their own scopes (verl's and TRL's names): measured here or by the
        # actor's forwards.
        metrics.update(log.scoped("batch", groups))
        metrics.update(mismatch)
        metrics.update({k: v for k, v in actor_metrics.items() if k.startswith(MISMATCH_SCOPES)})
        if self.config.reward.model.path or self.config.reward.model.url:
            metrics.update(log.scoped("reward", dropped.metrics()))
        return metrics

    def _generate_and_score(self, step: int, generation: int = 0
                            ) -> tuple[DataProto, dict[str, np.ndarray], list[str], Dropped, dict[str, float]]:
        """Generate this step's (``generation``-th) batch and score it: ``token_level_scores`` set, rewards that
        could not be obtained masked. Returns the batch, the reward extras and texts, the masked rewards and the
        rollout's version metrics."""
        n = self.config.rollout.n
        prompts, batch, overlap = self._rollout(step)
        # The group id: responses to one prompt. Later generation batches of a step (filter_groups) get ids of
        # their own, so a prompt drawn again does not merge two groups.
        index = np.asarray(batch.non_tensor["index"])
        batch.non_tensor["uid"] = index if generation == 0 else index.astype(np.int64) + generation * GROUP_ID_STRIDE
        if estimator_facts(self.config.algorithm.adv_estimator).needs_greedy_baseline:
            with self.timer("gen_baseline"):
                batch.batch["reward_baselines"] = self._greedy_baseline(prompts).repeat_interleave(n)
        with self.timer("reward"):
            scores, extras, texts = self.roles.compute_reward(batch)
            scores, dropped = self._mask_missing_rewards(batch, scores)
            batch.batch["token_level_scores"] = scores
        return batch, extras, texts, dropped, overlap

    def _fill_with_varied_groups(self, step: int, batch: DataProto, extras: dict[str, np.ndarray], texts: list[str],
                                 dropped: Dropped) -> tuple[DataProto, dict[str, np.ndarray], list[str], dict]:
        """``algorithm.filter_groups`` (DAPO's dynamic sampling, as verl's recipe does it): keep the groups whose
        samples differ in the metric, generate further batches until ``data.train_batch_size`` groups are kept,
        then cut to exactly that many. When ``max_num_gen_batches`` is spent first, train on the groups kept (all
        of the last batch if none were) and log a WARNING row; verl raises there, which ends a long run over one
        hard batch. Returns the kept batch, its extras and texts, and ``batch/*`` metrics."""
        cfg = self.config.algorithm.filter_groups
        n, wanted = self.config.rollout.n, self.config.data.train_batch_size
        parts: list[tuple[DataProto, dict[str, np.ndarray], list[str]]] = []
        kept_groups = generated_groups = 0
        generation = 0
        while True:
            keep = varied_group_rows(batch, extras, cfg.metric)
            generated_groups += len(batch) // n
            kept_groups += len(keep) // n
            if len(keep):
                parts.append(subset(batch, extras, texts, keep))
            generation += 1
            if kept_groups >= wanted:
                break
            if cfg.max_num_gen_batches and generation >= cfg.max_num_gen_batches:
                message = (f"algorithm.filter_groups: {kept_groups} of {wanted} groups vary in "
                           f"{cfg.metric or 'acc'} after {generation} generation batches (max_num_gen_batches); "
                           "the step trains on " + ("them" if parts else "the last batch, which carries no signal")
                           + ": the data may be too easy or too hard for the policy")
                self.logger.event("filter_groups", level="WARNING", step=step, status="budget_spent",
                                  kept_groups=kept_groups, generation_batches=generation, message=message)
                if not parts:
                    parts.append((batch, extras, texts))
                break
            batch, extras, texts, more_dropped, _ = self._generate_and_score(step, generation)
            dropped.merge(more_dropped)
        batch = DataProto.concat(pad_responses([p[0] for p in parts], self.tokenizer.pad_token_id))
        extras = {k: np.concatenate([p[1][k] for p in parts]) for k in parts[0][1] if all(k in p[1] for p in parts)}
        texts = [t for p in parts for t in p[2]]
        if len(batch) > wanted * n:  # whole groups: rows of a group are adjacent
            batch, extras, texts = subset(batch, extras, texts, np.arange(wanted * n))
        return batch, extras, texts, {"num_gen_batches": float(generation),
                                      "kept_group_share": kept_groups / max(generated_groups, 1)}

    def _mask_missing_rewards(self, batch: DataProto, scores: torch.Tensor) -> tuple[torch.Tensor, Dropped]:
        """Mask samples without a reward (and their groups, for group estimators) out of the step
        (``verl.trainer.missing_rewards``); a ReMax baseline that is missing counts as its group's reward missing."""
        baselines = batch.batch.get("reward_baselines")
        if baselines is not None and bool(torch.isnan(baselines).any()):
            scores = scores.clone()
            scores[torch.isnan(baselines)] = float("nan")
        cfg = self.config
        model = cfg.reward.model
        source = f"{'judge' if model.kind == 'judge' else 'reward model'} {model.url or model.path}"
        scores, batch.batch["response_mask"], dropped = mask_missing_rewards(
            scores, batch.batch["response_mask"], batch.non_tensor["uid"],
            estimator_facts(cfg.algorithm.adv_estimator).needs_groups, cfg.reward.model.max_failed_share, source)
        return scores, dropped

    # ------------------------------------------------------------------ pieces of the step

    def _rollout(self, step: int) -> tuple[DataProto, DataProto, dict[str, float]]:
        """This step's prompts, their rollout, and its version metrics.

        Synchronous: sample prompts and generate now (``timing/gen``). One-step off-policy
        (``trainer.one_step_off_policy``, see ``verl.trainer.overlap``): take the batch the rollout worker generated
        while the last step updated (``timing/wait_rollout`` is how long this waited for it), hand it the next
        step's prompts with the current weights, and use its behaviour log-probs as ``old_log_probs``.
        """
        if not self.config.trainer.one_step_off_policy:
            prompts = self.train_dataset.collate(self.sampler.next_batch())
            with self.timer("gen"):
                return prompts, self.roles.generate(prompts, self.train_sampling(step)), {}
        if self.rollout_worker is None:  # train_step called outside fit()
            self.rollout_worker = self.rollout_worker_factory()
        if not self.rollout_worker.pending:
            self._submit_rollout(step)
        with self.timer("wait_rollout"):
            done = self.rollout_worker.result()
        if step < self.config.trainer.total_steps and self.stop_reason is None:
            self._submit_rollout(step + 1)  # runs while this step updates
        for stage, seconds in done.seconds.items():  # the rollout worker's own stage times, concurrent with ours
            self.timer.seconds[stage] = self.timer.seconds.get(stage, 0.0) + seconds
        batch = done.batch
        # The behaviour's log-probs are the update's anchor (bypass, as verl) unless decoupled mode asks for pi_old.
        if not self.config.algorithm.rollout_correction.decoupled:
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        batch.meta["policy_version"] = done.policy_version
        return done.prompts, batch, {"policy_version": float(done.policy_version),
                                     "staleness": float(self.policy_version - done.policy_version)}

    def _submit_rollout(self, step: int) -> None:
        """Draw ``step``'s prompts and start generating them with the current weights. The sampler's state from
        before the draw is what a checkpoint saves, so a resume regenerates the batch that was in flight."""
        self._sampler_state_before_prefetch = self.sampler.state_dict()
        prompts = self.train_dataset.collate(self.sampler.next_batch())
        self.rollout_worker.submit(prompts, self.train_sampling(step), self.policy_version)

    @property
    def needs_old_log_probs(self) -> bool:
        cfg = self.config
        off_policy = cfg.actor.ppo_epochs > 1 or cfg.data.train_batch_size > cfg.actor.ppo_mini_batch_size
        return off_policy or cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollout_correction.decoupled


    def _correct_rollout(self, batch: DataProto, trainer_old: bool) -> dict[str, float]:
        """The rollout/trainer mismatch where the trainer's ``old_log_probs`` came from its own forward (measured
        here, exactly, at the weights that sampled; the actor measures it otherwise), and verl's rollout correction:
        decoupled mode adds ``rollout_is_weights`` and the rejection mask (``rollout_rs_mask``, applied to the
        update only); bypass mode makes the rollout's log-probs ``old_log_probs``. Returns ``scope/name`` metrics."""
        rollout = batch.batch.get("rollout_log_probs")
        rc = self.config.algorithm.rollout_correction
        if rollout is None:
            if rc.corrects:
                raise ConfigError(f"algorithm.rollout_correction needs the engine's log-probs, and rollout.name="
                                  f"{self.config.rollout.name} gave none for this batch: turn the correction off "
                                  "for this engine")
            return {}
        split: dict[str, float] = {}
        behaviour = batch.batch.get("behaviour_trainer_log_probs")
        if behaviour is not None:  # trainer.split_mismatch: the engine's part, at the weights that sampled
            engine = mismatch_metrics(behaviour, rollout, batch.batch["response_mask"])
            split = {k.replace("rollout_corr/", "rollout_corr/engine_"): v for k, v in engine.items()
                     if k.startswith("rollout_corr/")}
        if rc.bypass_mode:
            batch.batch["old_log_probs"] = rollout
            return split
        if not trainer_old:
            return split  # on-policy, or anchored on the behaviour's log-probs: the actor's forwards measure it
        old, mask = batch.batch["old_log_probs"], batch.batch["response_mask"]
        metrics = mismatch_metrics(old, rollout, mask)
        weights, kept, found = correct(old, rollout, mask, rc.rollout_is, rc.rollout_is_threshold,
                                       rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold)
        if weights is not None:
            batch.batch["rollout_is_weights"] = weights
        if rc.rollout_rs is not None:
            batch.batch["rollout_rs_mask"] = kept
        batch.batch.pop("rollout_log_probs")  # measured: the actor need not measure it again
        return {**metrics, **found, **split}

    @property
    def critic_mini_batch_size(self) -> int:
        prompts = self.config.critic.ppo_mini_batch_size or self.config.actor.ppo_mini_batch_size
        return prompts * self.config.rollout.n

    def train_sampling(self, step: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=self.config.data.max_response_length,
                              seed=self.config.trainer.seed * 1_000_003 + step,
                              logprobs=r.calculate_log_probs or self.config.algorithm.rollout_correction.corrects)

    def val_sampling(self) -> SamplingParams:
        v = self.config.rollout.val_kwargs
        return SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                              max_new_tokens=self.config.data.max_response_length, seed=self.config.trainer.seed)

    def _greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        """ReMax baseline: the reward of each prompt's greedy response, ``(batch,)``."""
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.config.data.max_response_length)
        greedy = self.roles.generate(prompts, params)
        scores, _, _ = self.roles.compute_reward(greedy)
        return scores.sum(-1)

    def _apply_kl_in_reward(self, batch: DataProto) -> dict[str, float]:
        scores = batch.batch["token_level_scores"]
        if not self.config.algorithm.use_kl_in_reward:
            batch.batch["token_level_rewards"] = scores
            return {}
        mask = batch.batch["response_mask"].float()
        kl = kl_penalty(batch.batch["old_log_probs"], batch.batch["ref_log_prob"], self.config.algorithm.kl_penalty)
        kl = kl * mask
        beta = self.kl_ctrl.value
        batch.batch["token_level_rewards"] = scores - beta * kl
        current_kl = float(masked_mean(kl, mask, dim=-1).mean())
        self.kl_ctrl.update(current_kl, n_steps=len(batch))
        return {"reward_kl_penalty": current_kl, "kl_coef": beta}

    def _step_metrics(self, step: int, batch: DataProto, rollout: dict[str, float], actor: dict[str, float],
                      critic: dict[str, float], kl_metrics: dict[str, float]) -> dict[str, float]:
        """The step's ``scope/name`` metrics (docs/architecture.md §5): rollout, ppo, critic, timing, throughput, train,
        system."""
        cfg = self.config
        lengths = batch.batch["response_mask"].sum(-1).float()
        ppo = {name: actor.get(key) for name, key in PPO_METRICS.items()}
        ppo.update(kl_coef=cfg.actor.kl_loss_coef if cfg.actor.use_kl_loss else self.kl_ctrl.value,
                   value_loss=critic.get("value_loss"), update_skipped=float(self.skip_update_reason is not None))
        ppo.update(kl_metrics)
        timings = self.timer.pop()
        tokens = int(batch.batch["attention_mask"].sum())
        throughput = {"tokens_per_second": tokens / max(timings.get("total", 1e-9), 1e-9),
                      "response_tokens_per_second": float(lengths.sum()) / max(timings.get("gen", 1e-9), 1e-9)}
        train = {"epoch": self.sampler.epoch, "progress": step / cfg.trainer.total_steps}
        self.logger.debug("timing", stages=timings, responses=len(batch), device=str(self.device))
        scopes = {"rollout": rollout, "ppo": {k: v for k, v in ppo.items() if v is not None}, "critic": critic,
                  "timing": timings, "throughput": throughput, "train": train, "system": self.monitor.sample()}
        return {key: value for scope, fields in scopes.items() for key, value in log.scoped(scope, fields).items()}

    def _log_samples(self, step: int, batch: DataProto, texts: list[str]) -> None:
        """Sample rows (prompt, response, score) and the histograms of rewards, lengths and advantages."""
        scores = batch.batch["token_level_scores"].sum(-1)
        mask = batch.batch["response_mask"]
        lengths = mask.sum(-1).float()
        for tracker in self.trackers:
            tracker.log_histograms({"rollout/rewards": batch.batch["token_level_rewards"].sum(-1).tolist(),
                                    "rollout/response_lengths": lengths.tolist(),
                                    "rollout/advantages": batch.batch["advantages"][mask.bool()].tolist()}, step)
        samples = []
        for row in sample_rows(batch, texts, scores, self.config.trainer.num_samples_to_log, self.config.rollout.n):
            self.logger.event("sample", step=step, split="train", **row)
            samples.append({**row, "split": "train"})
        if samples:
            for tracker in self.trackers:
                tracker.log_samples(samples, step)

    # ------------------------------------------------------------------ validation and checkpoints

    def validate(self) -> dict[str, float]:
        """Generate on the validation split (greedy by default); log ``eval/*`` and sample rows."""
        step = self.global_step
        start = time.perf_counter()
        batch, scores, extras, texts = generate_and_score(
            self.roles.validation_engine(), self.val_dataset, self.reward_manager, self.val_sampling(),
            self.config.data.val_batch_size, self.config.data.val_max_samples,
        )
        metrics = validation_metrics(batch, scores, extras)
        # The same evaluator code as `verl eval`, so eval/accuracy here equals its accuracy on this checkpoint.
        evaluators = self.validation_evaluators()
        evaluated, columns = run_validation_evaluators(self.config, evaluators, batch, texts, scores, extras,
                                                       kl_terms=self.roles.compute_kl_terms)
        metrics.update({name: metric.value for name, metric in evaluated.items()})
        if self.val_groups is not None:  # data.val_group_by: eval/<column>/<group>/<metric>, beside the whole
            column, labels = self.val_groups
            metrics.update(grouped_validation_metrics(column, labels, batch, texts, scores, extras, evaluated, columns,
                                                      evaluators))
        if self.contamination and self.contamination["overlapping"]:
            # Beside the whole, never instead of it: the curve a user already watches keeps its meaning.
            validated = self.val_overlap[:self.config.data.val_max_samples]  # the prompts generate_and_score used
            metrics.update({f"clean/{k}": v for k, v in clean_validation_metrics(validated, scores, extras).items()})
        metrics["seconds"] = time.perf_counter() - start
        samples = sample_rows(batch, texts, scores, self.config.trainer.num_samples_to_log)
        for row in samples:
            self.logger.event("sample", step=step, split="val", **row)
        for tracker in self.trackers:
            tracker.log_samples([{**row, "split": "val"} for row in samples], step)
        # Validation runs after the step's rows are written, so this writes the eval row alone.
        logged = self.logger.log_step(step, log.scoped("eval", metrics))
        if self.target_clock is not None:
            self.target_clock.add_validation(time.perf_counter() - start)
            self._check_target(step, logged)
        self.callbacks.on_evaluate(self, step, logged)
        return logged

    def _check_target(self, step: int, metrics: dict[str, float]) -> None:
        """Log the time-to-target record the first time ``trainer.target`` is reached (and stop, if asked)."""
        if self.target_clock is None:
            return
        record = self.target_clock.check(step, metrics)
        if record is None:
            return
        # One `target` row in verl_logs.jsonl (read by verl compare and the dashboard); trackers get its numbers.
        self.logger.log_step(step, {f"{TARGET_SCOPE}/{k}": v for k, v in record.items() if k != "step"})
        if not self.quiet:
            print(f"target {record['target']} reached at step {step} ({record['metric']} = {record['value']:.4g}): "
                  f"{record['minutes']:.2f} min of training to that step's update, validation "
                  f"{record['validation_seconds']:.1f} s apart", file=sys.stderr, flush=True)
        if self.config.trainer.stop_at_target:
            self.request_stop(f"target {record['target']} reached at step {step}")

    def _checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        with self.timer("save"):
            path = self.save_checkpoint(step, metrics)
        self.logger.event("train", step=step, checkpoint=str(path))
        for tracker in self.trackers:
            tracker.log_checkpoint(str(path), step, metrics)
        self.callbacks.on_save(self, step, path)

    def save_checkpoint(self, step: int, metrics: dict[str, float]) -> Path:
        return write_checkpoint(self.run_dir, step, self.roles.save, self.trainer_state(), metrics,
                                self.config.trainer.max_ckpt_to_keep)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = load_trainer_state(path)
        self.roles.load(path)
        self.restore_trainer_state(state)
        return state

    def trainer_state(self) -> dict[str, Any]:
        in_flight = self.rollout_worker is not None and self.rollout_worker.pending
        sampler = self._sampler_state_before_prefetch if in_flight else self.sampler.state_dict()
        state = {"global_step": self.global_step, "sampler": sampler, "kl_ctrl": self.kl_ctrl.state_dict(),
                 "rng": rng_state(), "policy_version": self.policy_version}
        if self.target_clock is not None:
            state["target_clock"] = self.target_clock.state_dict()
        return state

    def restore_trainer_state(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.policy_version = int(state.get("policy_version", self.global_step))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        if self.target_clock is not None and "target_clock" in state:
            self.target_clock.load_state_dict(state["target_clock"])

    # ------------------------------------------------------------------ run setup

    def _start_run(self) -> None:
        """Check what can fail without a run, then make (or reopen) the run directory and start logging.

        A start-up failure of a new run removes the directory it made, so nothing half-made is left behind.
        """
        cfg = self.config
        check_trackers(cfg.trainer.logger, cfg)  # unknown tracker, missing package, no wandb login: no run dir yet
        resume_from = find_resume_checkpoint(self.run_dir, cfg.trainer.resume)
        changes = self._check_resume(resume_from)
        fresh = not self.run_dir.exists()
        try:
            self._open_run(resume_from, changes)
        except BaseException:
            self._end_run()
            if fresh:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _check_resume(self, resume_from: Path | None) -> list[tuple[str, Any, Any]]:
        """The keys this run changes from the run's own config.yaml (refusing what a checkpoint cannot take)."""
        saved = saved_config(self.run_dir) if resume_from is not None else None
        return check_resumable(self.run_dir, saved, self.config) if saved is not None else []

    def _open_run(self, resume_from: Path | None, changes: list[tuple[str, Any, Any]]) -> None:
        cfg = self.config
        self.run.open(resumed_step=None if resume_from is None else checkpoint_step(resume_from))
        # The traffic behind a run trained on `verl data from-records` exports, kept with the run (and copied into
        # its exports), so a shipped model traces back to the records it learned from.
        lineage = records_lineage([*cfg.data.train_files, *cfg.data.val_files])
        if lineage:
            atomic_write_json(self.run_dir / DATA_LINEAGE_FILE, {"records": lineage})
        self.monitor = SystemMonitor()
        for tracker in self.trackers:
            tracker.log_config(cfg.model_dump(mode="json"))
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            self.logger.event("train", step=self.global_step, status="resumed", checkpoint=str(resume_from),
                              changed={k: [old, new] for k, old, new in changes})
        else:
            self.logger.event("train", step=0, status="started", run_dir=str(self.run_dir),
                              train_prompts=len(self.train_dataset), val_prompts=len(self.val_dataset),
                              filtered_prompts=self.train_dataset.num_filtered,
                              truncated_prompts=self.train_dataset.num_truncated,
                              **({"records": lineage} if lineage else {}))
        if self.contamination is not None:
            info = self.contamination
            note = (f"{info['overlapping']} of {info['checked']} validation prompts overlap the training data "
                    f"({info['exact']} exactly, {info['ngram']} by a shared {info['n']}-gram): eval/clean/* scores the "
                    "rest; `verl data decontaminate` removes them, data.contamination=strict refuses"
                    ) if info["overlapping"] else None
            # A run event (status), not a curve: its counts never reach the trackers as metrics.
            self.logger.event("contamination", level="WARNING" if note else "INFO", step=self.global_step,
                              status="checked", split="val", **info, **({"message": note} if note else {}))
        self.logger.debug("placement", device=str(self.device), executor=cfg.trainer.executor,
                          threads=torch.get_num_threads(), reference=cfg.use_reference, critic=cfg.use_critic)

    def _end_run(self) -> None:
        """Close what ``_open_run`` opened (also after a start-up failure part-way through it)."""
        self.run.close()
