"""Log-probs (and entropy) of given tokens straight from the last hidden states, a block of rows at a time.

The plain way — ``logits = lm_head(hidden)``, ``/ temperature``, ``log_softmax``, ``gather``, plus a softmax and a
product for the entropy, and autograd's backward of each — materialises several ``(rows, vocab)`` tensors: at 512
response tokens and SmolLM2's 49,152-token vocabulary each is 100 MB, fresh from the OS every time (glibc hands
blocks over 32 MB straight to ``mmap``), and each op streams it through memory once more. Measured in a LoRA
update on one thread (16 x 32 response tokens): ~0.8 s of vocabulary-sized elementwise work around a 0.29 s LM
head. Here the LM head runs on blocks of ``BLOCK_ROWS`` rows (a 25 MB block the heap reuses); each block's
log-softmax, gather, softmax and entropy run on ``CACHE_ROWS`` rows at a time while they sit in cache; the block's
softmax is kept for the backward, which needs nothing else: for ``lp = log_softmax(z)[token]``,
``d lp / d z = onehot(token) - softmax(z)``.

    log_probs, entropy = token_log_probs(hidden, lm_head, tokens, temperature)   # (N, H), (N,) -> (N,), (N,)

Same arithmetic per row as the plain way (the LM head's product, then ``/ temperature``, then PyTorch's own
``log_softmax`` and ``softmax`` kernels), so results agree to float rounding; the entropy is a metric (no gradient:
callers that need its gradient use the plain path). The LM head multiplies by oneDNN-packed copies of a frozen
weight inside ``packed_weights()`` (verl/models/packed_linear.py), as the layer itself would; a trainable head gets
its weight gradient (``grad_z^T @ hidden``) too.
"""

from __future__ import annotations

import torch
from torch import nn

from verl.models.packed_linear import packed_cache, packed_product_transposed

BLOCK_ROWS = 128  # LM-head rows per product: 128 x 49,152 fp32 = 25 MB, under glibc's 32 MB mmap threshold
CACHE_ROWS = 8  # rows per log-softmax / softmax pass: 8 x 49,152 fp32 = 1.5 MB, inside a core's L2


class _TokenLogProbs(torch.autograd.Function):
    """Forward: ``(log_probs (N,), entropy (N,))``; backward: gradients of ``hidden`` (and a trainable head)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: nn.Linear,
                tokens: torch.Tensor, temperature: float, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        log_probs = hidden.new_empty(rows)
        entropy = hidden.new_empty(rows)
        blocks: list[torch.Tensor] = []  # per block: softmax at temperature (rows, vocab), kept for the backward
        for start in range(0, rows, BLOCK_ROWS):
            # The layer itself (grad mode is off in here): its packed product where it would use one.
            logits = head(hidden[start : start + BLOCK_ROWS])
            for sub in range(0, logits.shape[0], CACHE_ROWS):
                z = logits[sub : sub + CACHE_ROWS]
                if temperature != 1.0:
                    z.div_(temperature)
                at = slice(start + sub, start + sub + z.shape[0])
                lp = torch.log_softmax(z, dim=-1)
                log_probs[at] = lp.gather(1, tokens[at].unsqueeze(1)).squeeze(1)
                # softmax, not lp.exp(): exp of very negative log-probs takes a slow path on CPU (see
                # verl.algos.losses.entropy_from_log_probs); written over the logits, which are not needed again.
                z.copy_(torch.softmax(z, dim=-1))
                entropy[at] = -(z * lp).sum(-1)
            if keep:
                blocks.append(logits)
        ctx.mark_non_differentiable(entropy)
        if keep:
            ctx.blocks, ctx.head, ctx.temperature = blocks, head, temperature
            ctx.save_for_backward(hidden, tokens)
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, tokens = ctx.saved_tensors
        head: nn.Linear = ctx.head
        weight = head.weight
        cache = packed_cache(head, grad_log_probs, gradients=True) if not weight.requires_grad else None
        grad_hidden = hidden.new_empty(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(head.bias) if ctx.needs_input_grad[2] else None
        for index, probs in enumerate(ctx.blocks):
            start = index * BLOCK_ROWS
            at = slice(start, start + probs.shape[0])
            g = grad_log_probs[at].unsqueeze(1)
            # d lp / d z = onehot(token) - softmax(z), times 1 / temperature for z = logits / temperature;
            # computed in place over the kept softmax (the backward runs once).
            grad_logits = probs.mul_(-g)
            grad_logits.scatter_add_(1, tokens[at].unsqueeze(1), g)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            if grad_hidden is not None:
                if cache is not None:
                    grad_hidden[at] = packed_product_transposed(grad_logits, weight, cache)
                else:
                    grad_hidden[at] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), hidden[at])
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
        ctx.blocks = None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def token_log_probs(hidden: torch.Tensor, head: nn.Linear, tokens: torch.Tensor, temperature: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``tokens`` and the entropy under ``softmax(head(hidden) / temperature)``.

    ``hidden`` ``(..., H)``, ``tokens`` ``(...)`` (same leading shape) -> two ``(...)`` tensors; the entropy carries
    no gradient.
    """
    shape = tokens.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    # Keep the softmax blocks only when a backward can come (``needs_input_grad`` ignores no_grad mode).
    trainable = hidden.requires_grad or head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad)
    keep = torch.is_grad_enabled() and trainable
    log_probs, entropy = _TokenLogProbs.apply(flat_hidden, head.weight, head.bias, head, tokens.reshape(-1),
                                              float(temperature), keep)
    return log_probs.view(shape), entropy.view(shape)
