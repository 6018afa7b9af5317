"""One-step off-policy training (trainer.one_step_off_policy): the rollout process, its behaviour log-probs, the
version bookkeeping, the ratio's denominator, resume, and clear errors. Real processes, real tiny models."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.test_trainer import log_rows, tiny_config
from tests.trainer_utils import fit_and_shutdown
from verl.config import build_config
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.errors import VerlError
from verl.models.loader import load_causal_lm, load_tokenizer
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.trainer.checkpoint import list_checkpoints, load_trainer_state
from verl.trainer.local import LocalPPOTrainer
from verl.trainer.overlap import LocalRolloutProcess, split_cores
from verl.workers.forward import response_log_probs

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "prompts")


def async_config(tmp_path, name="a", **trainer):
    cfg = tiny_config(tmp_path, trainer={"one_step_off_policy": True, **trainer})
    cfg["trainer"]["experiment_name"] = name
    return cfg


class RecordingWorker:
    """Wraps the real rollout worker: keeps each submission's weights and version and each finished batch."""

    def __init__(self, inner, policy):
        self.inner, self.policy = inner, policy
        self.submitted: list[tuple[int, dict[str, torch.Tensor], object]] = []  # (version, weights, prompts)
        self.results = []

    pending = property(lambda self: self.inner.pending)

    def submit(self, prompts, params, weights_version):
        weights = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        self.submitted.append((weights_version, weights, prompts, params))
        self.inner.submit(prompts, params, weights_version)

    def result(self):
        done = self.inner.result()
        self.results.append(done)
        return done

    def shutdown(self):
        self.inner.shutdown()


def recording_trainer(config) -> tuple[LocalPPOTrainer, list[RecordingWorker]]:
    trainer = LocalPPOTrainer(config, quiet=True)
    made: list[RecordingWorker] = []
    factory = trainer.rollout_stage.worker_factory

    def wrapped():
        made.append(RecordingWorker(factory(), trainer.model))
        return made[-1]

    trainer.rollout_stage.worker_factory = wrapped
    return trainer, made


def log_probs_under(weights, template, batch, temperature) -> torch.Tensor:
    model = copy.deepcopy(template)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        out, _ = response_log_probs(model, {k: batch.batch[k] for k in MODEL_KEYS}, temperature)
    return out * batch.batch["response_mask"]


# ---------------------------------------------------------------------------------------------- behaviour log-probs


def test_sampler_log_probs_equal_the_actor_log_probs_and_leave_tokens_unchanged():
    tokenizer = load_tokenizer("builtin:tiny-arith")
    model = load_causal_lm("builtin:tiny-arith")
    prompts = RLHFDataset(["builtin:arithmetic/val"], tokenizer).collate(list(range(8)))
    engine = HFRollout(model, tokenizer)
    for params in (SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=3),
                   SamplingParams(n=2, temperature=1.0, top_k=5, max_new_tokens=12, seed=4),
                   SamplingParams(n=2, temperature=0.0, max_new_tokens=12)):
        plain = engine.generate(prompts, params)
        with_lp = engine.generate(prompts, SamplingParams(**{**params.__dict__, "logprobs": True}))
        assert "rollout_log_probs" not in plain.batch
        assert torch.equal(plain.batch["responses"], with_lp.batch["responses"])  # greedy/sampled tokens unchanged
        behaviour = with_lp.batch["rollout_log_probs"]
        mask = with_lp.batch["response_mask"]
        assert behaviour.shape == mask.shape and bool((behaviour[mask == 0] == 0).all())
        assert bool((behaviour[mask == 1] < 0).all() or params.greedy)
        temperature = params.temperature or 1.0
        scored, _ = response_log_probs(model, {k: with_lp.batch[k] for k in MODEL_KEYS}, temperature)
        torch.testing.assert_close(behaviour, scored * mask, atol=2e-5, rtol=1e-5)


def test_split_cores_gives_each_process_its_own():
    assert split_cores([0, 1]) == ([0], [1])
    assert split_cores([0, 1, 2]) == ([0, 1], [2])
    assert split_cores([3]) == ([3], [3])


# ---------------------------------------------------------------------------------------------- the trainer


def test_versions_weights_and_ratio_denominator_of_each_batch(tmp_path, tiny_base_dir):
    """Batch t is generated with the weights after t-2 updates (t-1 at step 1), its old_log_probs are those
    weights' log-probs (the behaviour policy), and they are not the current policy's."""
    config = async_config(tmp_path, total_steps=3)
    trainer, made = recording_trainer(config)
    fit_and_shutdown(trainer)
    worker = made[0]
    rollout = log_rows(trainer, "rollout")
    assert [r["policy_version"] for r in rollout] == [0, 0, 1]
    assert [r["staleness"] for r in rollout] == [0, 1, 1]
    timing = log_rows(trainer, "timing")
    assert all(r["wait_rollout"] >= 0 and r["gen"] > 0 for r in timing)
    assert [v for v, *_ in worker.submitted] == [0, 0, 1]  # steps 1, 2, 3; no batch generated past the last step
    assert len(worker.results) == 3
    temperature = trainer.config.rollout.temperature
    template = trainer.model
    for step in (2, 3):
        version, weights, prompts, params = worker.submitted[step - 1]
        batch = worker.results[step - 1].batch
        old = batch.batch["rollout_log_probs"] if "rollout_log_probs" in batch.batch else batch.batch["old_log_probs"]
        # The behaviour policy: the weights as they were when this batch was submitted.
        torch.testing.assert_close(old, log_probs_under(weights, template, batch, temperature), atol=5e-5, rtol=1e-5)
        # ... and the batch is exactly what those weights sample for these prompts and this step's seed.
        model = copy.deepcopy(template)
        model.load_state_dict(weights)
        again = HFRollout(model, trainer.tokenizer).generate(prompts, params)
        assert torch.equal(again.batch["responses"], batch.batch["responses"])
    # The update of step 2 ran with weights v1 (submitted at step 3); its ratio pi_v1 / pi_v0 is not 1.
    v1 = worker.submitted[2][1]
    batch2 = worker.results[1].batch
    current = log_probs_under(v1, template, batch2, temperature)
    assert float((current - batch2.batch["rollout_log_probs"]).abs().max()) > 1e-3  # the ratio's anchor
    ppo = log_rows(trainer, "ppo")
    assert ppo[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: behaviour == current policy
    assert ppo[1]["approx_kl"] != 0.0


def test_first_step_equals_the_synchronous_step(tmp_path):
    sync = LocalPPOTrainer(tiny_config(tmp_path), quiet=True)
    fit_and_shutdown(sync)
    overlapped = LocalPPOTrainer(async_config(tmp_path, total_steps=1), quiet=True)
    fit_and_shutdown(overlapped)
    a, b = log_rows(sync, "rollout")[0], log_rows(overlapped, "rollout")[0]
    assert a["reward_mean"] == b["reward_mean"] and a["response_length_mean"] == b["response_length_mean"]
    pa, pb = log_rows(sync, "ppo")[0], log_rows(overlapped, "ppo")[0]
    assert pb["policy_loss"] == pytest.approx(pa["policy_loss"], abs=1e-5)
    assert pb["grad_norm"] == pytest.approx(pa["grad_norm"], rel=1e-3, abs=1e-5)
    for p, q in zip(sync.model.parameters(), overlapped.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)


def test_a_checkpoint_saves_the_sampler_from_before_the_batch_in_flight(tmp_path):
    """At a checkpoint the next batch is already drawn and generating; the checkpoint keeps the sampler from before
    that draw, so a resume regenerates it (with the checkpoint's weights) instead of skipping its prompts."""
    full = LocalPPOTrainer(async_config(tmp_path, "full", total_steps=4, save_freq=2), quiet=True)
    fit_and_shutdown(full)
    step2 = dict(list_checkpoints(full.run_dir))[2]
    saved = load_trainer_state(step2)
    cfg = full.config
    two_draws = PromptSampler(len(full.train_dataset), cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
    two_draws.next_batch(), two_draws.next_batch()
    assert saved["sampler"] == two_draws.state_dict()  # step 3's draw, in flight at the save, is not in it
    assert saved["policy_version"] == 2
    # Resume from that checkpoint to 4 steps: steps 3 and 4 train on the uninterrupted run's prompts.
    resumed = LocalPPOTrainer(async_config(tmp_path, "resumed", total_steps=4, resume=str(step2)), quiet=True)
    fit_and_shutdown(resumed)
    prompts = {r["step"]: r["prompt"] for r in log_rows(full, "sample") if r.get("split") == "train"}
    prompts_resumed = {r["step"]: r["prompt"] for r in log_rows(resumed, "sample") if r.get("split") == "train"}
    assert sorted(prompts_resumed) == [3, 4]
    assert prompts_resumed[3] == prompts[3] and prompts_resumed[4] == prompts[4]
    staleness = {r["step"]: r["staleness"] for r in log_rows(resumed, "rollout")}
    assert staleness[3] == 0 and staleness[4] == 1  # regenerated with the checkpoint's weights, then one behind


# ---------------------------------------------------------------------------------------------- failures


def test_a_dead_rollout_process_is_named(tmp_path):
    config = build_config(async_config(tmp_path), "test")
    trainer = LocalPPOTrainer(config, quiet=True)
    worker = LocalRolloutProcess(trainer.config, trainer.model)
    try:
        prompts = trainer.train_dataset.collate([0, 1, 2, 3])
        os.kill(worker.process.pid, 9)
        worker.process.join(timeout=10)
        with pytest.raises(VerlError, match="rollout process .* died"):
            worker.submit(prompts, trainer.rollout_stage.train_sampling(1), 0)
            worker.result()
    finally:
        worker.shutdown()
        trainer.shutdown()


@pytest.mark.parametrize("section,value,message", [
    ("actor", {"strategy": "fsdp"}, "actor.strategy=fsdp"),
    ("rollout", {"name": "vllm"}, "rollout.name=vllm"),
])
def test_unsupported_combinations_fail_at_config_time(tmp_path, section, value, message):
    cfg = async_config(tmp_path)
    cfg.setdefault(section, {}).update(value)
    with pytest.raises(Exception, match=message):
        build_config(cfg, "test")


def test_split_mismatch_separates_the_engines_numerics_from_the_policy_lag(tmp_path):
    """trainer.split_mismatch: the rollout worker's extra forward at the behaviour weights. At step 1 nothing has
    been updated (staleness 0): the lag is 0 and the total is the engine's alone; at step 2 the batch was sampled
    before step 1's update, so the lag appears, and the total is the lag plus the engine's (fp32: ~0) part."""
    trainer = LocalPPOTrainer(build_config(async_config(tmp_path, total_steps=2, split_mismatch=True)), quiet=True)
    fit_and_shutdown(trainer)
    rows = {r["step"]: r for r in log_rows(trainer, "rollout_corr")}
    assert abs(rows[1]["lag_k3_kl"]) < 1e-9 and abs(rows[1]["engine_k3_kl"]) < 1e-6
    assert rows[2]["lag_k3_kl"] > 1e-6  # step 1's update moved the policy
    assert abs(rows[2]["engine_k3_kl"]) < 1e-6  # the same numerics on both sides
    assert rows[2]["k3_kl"] == pytest.approx(rows[2]["lag_k3_kl"], rel=1e-3, abs=1e-8)


def test_split_mismatch_needs_the_overlap(tmp_path):
    with pytest.raises(VerlError, match="trainer.split_mismatch splits a one-step off-policy run"):
        build_config(tiny_config(tmp_path, trainer={"split_mismatch": True}))
