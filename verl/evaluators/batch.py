"""What an evaluator reads: ``EvalBatch``, built once per evaluation by ``verl eval`` or by training validation.

An evaluator declares what it ``needs`` from the set ``NEEDS``; generations are always produced, the rest only when
some evaluator needs them, so a run of ``accuracy`` alone never loads a reference model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# "tool_calls": the rollout's per-trajectory tool counts (multi-turn rollouts only, verl/rollout/agent_loop.py).
# "engine_logprobs": the engine's log-probs of the tokens it drew and the trainer's forward on them (``mismatch``).
NEEDS = frozenset({"generations", "ground_truth", "rewards", "ref_logprobs", "tool_calls", "engine_logprobs"})


@dataclass
class EvalBatch:
    """Everything an evaluator may read, for ``N = prompts * n`` samples (a prompt's samples are adjacent).

    Tensor fields use the rollout layout: ``data.batch["responses"]`` and ``["response_mask"]`` are
    ``(N, response_len)``. ``kl_terms`` (present when an evaluator needs ``ref_logprobs``) holds
    ``policy_log_probs``, ``ref_log_probs`` and ``token_kl`` (exact per-token KL from the full distributions),
    each ``(N, response_len)`` and zero on padding.
    """

    responses: list[str]
    prompts: list[str]
    ground_truth: list[Any]
    data_sources: list[str]
    prompt_index: np.ndarray  # (N,) int: samples of one prompt share the id; the cluster for standard errors
    n: int  # samples per prompt
    max_new_tokens: int
    response_lengths: np.ndarray  # (N,) generated tokens, eos included
    rewards: np.ndarray | None = None  # (N,) sequence scores from the run's reward function / model
    reward_extras: dict[str, np.ndarray] = field(default_factory=dict)  # (N,) each, e.g. acc, acc_flexible
    data: Any = None  # the rollout DataProto, when the caller has one
    kl_terms: dict[str, Any] | None = None
    # "engine_logprobs": ``trainer`` / ``rollout`` log-probs and ``mask``, each (N, response_len); ``trainer_dtype``.
    mismatch_terms: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # n, temperature, top_p, top_k, seed, max_new_tokens
    n_bootstrap: int = 1000  # 0 skips bootstrap CIs (validation during training needs only the values)
    seed: int = 0  # of the bootstrap resampling

    def __len__(self) -> int:
        return len(self.responses)

    @classmethod
    def from_rollout(cls, batch: Any, texts: list[str], scores: np.ndarray, extras: dict[str, np.ndarray], n: int,
                     max_new_tokens: int, sampling: dict[str, Any] | None = None, n_bootstrap: int = 0,
                     seed: int = 0) -> EvalBatch:
        """From a rollout ``DataProto`` (``responses``/``response_mask`` ``(N, L)``), its decoded texts, the
        reward scores ``(N,)`` and per-sample reward extras, as validation produces them."""
        non = batch.non_tensor
        index = np.asarray(non["index"], dtype=np.int64) if "index" in non else np.repeat(np.arange(len(texts) // n), n)
        return cls(responses=list(texts), prompts=[str(p) for p in non.get("raw_prompt", [""] * len(texts))],
                   ground_truth=list(non.get("ground_truth", [None] * len(texts))),
                   data_sources=[str(s) for s in non.get("data_source", ["unknown"] * len(texts))], prompt_index=index,
                   n=n, max_new_tokens=max_new_tokens,
                   response_lengths=batch.batch["response_mask"].sum(-1).cpu().numpy().astype(np.int64),
                   rewards=None if scores is None else np.asarray(scores, dtype=np.float64),
                   reward_extras={k: np.asarray(v, dtype=np.float64) for k, v in (extras or {}).items()}, data=batch,
                   sampling=dict(sampling or {}), n_bootstrap=n_bootstrap, seed=seed)
