"""The SmolLM2 single-turn config the benchmarks run, and the plain-GRPO variant most of them were measured with.

``configs/grpo_smollm2.yaml`` gained DAPO's dynamic sampling and clip-higher on 2026-11-28 (issue 45's study).
Dynamic sampling generates a varying number of batches per step and cannot run with one-step off-policy, so the
step-time, overlap and reward-model benchmarks pin ``PLAIN_GRPO``: a fixed 4 x 4 batch per step, as recorded in
benchmarks/RESULTS.md before that date."""

from __future__ import annotations

from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_smollm2.yaml"
PLAIN_GRPO = ["algorithm.filter_groups.enable=false", "actor.clip_ratio_high=0.2"]
