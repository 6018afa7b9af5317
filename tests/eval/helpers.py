"""Build small EvalBatch objects by hand for evaluator tests."""

from __future__ import annotations

import numpy as np

from verl.evaluators import EvalBatch


def make_batch(responses: list[str], ground_truth: list | None = None, n: int = 1, data_source: str = "arithmetic",
               lengths: list[int] | None = None, rewards: list[float] | None = None, extras: dict | None = None,
               max_new_tokens: int = 16, n_bootstrap: int = 200) -> EvalBatch:
    count = len(responses)
    return EvalBatch(
        responses=list(responses),
        prompts=[f"p{i // n}" for i in range(count)],
        ground_truth=list(ground_truth) if ground_truth is not None else ["0"] * count,
        data_sources=[data_source] * count,
        prompt_index=np.repeat(np.arange(count // n), n),
        n=n,
        max_new_tokens=max_new_tokens,
        response_lengths=np.asarray(lengths if lengths is not None else [len(r) + 1 for r in responses]),
        rewards=None if rewards is None else np.asarray(rewards, dtype=float),
        reward_extras={k: np.asarray(v, dtype=float) for k, v in (extras or {}).items()},
        sampling={"n": n, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        n_bootstrap=n_bootstrap,
        seed=0,
    )
