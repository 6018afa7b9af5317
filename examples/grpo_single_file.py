"""GRPO in one file: the loop a newcomer reads first.

    python examples/grpo_single_file.py    # ~1 minute on one CPU core: held-out accuracy 0.00 -> 0.43 in 30 steps

Only torch, transformers and verl's pure algorithm functions (``verl.algos``): no trainer, no workers, no config
system. It is the same algorithm ``verl train`` runs by default (configs/grpo_tiny.yaml): for each prompt sample a
group of responses, score them with a verifiable reward, turn rewards into advantages by normalising within the
group, and take a clipped policy-gradient step with a KL penalty to the frozen starting model. With
``MINI_BATCHES = 2`` each batch takes two optimizer steps, and the second one shows why a PPO trainer keeps the
sampling policy's log-probs ("old" log-probs): the ratio pi_theta / pi_old is no longer 1 there.
``tests/test_single_file_example.py`` checks that ``grpo_update`` below gives the trainer's first update exactly,
with one mini-batch and with two.

Shapes: B prompts, n responses each, N = B * n rows; P prompt tokens (left-padded), R response tokens.
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.algos.advantages import grpo as grpo_advantages
from verl.algos.kl import kl_penalty
from verl.algos.losses import agg_loss, clipped_policy_loss

MODEL_DIR = Path(__file__).resolve().parents[1] / "verl" / "models" / "assets" / "tiny-arith"  # the SFT warm start
STEPS, PROMPTS_PER_STEP, GROUP_SIZE = 30, 16, 8
MAX_NEW_TOKENS, TEMPERATURE = 16, 1.0
LR, CLIP, KL_COEF = 1e-4, 0.2, 0.04
MINI_BATCHES = 1  # optimizer steps per batch (verl: train_batch_size / ppo_mini_batch_size); 1 = on-policy
ANSWER = re.compile(r">> (-?[0-9]+)")  # the strict answer format the warm start was taught


# ------------------------------------------------------------------------------------------------ the task


def make_problem(rng: random.Random) -> tuple[str, int]:
    """A two-operand arithmetic question and its answer."""
    a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
    return f"What is {a}{op}{b}?", a + b if op == "+" else a - b


def reward(response: str, answer: int) -> float:
    """1 when the first ``>> N`` in the response is the answer, else 0: verifiable, nothing to learn from."""
    found = ANSWER.search(response)
    return float(found is not None and int(found.group(1)) == answer)


# ------------------------------------------------------------------------------------------------ rollout


def encode_prompts(tokenizer, questions: list[str]) -> dict[str, torch.Tensor]:
    """Chat-templated, left-padded prompt ids and mask, ``(B, P)``."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@torch.no_grad()
def rollout(model, tokenizer, prompts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sample ``GROUP_SIZE`` responses per prompt; rows of one prompt are adjacent. Returns the tensors the
    update reads: ``input_ids``/``attention_mask``/``position_ids`` ``(N, P + R)``, ``prompts`` ``(N, P)``,
    ``responses`` and ``response_mask`` ``(N, R)`` (the mask keeps tokens up to and including the first eos)."""
    ids = prompts["input_ids"].repeat_interleave(GROUP_SIZE, dim=0)
    mask = prompts["attention_mask"].repeat_interleave(GROUP_SIZE, dim=0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE, top_k=0,
                         max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    responses = out[:, ids.shape[1]:]
    is_eos = responses.eq(tokenizer.eos_token_id)
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # positions after the first eos
    response_mask = (~after_eos).long()
    responses = responses.masked_fill(after_eos, tokenizer.pad_token_id)
    attention_mask = torch.cat([mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": torch.cat([ids, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids, "prompts": ids, "responses": responses, "response_mask": response_mask}


def response_log_probs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(response token | everything before it), ``(N, R)``: one forward over prompt + response."""
    width = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits[:, -width - 1:-1].float()
    logits = logits / TEMPERATURE  # the distribution the rollout sampled from
    return torch.gather(F.log_softmax(logits, dim=-1), -1, batch["responses"].unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------------ the update


def grpo_update(model, reference, optimizer, batch: dict[str, torch.Tensor], scores: torch.Tensor,
                group_size: int = GROUP_SIZE, kl_coef: float = KL_COEF, clip: float = CLIP, grad_clip: float = 1.0,
                mini_batches: int = MINI_BATCHES, order: torch.Tensor | None = None) -> dict[str, float]:
    """GRPO on one rollout: ``scores`` ``(N,)`` are the sequence rewards, rows grouped by prompt.

    1. Put each reward on the response's last token (``token_level_rewards``, ``(N, R)``).
    2. Advantages: (reward - group mean) / group std, the same for every token of a response.
    3. For each of ``mini_batches`` slices of the rows (in ``order``, whole groups): PPO's clipped surrogate,
       token-mean, plus ``kl_coef`` x low-variance KL to the reference, and one optimizer step. The ratio
       compares the current policy with the one that *sampled* the batch, so its log-probs are computed once,
       before the first step. With one step they equal the current ones, detached, and that pass is skipped.
    Returns the mean of each metric over the steps.
    """
    mask = batch["response_mask"].float()
    last_token = mask.sum(-1).long().clamp(min=1) - 1
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(scores)), last_token] = scores
    groups = [i // group_size for i in range(len(scores))]
    advantages, _ = grpo_advantages(token_level_rewards=token_rewards, response_mask=mask, index=groups)

    with torch.no_grad():
        ref_log_prob = response_log_probs(reference, batch)
        old_log_prob = response_log_probs(model.eval(), batch) if mini_batches > 1 else None
    model.train()
    order = order if order is not None else torch.arange(len(scores))
    size = len(scores) // mini_batches
    steps = []
    for rows in order.split(size):
        mini = {k: v[rows] for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        log_prob = response_log_probs(model, mini)
        old = old_log_prob[rows] if old_log_prob is not None else log_prob.detach()
        pg_loss, pg_metrics = clipped_policy_loss(log_prob=log_prob, old_log_prob=old, advantages=advantages[rows],
                                                  mask=mask[rows], clip_low=clip, clip_high=clip)
        kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob[rows], "low_var_kl"), mask[rows], "token-mean")
        loss = pg_loss + kl_coef * kl_loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        steps.append({"loss": loss.item(), "pg_loss": pg_loss.item(), "kl_loss": kl_loss.item(),
                      "grad_norm": float(grad_norm), "clipfrac": pg_metrics["clipfrac"].item(),
                      "ratio_mean": masked_ratio_mean(log_prob.detach() - old, mask[rows])})
    return {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}


def masked_ratio_mean(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of pi_theta / pi_old over response tokens: exactly 1 on-policy, not after a step on this batch."""
    return float((log_ratio.exp() * mask).sum() / mask.sum())


# ------------------------------------------------------------------------------------------------ the loop


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[tuple[str, int]]) -> float:
    """Greedy accuracy on held-out problems."""
    model.eval()
    prompts = encode_prompts(tokenizer, [q for q, _ in problems])
    out = model.generate(**prompts, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(reward(t, a) for t, (_, a) in zip(texts, problems, strict=True)) / len(problems)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread is fastest for a model this small
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # frozen: what the KL term pulls towards
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    held_out = [make_problem(random.Random(10_000 + i)) for i in range(128)]
    print(f"step 0: held-out accuracy {accuracy(model, tokenizer, held_out):.3f}")
    for step in range(1, STEPS + 1):
        problems = [make_problem(rng) for _ in range(PROMPTS_PER_STEP)]
        model.eval()
        batch = rollout(model, tokenizer, encode_prompts(tokenizer, [q for q, _ in problems]))
        texts = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
        answers = [a for _, a in problems for _ in range(GROUP_SIZE)]
        scores = torch.tensor([reward(t, a) for t, a in zip(texts, answers, strict=True)])
        stats = grpo_update(model, reference, optimizer, batch, scores)
        line = (f"step {step}: reward {scores.mean():.3f}  loss {stats['loss']:.4f}  kl {stats['kl_loss']:.4f}  "
                f"ratio {stats['ratio_mean']:.4f}")
        if step % 10 == 0:
            line += f"  held-out accuracy {accuracy(model, tokenizer, held_out):.3f}"
        print(line)


if __name__ == "__main__":
    main()
