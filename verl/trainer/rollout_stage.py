"""A training step's batch: its prompts drawn, generated and scored (the first stages of ``PPOTrainer.train_step``).

Synchronous: sample prompts and generate now (``timing/gen``). One-step off-policy (``trainer.one_step_off_policy``,
``verl.trainer.overlap``): take the batch the rollout worker generated while the last step updated
(``timing/wait_rollout``), hand it the next step's prompts with the current weights, and anchor the ratio on its
behaviour log-probs. Then the reward, with samples that got none masked; with ``algorithm.filter_groups`` (DAPO's
dynamic sampling) further generation batches until enough groups vary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.algos.advantages import estimator_facts
from verl.batch import Anchor, TrainBatch, concat
from verl.config import VerlConfig
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.protocol import DataProto
from verl.rollout.base import SamplingParams
from verl.trainer.missing_rewards import Dropped
from verl.trainer.stages import filter_values, mask_missing, varied_group_rows
from verl.trainer.step_metrics import batch_groups
from verl.utils.timing import StageTimer

GROUP_ID_STRIDE = 1_000_000_007  # filter_groups: a step's later generation batches get group ids of their own


class RolloutStage:
    """The prompts, the rollout (and its worker, one step off-policy) and the reward of each step."""

    def __init__(self, config: VerlConfig, roles: Any, dataset: RLHFDataset, sampler: PromptSampler,
                 pad_token_id: int, timer: StageTimer, worker_factory: Any = None):
        self.config, self.roles, self.dataset, self.sampler = config, roles, dataset, sampler
        self.pad_token_id, self.timer = pad_token_id, timer
        # trainer.one_step_off_policy: a verl.trainer.overlap.RolloutWorker, started by this factory at the first step
        self.worker_factory = worker_factory
        self.worker: Any = None
        self._sampler_state_before_prefetch: dict[str, Any] | None = None

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

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's state a checkpoint saves: from before the draw of a batch still in flight, so a resume
        regenerates it."""
        return self._sampler_state_before_prefetch if self.pending else self.sampler.state_dict()

    @property
    def pending(self) -> bool:
        return self.worker is not None and self.worker.pending

    def start(self, step: int, policy_version: int) -> None:
        """One step off-policy: start the worker and ``step``'s batch now (it overlaps the first validation)."""
        self.worker = self.worker_factory()
        self._submit(step, policy_version)

    def stop(self) -> None:
        """Stop the rollout worker; a batch generated ahead of a stop is dropped (resume regenerates it)."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    # ------------------------------------------------------------------ a step's batch

    def batch(self, step: int, policy_version: int, logger: Any, last: bool
              ) -> tuple[TrainBatch, Dropped, dict[str, float], dict[str, float]]:
        """``step``'s scored batch (``last``: no further step will want a prefetched batch). Returns it, the masked
        rewards' counts, the rollout's version metrics and the ``batch/*`` metrics of its groups."""
        batch, dropped, versions = self._generate_and_score(step, policy_version, last)
        # Of the step's (first) generation batch: what the policy solves, before any filter drops groups.
        groups = batch_groups(batch)
        if self.config.algorithm.filter_groups.enable:
            batch, filtered = self._fill_with_varied_groups(step, batch, dropped, policy_version, logger, last)
            groups.update(filtered)
        return batch, dropped, versions, groups

    def _generate_and_score(self, step: int, policy_version: int, last: bool, generation: int = 0
                            ) -> tuple[TrainBatch, Dropped, dict[str, float]]:
        """Generate this step's (``generation``-th) batch and score it, rewards that could not be obtained masked."""
        cfg = self.config
        prompts, batch, versions = self._rollout(step, policy_version, last)
        # The group id: responses to one prompt. Later generation batches of a step (filter_groups) get ids of
        # their own, so a prompt drawn again does not merge two groups.
        if generation:
            batch.group = batch.group.astype(np.int64) + generation * GROUP_ID_STRIDE
        if estimator_facts(cfg.algorithm.adv_estimator).needs_greedy_baseline:
            with self.timer("gen_baseline"):
                batch.reward_baselines = self._greedy_baseline(prompts).repeat_interleave(cfg.rollout.n)
        with self.timer("reward"):
            batch.token_level_scores, batch.reward_extras, batch.texts = self.roles.compute_reward(batch.to_proto())
            batch, dropped = mask_missing(batch, cfg.reward, cfg.algorithm.adv_estimator)
        return batch, dropped, versions

    def _rollout(self, step: int, policy_version: int, last: bool) -> tuple[DataProto, TrainBatch, dict[str, float]]:
        """This step's prompts, their rollout, and its version metrics (the module docstring)."""
        if not self.config.trainer.one_step_off_policy:
            prompts = self.dataset.collate(self.sampler.next_batch())
            with self.timer("gen"):
                generated = self.roles.generate(prompts, self.train_sampling(step))
            return prompts, TrainBatch.from_proto(generated, policy_version), {}
        if self.worker is None:  # train_step called outside fit()
            self.worker = self.worker_factory()
        if not self.worker.pending:
            self._submit(step, policy_version)
        with self.timer("wait_rollout"):
            done = self.worker.result()
        if not last:
            self._submit(step + 1, policy_version)  # runs while this step updates
        for stage, seconds in done.seconds.items():  # the rollout worker's own stage times, concurrent with ours
            self.timer.seconds[stage] = self.timer.seconds.get(stage, 0.0) + seconds
        batch = TrainBatch.from_proto(done.batch, done.policy_version)
        # The behaviour's log-probs are the update's anchor (bypass, as verl) unless decoupled mode asks for pi_old.
        if not self.config.algorithm.rollout_correction.decoupled:
            batch.anchor, batch.old_log_probs = Anchor.ROLLOUT, batch.rollout_log_probs
        return done.prompts, batch, {"policy_version": float(done.policy_version),
                                     "staleness": float(policy_version - done.policy_version)}

    def _submit(self, step: int, policy_version: int) -> None:
        """Draw ``step``'s prompts and start generating them with the current weights."""
        self._sampler_state_before_prefetch = self.sampler.state_dict()
        prompts = self.dataset.collate(self.sampler.next_batch())
        self.worker.submit(prompts, self.train_sampling(step), policy_version)

    def _greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        """ReMax baseline: the reward of each prompt's greedy response, ``(batch,)``."""
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.config.data.max_response_length)
        greedy = self.roles.generate(prompts, params)
        scores, _, _ = self.roles.compute_reward(greedy)
        return scores.sum(-1)

    def _fill_with_varied_groups(self, step: int, batch: TrainBatch, dropped: Dropped, policy_version: int,
                                 logger: Any, last: bool) -> tuple[TrainBatch, dict[str, float]]:
        """``algorithm.filter_groups`` (DAPO's dynamic sampling, as verl's recipe does it): keep the groups whose
        samples differ in the metric, generate further batches until ``data.train_batch_size`` groups are kept,
        then cut to exactly that many. When ``max_num_gen_batches`` is spent first, train on the groups kept (all
        of the last batch if none were) and log a WARNING row; verl raises there, which ends a long run over one
        hard batch. Returns the kept batch and ``batch/*`` metrics."""
        cfg = self.config.algorithm.filter_groups
        n, wanted = self.config.rollout.n, self.config.data.train_batch_size
        parts: list[TrainBatch] = []
        kept_groups = generated_groups = generation = 0
        while True:
            values = filter_values(batch.reward_extras, batch.token_level_scores, cfg.metric)
            keep = varied_group_rows(batch.group, values)
            generated_groups += len(batch) // n
            kept_groups += len(keep) // n
            if len(keep):
                parts.append(batch.index(keep))
            generation += 1
            if kept_groups >= wanted:
                break
            if cfg.max_num_gen_batches and generation >= cfg.max_num_gen_batches:
                message = (f"algorithm.filter_groups: {kept_groups} of {wanted} groups vary in "
                           f"{cfg.metric or 'acc'} after {generation} generation batches (max_num_gen_batches); "
                           "the step trains on " + ("them" if parts else "the last batch, which carries no signal")
                           + ": the data may be too easy or too hard for the policy")
                logger.event("filter_groups", level="WARNING", step=step, status="budget_spent",
                             kept_groups=kept_groups, generation_batches=generation, message=message)
                if not parts:
                    parts.append(batch)
                break
            batch, more_dropped, _ = self._generate_and_score(step, policy_version, last, generation)
            dropped.merge(more_dropped)
        batch = concat(parts, self.pad_token_id)
        if len(batch) > wanted * n:  # whole groups: rows of a group are adjacent
            batch = batch.index(np.arange(wanted * n))
        return batch, {"num_gen_batches": float(generation), "kept_group_share": kept_groups / max(generated_groups, 1)}
