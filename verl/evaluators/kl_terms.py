"""Exact per-token KL between a policy and a reference along given responses (the ``kl`` evaluator's inputs).

The forward passes that fill ``EvalBatch.kl_terms``: ``verl eval``'s runner and the trainer's roles (training
validation with ``trainer.evaluators=[kl]``) both call ``compute_kl_terms``, so both report the same number for the
same checkpoint. Unlike the trainer's ``ppo/kl_div`` (a k1/k3 estimate on the sampled tokens, at the
rollout temperature), these terms use the full next-token distributions at temperature 1 by default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from verl.models.precision import at_least_float32

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def token_kl_terms(policy_logits: torch.Tensor, ref_logits: torch.Tensor, tokens: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """Per-token terms from logits ``(B, L, V)`` and the generated ``tokens`` ``(B, L)``.

    Returns ``policy_log_probs``, ``ref_log_probs`` (of the generated tokens) and ``token_kl`` (exact
    ``KL(π || π_ref)`` at each position), each ``(B, L)``.
    """
    logp = F.log_softmax(at_least_float32(policy_logits), dim=-1)
    logq = F.log_softmax(at_least_float32(ref_logits), dim=-1)
    exact = (logp.exp() * (logp - logq)).sum(-1).clamp(min=0.0)  # rounding can give -1e-9
    index = tokens.unsqueeze(-1)
    return {"policy_log_probs": logp.gather(-1, index).squeeze(-1), "ref_log_probs": logq.gather(-1, index).squeeze(-1),
            "token_kl": exact}


@torch.no_grad()
def compute_kl_terms(policy: torch.nn.Module, reference: torch.nn.Module, data: Any, micro_batch_size: int = 32,
                     temperature: float = 1.0, progress: Any = None,
                     reference_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                     ) -> dict[str, torch.Tensor]:
    """Run both models over the rollout ``data`` (``input_ids`` etc. ``(N, prompt+response)``) once, in micro
    batches, keeping only response positions. Returns the ``token_kl_terms`` fields ``(N, L)``, zero on padding.

    ``reference_context`` is entered around the reference's forward: with LoRA the reference is the policy module
    itself under ``disable_adapter()``. Both models are put in eval mode and restored to their previous mode.
    """
    mask = data.batch["response_mask"].float()
    width = data.batch["responses"].shape[1]
    modes = [(model, model.training) for model in (policy, reference)]
    for model, _ in modes:
        model.eval()
    device = next(policy.parameters()).device
    ref_device = next(reference.parameters()).device
    contexts = (contextlib.nullcontext, reference_context or contextlib.nullcontext)
    parts: dict[str, list[torch.Tensor]] = {}
    try:
        for start in range(0, len(data), micro_batch_size):
            rows = {k: data.batch[k][start : start + micro_batch_size] for k in MODEL_KEYS}
            logits = []
            for model, dev, context in ((policy, device, contexts[0]), (reference, ref_device, contexts[1])):
                with context():
                    out = model(input_ids=rows["input_ids"].to(dev), attention_mask=rows["attention_mask"].to(dev),
                                position_ids=rows["position_ids"].to(dev), logits_to_keep=width + 1, use_cache=False)
                logits.append(at_least_float32(out.logits[:, -width - 1 : -1, :]).to(device) / temperature)
            terms = token_kl_terms(logits[0], logits[1], rows["responses"].to(device))
            for key, value in terms.items():
                parts.setdefault(key, []).append(value.cpu())
            if progress is not None:
                progress(len(rows["responses"]))
    finally:
        for model, was_training in modes:
            model.train(was_training)
    return {k: torch.cat(v) * mask for k, v in parts.items()}
