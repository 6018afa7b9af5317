"""Samples without a reward (a remote reward model that timed out or answered garbage after its retries): masked
out of the loss and counted, never scored 0.

A group estimator (GRPO, RLOO, ...: ``EstimatorFacts.needs_groups``) compares a sample with the other answers to the
same prompt; a group with a missing member would be normalised over the ones left, a different estimator from the
one configured, so the **whole group** is dropped. Other estimators drop only the sample. Dropped samples keep their
rows (the batch shape the update expects) with a zero ``response_mask`` and a zero score, so they add nothing to
any loss, advantage normalisation or KL term. Past ``reward.model.max_failed_share`` of the step's samples the step
stops with a one-line error instead: training on what is left of a batch that large would be training on a
different distribution, silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl.errors import VerlError


@dataclass
class Dropped:
    """``failed``: samples without a reward; ``dropped``: samples masked (their group mates included)."""

    failed: int
    dropped: int
    total: int

    def metrics(self) -> dict[str, float]:
        return {"failed": float(self.failed), "dropped": float(self.dropped),
                "failed_share": self.failed / max(self.total, 1)}

    def merge(self, other: Dropped) -> None:
        """Add another generation batch's counts (a step of several: algorithm.filter_groups)."""
        self.failed += other.failed
        self.dropped += other.dropped
        self.total += other.total


def mask_missing_rewards(scores: torch.Tensor, response_mask: torch.Tensor, uid: np.ndarray, whole_groups: bool,
                         max_failed_share: float, source: str = "the reward model") -> tuple[torch.Tensor,
                                                                                               torch.Tensor, Dropped]:
    """``scores`` (batch, len) token-level scores with NaN rows (missing rewards), ``response_mask`` (batch, len),
    ``uid`` (batch,) group ids. Returns the scores with dropped rows zeroed, the mask with dropped rows zeroed, and
    the counts; raises ``VerlError`` past ``max_failed_share``."""
    failed = torch.isnan(scores).any(-1)
    total = int(scores.shape[0])
    if not bool(failed.any()):
        return scores, response_mask, Dropped(0, 0, total)
    share = float(failed.float().mean())
    if share > max_failed_share:
        raise VerlError(f"{source}: {int(failed.sum())} of {total} samples ({share:.0%}) got no reward after "
                        f"retries, more than reward.model.max_failed_share={max_failed_share:g}; the step stops "
                        "(see reward/failed in the log; check the reward model's service or raise its timeout)")
    drop = failed.clone()
    if whole_groups:
        bad_groups = {uid[i] for i in np.flatnonzero(failed.numpy())}
        drop = torch.as_tensor([u in bad_groups for u in uid], dtype=torch.bool)
    scores = torch.where(drop.unsqueeze(-1), torch.zeros_like(scores), scores)
    response_mask = response_mask * (~drop).unsqueeze(-1).to(response_mask.dtype)
    return scores, response_mask, Dropped(int(failed.sum()), int(drop.sum()), total)
