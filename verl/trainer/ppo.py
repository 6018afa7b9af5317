"""The PPO-family driver loop, written once for every executor (single controller, as in HybridFlow).

One training step (``fit`` -> ``train_step``), each stage a function of the typed batch (``verl.batch.TrainBatch``)::

    prompts -> rollout.generate (n per prompt) -> reward       (verl.trainer.rollout_stage.RolloutStage)
      -> [old log-probs] -> rollout correction -> [reference log-probs] -> [critic values]
      -> KL in reward -> advantages (registry) -> [critic update] -> actor update -> its metrics
                                                                 (verl.trainer.stages, verl.trainer.step_metrics)

and around it, in ``fit``: metrics -> log (JSONL rows, trackers) -> callbacks (health rules, best checkpoint)
-> validation every test_freq -> checkpoint every save_freq. The actor's loss is three calls down:
``train_step`` -> ``roles.update_actor`` -> ``Actor.update_policy`` (``verl/workers/actor.py``), the same on
every executor.

What is *not* computed matters as much as what is: old log-probs only when the update is off-policy
(several epochs or mini-batches) or a KL-in-reward needs them; reference log-probs only with a KL term;
values only with a critic (GAE). Each stage is timed (``timing/<stage>``).

The trainer is concrete. The compute goes through a **roles** object (``Roles`` below): a ``RoleWorker`` in this
process (the local executor) or ``RayRoles`` over Ray worker groups; a batch reaches them as a ``DataProto``, the wire
format (``TrainBatch.to_proto``). ``LocalPPOTrainer`` and ``RayPPOTrainer``
only build their roles and inputs and hand them to ``PPOTrainer``; the loop never changes between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from verl.algos.advantages import get_adv_estimator
from verl.algos.kl import build_kl_controller
from verl.batch import Anchor, TrainBatch
from verl.config import VerlConfig
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.data.exports import DATA_LINEAGE_FILE, records_lineage
from verl.models.loader import load_tokenizer
from verl.protocol import DataProto
from verl.rollout.base import SamplingParams
from verl.tools.templates import ToolPrompting
from verl.tracking import check_trackers
from verl.trainer.callbacks import CallbackList, TrainerCallback
from verl.trainer.checkpoint import load_trainer_state
from verl.trainer.health import callbacks_from_config
from verl.trainer.rollout_stage import RolloutStage
from verl.trainer.run import Run
from verl.trainer.stages import apply_update_mask, compute_advantages, correct_rollout, kl_in_reward
from verl.trainer.step_metrics import MISMATCH_SCOPES, log_samples, rollout_metrics, step_metrics
from verl.trainer.validation import Validator, validation_overlap
from verl.utils import log
from verl.utils.fs import atomic_write_json
from verl.utils.profiling import profile_step
from verl.utils.seeding import rng_state, seed_everything, set_num_threads, set_rng_state
from verl.utils.system import SystemMonitor
from verl.utils.timing import StageTimer


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
                                     cfg.needs_ground_truth, tools, disjoint_from=cfg.data.train_files)
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
        self.validator = Validator(config, inputs.val_dataset, reward_manager, inputs.val_overlap, inputs.contamination)
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
        self.rollout_stage = RolloutStage(config, roles, inputs.train_dataset, inputs.sampler,
                                          inputs.tokenizer.pad_token_id, self.timer, rollout_worker_factory)
        # The run's directory, trackers and logger: opened by _start_run, bound for fit, closed at its end.
        self.run = Run(config, quiet)
        self.monitor: SystemMonitor | None = None
        self.policy_version = 0  # actor updates applied so far: the version of the weights a rollout samples from

    def shutdown(self) -> None:
        """Release the roles' resources (workers, engines)."""
        self.rollout_stage.stop()
        self.roles.shutdown()

    # ------------------------------------------------------------------ public API

    def add_callback(self, callback: TrainerCallback) -> None:
        self.callbacks.add(callback)

    def register_evaluator(self, evaluator: Any) -> None:
        """Run ``evaluator`` at every validation (see ``verl.evaluators``); refused at once if validation cannot
        compute what it needs."""
        self.validator.register(evaluator)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step: a final checkpoint is written and ``fit`` returns normally."""
        self.stop_reason = self.stop_reason or reason

    def request_skip_update(self, reason: str) -> None:
        """Skip this step's critic and actor updates (call from ``on_rollout_end``; the next step is unaffected)."""
        self.skip_update_reason = self.skip_update_reason or reason

    run_dir = property(lambda self: self.run.dir)
    logger = property(lambda self: self.run.logger)
    trackers = property(lambda self: self.run.trackers)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train to ``trainer.total_steps`` (or a requested stop); returns the last step's logged metrics."""
        cfg = self.config
        validating = cfg.trainer.test_freq > 0
        if validating:
            self.validator.evaluators()  # an unknown evaluator fails now, before the run dir or any step
        self._start_run()
        self.run.clock.start()  # after the models and a resumed checkpoint are loaded, as MLPerf times it
        metrics: dict[str, float] = {}
        try:
            with self.run.bound():  # log.info() from callbacks and rewards: this run's rows
                self.callbacks.on_train_start(self)
                if cfg.trainer.one_step_off_policy and self.global_step < cfg.trainer.total_steps:
                    # Start the rollout worker and its first batch now, so both overlap the first validation.
                    self.rollout_stage.start(self.global_step + 1, self.policy_version)
                if validating and cfg.trainer.val_before_train and self.global_step == 0:
                    self.validate()
                while self.global_step < cfg.trainer.total_steps and self.stop_reason is None:
                    self.global_step += 1
                    metrics = self._fit_step(self.global_step, validating)
                reason = self.stop_reason or "completed"
                self.logger.event("train", step=self.global_step, status="finished", reason=reason)
                self.callbacks.on_train_end(self, reason)
        finally:
            self.rollout_stage.stop()  # a batch generated ahead of a stop is dropped; resume regenerates it
            self.run.close()
        return metrics

    def _fit_step(self, step: int, validating: bool) -> dict[str, float]:
        """A step of ``fit``: train, log, callbacks, then validation and a checkpoint when due."""
        cfg = self.config
        self.logger.set_step(step)
        measured = self._profiled_step(step) if step in cfg.trainer.profile_steps else self.train_step(step)
        self.run.clock.mark_update(step)
        metrics = self.logger.log_step(step, measured)  # JSONL rows + trackers, with log.info() fields
        self.callbacks.on_log(metrics, step=step)
        self._check_target(step, metrics)
        self.callbacks.on_step_end(self, step, metrics)  # health rules may request a stop here
        final = step == cfg.trainer.total_steps or self.stop_reason is not None
        if validating and (step % cfg.trainer.test_freq == 0 or final):
            metrics.update(self.validate())
            final = final or self.stop_reason is not None  # e.g. the target, reached in validation
        if final or (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0):
            self.checkpoint(step, metrics)
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
        with self.timer("total"):
            last = step >= cfg.trainer.total_steps or self.stop_reason is not None
            batch, dropped, versions, groups = self.rollout_stage.batch(step, self.policy_version, self.logger, last)
            batch, mismatch = self._log_prob_stages(batch)
            with self.timer("adv"):
                batch, kl_metrics = kl_in_reward(batch, cfg.algorithm, self.kl_ctrl)
                batch = compute_advantages(batch, cfg.algorithm, self.adv_fn)
            rollout = {**rollout_metrics(batch, cfg.data.max_response_length, self.tokenizer.pad_token_id), **versions}
            # Health rules with action skip_step decide here, on the rollout alone (e.g. a batch with no signal).
            self.skip_update_reason = None
            self.callbacks.on_rollout_end(self, step, {f"rollout/{k}": v for k, v in rollout.items()})
            batch = apply_update_mask(batch)
            critic_metrics, actor_metrics = self._update(step, batch) if self.skip_update_reason is None else ({}, {})
        log_samples(self.logger, self.trackers, step, batch, cfg.trainer.num_samples_to_log, cfg.rollout.n)
        kl_coef = cfg.actor.kl_loss_coef if cfg.actor.use_kl_loss else self.kl_ctrl.value
        ppo = {"kl_coef": kl_coef, "value_loss": critic_metrics.get("value_loss"),
               "update_skipped": float(self.skip_update_reason is not None), **kl_metrics}
        train = {"epoch": self.sampler.epoch, "progress": step / cfg.trainer.total_steps}
        timings = self.timer.pop()
        self.logger.debug("timing", stages=timings, responses=len(batch), device=str(self.device))
        metrics = step_metrics(batch, rollout, actor_metrics, critic_metrics, ppo, timings, train,
                               self.monitor.sample())
        # Mismatch and correction metrics carry their own scopes (verl's and TRL's names): measured here or by the
        # actor's forwards.
        metrics.update(log.scoped("batch", groups))
        metrics.update(mismatch)
        metrics.update({k: v for k, v in actor_metrics.items() if k.startswith(MISMATCH_SCOPES)})
        if cfg.reward.model.path or cfg.reward.model.url:
            metrics.update(log.scoped("reward", dropped.metrics()))
        return metrics

    def _log_prob_stages(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """Old log-probs (a trainer forward where the update is off-policy and the rollout's are not the anchor),
        rollout correction, reference log-probs and critic values: each only where the step needs it."""
        cfg = self.config
        trainer_old = (needs_old_log_probs(cfg, len(batch)) and batch.anchor is Anchor.CURRENT
                       and not cfg.algorithm.rollout_correction.bypass_mode)
        if trainer_old:
            with self.timer("old_log_prob"):
                batch.anchor, batch.old_log_probs = Anchor.TRAINER, self.roles.compute_old_log_prob(batch.to_proto())
        batch, mismatch = correct_rollout(batch, cfg.algorithm.rollout_correction, cfg.rollout.name, trainer_old)
        if cfg.use_reference and batch.ref_log_prob is None:  # the rollout worker may have computed it
            with self.timer("ref"):
                batch.ref_log_prob = self.roles.compute_ref_log_prob(batch.to_proto())
        if cfg.use_critic:
            with self.timer("values"):
                batch.values = self.roles.compute_values(batch.to_proto())
        return batch, mismatch

    def _update(self, step: int, batch: TrainBatch) -> tuple[dict[str, float], dict[str, float]]:
        """The critic's update, then the actor's (after the critic's warm-up); their metrics."""
        cfg = self.config
        critic: dict[str, float] = {}
        actor: dict[str, float] = {}
        wire = batch.to_proto()
        if cfg.use_critic:
            with self.timer("update_critic"):
                prompts = cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
                critic = self.roles.update_critic(wire, prompts * cfg.rollout.n)
        if step > cfg.critic.warmup_steps or not cfg.use_critic:
            with self.timer("update_actor"):
                actor = self.roles.update_actor(wire, cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
            self.policy_version += 1
        return critic, actor

    # ------------------------------------------------------------------ validation and checkpoints

    def validate(self) -> dict[str, float]:
        """Generate on the validation split (greedy by default); log ``eval/*`` and sample rows."""
        step = self.global_step
        start = time.perf_counter()
        metrics, samples = self.validator.run(self.roles.validation_engine(), self.rollout_stage.val_sampling(),
                                              self.roles.compute_kl_terms, step, getattr(self.roles, "model", None))
        metrics["seconds"] = time.perf_counter() - start
        for row in samples:
            self.logger.event("sample", step=step, split="val", **row)
        for tracker in self.trackers:
            tracker.log_samples([{**row, "split": "val"} for row in samples], step)
        # Validation runs after the step's rows are written, so this writes the eval row alone.
        logged = self.logger.log_step(step, log.scoped("eval", metrics))
        self.run.clock.add_validation(time.perf_counter() - start)
        self._check_target(step, logged)
        self.callbacks.on_evaluate(self, step, logged)
        return logged

    def _check_target(self, step: int, metrics: dict[str, float]) -> None:
        """The run logs the time-to-target record the first time ``trainer.target`` is reached; stop, if asked."""
        record = self.run.reach_target(step, metrics)
        if record is not None and self.config.trainer.stop_at_target:
            self.request_stop(f"target {record['target']} reached at step {step}")

    def checkpoint(self, step: int, metrics: dict[str, float]) -> Path:
        """Write ``step``'s checkpoint now (the roles' parts and ``trainer_state``); ``on_save`` callbacks follow."""
        with self.timer("save"):
            path = self.run.checkpoint(step, self.roles.save, self.trainer_state(), metrics)
        self.callbacks.on_save(self, step, path)
        return path

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint saves beside the roles' parts: the step, sampler, KL controller, RNGs, clocks."""
        state = {"global_step": self.global_step, "sampler": self.rollout_stage.sampler_state(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "rng": rng_state(), "policy_version": self.policy_version}
        return {**state, **self.run.clock_state()}

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore the roles and ``trainer_state`` from the checkpoint at ``path``."""
        state = load_trainer_state(path)
        self.roles.load(path)
        self.global_step = int(state["global_step"])
        self.policy_version = int(state.get("policy_version", self.global_step))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        self.run.load_clock_state(state)
        return state

    # ------------------------------------------------------------------ run setup

    def _start_run(self) -> None:
        """Check what can fail without a run, then make (or reopen) the run directory and start logging."""
        cfg = self.config
        check_trackers(cfg.trainer.logger, cfg)  # unknown tracker, missing package, no wandb login: no run dir yet
        resume_from, changes = self.run.resume_point()
        with self.run.opening(resume_from):
            # The traffic behind a run trained on `verl data from-records` exports, kept with the run (and copied
            # into its exports), so a shipped model traces back to the records it learned from.
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
            log_contamination(self.logger, self.validator.contamination, self.global_step)
            self.logger.debug("placement", device=str(self.device), executor=cfg.trainer.executor,
                              threads=torch.get_num_threads(), reference=cfg.use_reference, critic=cfg.use_critic)


def needs_old_log_probs(cfg: VerlConfig, rows: int) -> bool:
    """Whether the update of a batch of ``rows`` samples needs the trainer's old log-probs: several epochs or
    mini-batches (counted on the batch: a gateway episode may give several samples), a KL in the reward, or
    decoupled rollout correction."""
    off_policy = (cfg.actor.ppo_epochs > 1 or cfg.data.train_batch_size > cfg.actor.ppo_mini_batch_size
                  or rows > cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
    return off_policy or cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollout_correction.decoupled


def log_contamination(logger: log.RunLogger, info: dict | None, step: int) -> None:
    """The validation prompts' overlap with the training data, as a run event (status), not a curve: its counts
    never reach the trackers as metrics."""
    if info is None:
        return
    note = (f"{info['overlapping']} of {info['checked']} validation prompts overlap the training data "
            f"({info['exact']} exactly, {info['ngram']} by a shared {info['n']}-gram): eval/clean/* scores the "
            "rest; `verl data decontaminate` removes them, data.contamination=strict refuses"
            ) if info["overlapping"] else None
    logger.event("contamination", level="WARNING" if note else "INFO", step=step, status="checked", split="val",
                 **info, **({"message": note} if note else {}))
