"""The rollout engine's log-probs against the trainer's forward on the same tokens (``verl eval -e mismatch``).

Before training on an engine — vLLM, our CPU decode kernels, a bf16 autocast — check how far its log-probs of the
tokens it drew are from what the trainer computes for them: the same numbers the trainer logs every step
(``rollout_corr/*``, verl/algos/rollout_correction.py), here with confidence intervals over prompts. Token-level
means weight each sample by its tokens (as the trainer's do); per-sequence ones weight samples alike.

- ``mismatch_kl``: mean of log p_rollout - log p_trainer (KL(rollout || trainer), can be < 0);
- ``mismatch_k3_kl``: mean of r - log r - 1, r = p_trainer / p_rollout (>= 0);
- ``mismatch_logp_abs_diff``: mean |log p_trainer - log p_rollout| (TRL's sampling_logp_difference/mean);
- ``mismatch_probs_diff``: mean |p_trainer - p_rollout| (verl's training/rollout_probs_diff_mean);
- ``mismatch_log_ppl_abs_diff``: per sequence, |log perplexity under the rollout - under the trainer|.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.algos.masked import masked_mean, masked_sum
from verl.errors import VerlError
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator

TOKEN_TERMS = ("kl", "k3_kl", "logp_abs_diff", "probs_diff")


def token_terms(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token mismatch terms ``(N, L)`` of the trainer's and the engine's log-probs of the drawn tokens."""
    log_ratio = trainer.double() - rollout.double()
    return {"kl": -log_ratio, "k3_kl": torch.exp(log_ratio) - log_ratio - 1.0, "logp_abs_diff": log_ratio.abs(),
            "probs_diff": (torch.exp(trainer.double()) - torch.exp(rollout.double())).abs()}


class Mismatch(Evaluator):
    name = "mismatch"
    needs = frozenset({"generations", "engine_logprobs"})
    directions = {f"mismatch_{t}": False for t in (*TOKEN_TERMS, "log_ppl_abs_diff")}

    def __init__(self) -> None:
        self.options = {}

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        terms = batch.mismatch_terms
        if not terms:
            raise VerlError("the mismatch evaluator got no engine log-probs: the engine gave none for these samples")
        mask = terms["mask"].double()
        per_token = token_terms(terms["trainer"], terms["rollout"])
        columns = {f"mismatch_{name}_sum": masked_sum(value, mask, dim=-1).numpy() for name, value in per_token.items()}
        columns["mismatch_tokens"] = mask.sum(-1).numpy()
        log_ppl_diff = masked_mean(terms["rollout"].double(), mask, dim=-1) - masked_mean(terms["trainer"].double(),
                                                                                          mask, dim=-1)
        columns["mismatch_log_ppl_abs_diff"] = log_ppl_diff.abs().numpy()
        result = EvalResult(per_sample=dict(columns))
        result.metrics["mismatch_log_ppl_abs_diff"] = self.mean("mismatch_log_ppl_abs_diff",
                                                                columns["mismatch_log_ppl_abs_diff"], batch)
        result.metrics.update(self.corpus(batch, columns))
        result.notes.append(f"mismatch: the engine's log-probs against the trainer's forward "
                            f"({terms['trainer_dtype']}) on the same {int(mask.sum())} tokens")
        return result

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        return columns

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        tokens = float(np.sum(weights * state["mismatch_tokens"]))
        if not tokens:
            return {f"mismatch_{name}": float("nan") for name in TOKEN_TERMS}
        return {f"mismatch_{name}": float(np.sum(weights * state[f"mismatch_{name}_sum"])) / tokens
                for name in TOKEN_TERMS}
