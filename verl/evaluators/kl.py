"""KL divergence of the evaluated policy from a reference model (by default the run's initial model).

Per response, summed over its tokens (nats per response):

- ``kl_exact``: ``Σ_t KL(π(·|s_t) || π_ref(·|s_t))`` from the full next-token distributions. By the chain rule its
  expectation over responses drawn from π is the sequence-level KL; it has no sampling noise per token.
- ``kl_k1``: ``Σ_t (log π(y_t) - log π_ref(y_t))``, the plain sample estimate (unbiased, high variance, can be < 0).
- ``kl_k3``: ``Σ_t (r - 1 - log r)`` with ``r = π_ref(y_t)/π(y_t)`` (Schulman 2020: unbiased, >= 0, low variance).
- ``kl_exact_per_token``: ``Σ kl_exact / Σ tokens`` (comparable to the trainer's token-mean ``ppo/kl_div``).

k1 and k3 estimate the KL only for responses *sampled* from π at temperature 1; after greedy or tempered
decoding they describe those responses, and the report says so. ``kl_exact`` is meaningful either way (the KL
along the generated states).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.errors import VerlError
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator


def k1_k3(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token k1 and k3 (REFERENCES: log r = ref - logp; k1 = -log r; k3 = (r - 1) - log r)."""
    log_r = ref_log_probs - policy_log_probs
    return -log_r, torch.exp(log_r) - 1.0 - log_r



class KL(Evaluator):
    name = "kl"
    needs = frozenset({"generations", "ref_logprobs"})

    def __init__(self) -> None:
        self.options = {}

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        if not batch.kl_terms:
            raise VerlError("the kl evaluator got no reference log-probs; give a reference model "
                            "(verl eval --reference PATH; a run dir's model.path is the default)")
        terms = batch.kl_terms
        # Every term is zero on padding (compute_kl_terms masks them; k1 = k3 = 0 where both log-probs are 0).
        k1, k3 = k1_k3(terms["policy_log_probs"], terms["ref_log_probs"])
        columns = {"kl_exact": terms["token_kl"].sum(-1).double().numpy(), "kl_k1": k1.sum(-1).double().numpy(),
                   "kl_k3": k3.sum(-1).double().numpy()}
        result = EvalResult(per_sample=dict(columns))
        for name, column in columns.items():
            result.metrics[name] = self.mean(name, column, batch)
        result.metrics.update(self.corpus(batch, {"kl_exact": columns["kl_exact"],
                                                  "response_length": np.asarray(batch.response_lengths, float)}))
        temperature = batch.sampling.get("temperature", 1.0)
        if temperature != 1.0 or batch.sampling.get("top_p", 1.0) != 1.0 or batch.sampling.get("top_k", 0):
            result.notes.append(
                f"kl: responses were decoded with temperature={temperature}, top_p={batch.sampling.get('top_p')}, "
                f"top_k={batch.sampling.get('top_k')}, not sampled from the policy at temperature 1, so kl_k1/kl_k3 "
                "are not estimates of KL(policy || reference); kl_exact is the exact KL along these responses"
            )
        return result

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        return np.asarray(columns["kl_exact"], float), np.asarray(columns["response_length"], float)

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        kl, lengths = state
        tokens = float(np.sum(weights * lengths))
        return {"kl_exact_per_token": float(np.sum(weights * kl)) / tokens if tokens else float("nan")}
