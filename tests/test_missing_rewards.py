"""Samples without a reward are masked, never scored 0: by hand, on a batch of two groups of two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.errors import VerlError
from verl.trainer.missing_rewards import mask_missing_rewards

NAN = float("nan")


def batch():
    # 4 samples, 3 response tokens; the score sits at each response's last token; sample 2's reward is missing.
    scores = torch.tensor([[0, 0, 1.0], [0, 0.5, 0], [0, 0, NAN], [0, 0, 0.25]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    return scores, mask, np.array(["p0", "p0", "p1", "p1"], dtype=object)


def test_a_group_estimator_drops_the_whole_group():
    scores, mask, uid = batch()
    out, new_mask, dropped = mask_missing_rewards(scores, mask, uid, whole_groups=True, max_failed_share=0.5)
    assert out.tolist() == [[0, 0, 1.0], [0, 0.5, 0], [0, 0, 0], [0, 0, 0]]
    assert new_mask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert dropped.metrics() == {"failed": 1.0, "dropped": 2.0, "failed_share": 0.25}


def test_other_estimators_drop_the_sample_only():
    scores, mask, uid = batch()
    out, new_mask, dropped = mask_missing_rewards(scores, mask, uid, whole_groups=False, max_failed_share=0.5)
    assert out[3].tolist() == [0, 0, 0.25] and new_mask[3].tolist() == [1, 1, 1]
    assert new_mask[2].tolist() == [0, 0, 0] and not torch.isnan(out).any()
    assert (dropped.failed, dropped.dropped) == (1, 1)


def test_nothing_missing_changes_nothing():
    scores, mask, uid = batch()
    scores[2, 2] = 0.0
    out, new_mask, dropped = mask_missing_rewards(scores, mask, uid, whole_groups=True, max_failed_share=0.0)
    assert out is scores and new_mask is mask and dropped.dropped == 0


def test_past_the_threshold_the_step_stops_with_one_line():
    scores, mask, uid = batch()
    with pytest.raises(VerlError, match=r"1 of 4 samples \(25%\) got no reward.*max_failed_share=0.2") as info:
        mask_missing_rewards(scores, mask, uid, whole_groups=True, max_failed_share=0.2, source="reward model URL")
    assert "\n" not in str(info.value) and str(info.value).startswith("reward model URL")
