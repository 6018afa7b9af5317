"""Diversity of the generations: distinct-n, n-gram entropy, self-BLEU and seq-rep-n.

Definitions (REFERENCES.md, "Evaluation definitions"):

- distinct-n (Li et al. 2016), corpus form: ``|unique n-grams| / |n-gram occurrences|`` over all responses.
- distinct responses: ``|unique responses| / |responses|`` (a response's tokens joined by one space): how often
  different prompts get the same answer, which is what a mode collapse is. distinct-n confounds it with length and
  format: a marker every answer gains (``>> 42`` for ``42``) halves distinct-1 of one-word answers while every
  answer stays its own.
- n-gram entropy: ``-Σ_g p_g ln p_g`` over the corpus n-gram frequencies (nats).
- seq-rep-n (Welleck et al. 2019): per response ``1 - |unique n-grams| / |n-grams|``, averaged over responses
  that have at least one n-gram.
- self-BLEU (Zhu et al. 2018, Texygen): each response scored against all the others as references, BLEU with
  uniform weights over 1..``bleu_n`` (3 by default) and smoothing method 1 (ε = 0.1 added to zero match counts),
  averaged. Higher = less diverse. Implemented with nltk's ``sentence_bleu`` arithmetic (modified precision with
  max-over-references clipping, denominator at least 1, closest reference length, brevity penalty, 0 when no
  unigram matches) but in O(total n-grams): for each n-gram only the two largest per-response counts are kept,
  so "the largest count among the *other* responses" is a lookup.

Tokens are whitespace-separated words by default (as in the published vectors); ``tokenize=chars`` uses
characters, which suits short symbolic answers such as the arithmetic task's.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from verl.evaluators.base import EvalBatch, EvalResult, Evaluator

SMOOTHING_EPSILON = 0.1  # nltk SmoothingFunction().method1


def tokenize(text: str, mode: str = "whitespace") -> list[str]:
    if mode == "chars":
        return [c for c in text if not c.isspace()]
    return text.split()


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(token_lists: list[list[str]], n: int) -> float:
    """Corpus distinct-n; NaN when the corpus has no n-gram."""
    grams = [g for tokens in token_lists for g in ngrams(tokens, n)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def ngram_entropy(token_lists: list[list[str]], n: int) -> float:
    """Shannon entropy (nats) of the corpus n-gram distribution; NaN when there is no n-gram."""
    counts = Counter(g for tokens in token_lists for g in ngrams(tokens, n))
    total = sum(counts.values())
    if not total:
        return float("nan")
    p = np.fromiter(counts.values(), dtype=np.float64) / total
    return float(-(p * np.log(p)).sum())


def seq_rep_n(tokens: list[str], n: int) -> float:
    """``1 - unique/total`` n-grams of one sequence; NaN when it has none."""
    grams = ngrams(tokens, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else float("nan")


def self_bleu_scores(token_lists: list[list[str]], max_n: int = 3) -> np.ndarray:
    """Per-response BLEU-``max_n`` against all other responses, ``(N,)``; NaN for all when N < 2."""
    count = len(token_lists)
    if count < 2:
        return np.full(count, np.nan)
    weights = [1.0 / max_n] * max_n
    per_order_counts = []  # per order: list of Counters (one per response)
    per_order_top = []  # per order: ngram -> ((best count, owner), second best count)
    for n in range(1, max_n + 1):
        counters = [Counter(ngrams(tokens, n)) if len(tokens) >= n else Counter() for tokens in token_lists]
        top: dict[tuple, list] = {}
        for owner, counter in enumerate(counters):
            for gram, c in counter.items():
                entry = top.get(gram)
                if entry is None:
                    top[gram] = [c, owner, 0]
                elif c > entry[0]:
                    entry[2], entry[0], entry[1] = entry[0], c, owner
                elif c > entry[2]:
                    entry[2] = c
        per_order_counts.append(counters)
        per_order_top.append(top)
    lengths = np.array([len(t) for t in token_lists])
    unique_lengths, length_counts = np.unique(lengths, return_counts=True)
    scores = np.zeros(count)
    for i in range(count):
        numerators, denominators = [], []
        for counters, top in zip(per_order_counts, per_order_top, strict=True):
            matched = 0
            for gram, c in counters[i].items():
                best, owner, second = top[gram]
                others_max = second if owner == i else best
                matched += min(c, others_max)
            numerators.append(matched)
            denominators.append(max(1, sum(counters[i].values())))
        if numerators[0] == 0:
            scores[i] = 0.0
            continue
        hyp_len = int(lengths[i])
        ref_len = _closest_other_length(hyp_len, unique_lengths, length_counts)
        if hyp_len > ref_len:
            penalty = 1.0
        elif hyp_len == 0:
            penalty = 0.0
        else:
            penalty = math.exp(1.0 - ref_len / hyp_len)
        log_sum = 0.0
        for w, num, den in zip(weights, numerators, denominators, strict=True):
            p = (num if num else SMOOTHING_EPSILON) / den
            log_sum += w * math.log(p)
        scores[i] = penalty * math.exp(log_sum)
    return scores


def _closest_other_length(hyp_len: int, unique_lengths: np.ndarray, counts: np.ndarray) -> int:
    """nltk's closest reference length, over every response but this one: min by (|len - hyp|, len)."""
    pos = int(np.searchsorted(unique_lengths, hyp_len))
    if counts[pos] > 1:
        return hyp_len  # another response has exactly this length
    candidates = [int(unique_lengths[j]) for j in (pos - 1, pos + 1) if 0 <= j < len(unique_lengths)]
    return min(candidates, key=lambda length: (abs(length - hyp_len), length))


class Diversity(Evaluator):
    name = "diversity"
    needs = frozenset({"generations"})
    corpus_resampling = "jackknife"  # distinct-n and entropy count distinct n-grams; a bootstrap would bias them

    def __init__(self, ngrams: list[int] | int = (1, 2), tokenize: str = "whitespace", bleu_n: int = 3,
                 self_bleu: bool = True):
        orders = [ngrams] if isinstance(ngrams, int) else list(ngrams)
        if not orders or any(not isinstance(n, int) or n < 1 for n in orders):
            raise TypeError(f"ngrams must be positive integers, got {ngrams!r}")
        if tokenize not in ("whitespace", "chars"):
            raise TypeError(f"tokenize must be 'whitespace' or 'chars', got {tokenize!r}")
        if not isinstance(bleu_n, int) or bleu_n < 1:
            raise TypeError(f"bleu_n must be a positive integer, got {bleu_n!r}")
        self.orders = sorted(set(orders))
        self.tokenize = tokenize
        self.bleu_n = bleu_n
        self.use_self_bleu = bool(self_bleu)
        # What differs from the defaults, named in the results (ngrams [1, 2], whitespace, BLEU-3, self-BLEU on).
        given = {"ngrams": (self.orders, [1, 2]), "tokenize": (tokenize, "whitespace"), "bleu_n": (bleu_n, 3),
                 "self_bleu": (self.use_self_bleu, True)}
        self.options = {key: value for key, (value, default) in given.items() if value != default}

    def direction(self, metric: str) -> bool | None:
        # Repetition is a defect; more or less diversity is neither good nor bad in itself.
        return False if metric.startswith("seq_rep_") else None

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        token_lists = [tokenize(t, self.tokenize) for t in batch.responses]
        result = EvalResult()
        for n in self.orders:
            column = np.array([seq_rep_n(t, n) for t in token_lists])
            result.per_sample[f"seq_rep_{n}"] = column
            result.metrics[f"seq_rep_{n}"] = self.mean(f"seq_rep_{n}", column, batch)
        if self.use_self_bleu:
            scores = self_bleu_scores(token_lists, self.bleu_n)
            result.per_sample["self_bleu"] = scores
            if len(scores) >= 2:
                result.metrics["self_bleu"] = self.mean("self_bleu", scores, batch)
                result.notes.append(
                    f"self_bleu: BLEU-{self.bleu_n} of each response against all others (its CI is conditional on "
                    "the set of responses)"
                )
        result.metrics.update(self.corpus(batch, {}))
        return result

    # ---- corpus metrics: distinct-n and entropy from a (sample x n-gram) count matrix

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        """Per order, a sparse ``(N, distinct n-grams)`` count matrix so a weighted corpus is one product; under
        ``"responses"`` the ``(N, distinct responses)`` one."""
        token_lists = [tokenize(t, self.tokenize) for t in responses]
        state = {}
        # Whole responses as the items of a one-order count matrix: one row, one count each.
        texts: dict[str, int] = {}
        ids = [texts.setdefault(" ".join(tokens), len(texts)) for tokens in token_lists]
        state["responses"] = (np.arange(len(ids), dtype=np.int64), np.asarray(ids, dtype=np.int64),
                              np.ones(len(ids)), len(texts))
        for n in self.orders:
            vocab: dict[tuple, int] = {}
            rows, cols, vals = [], [], []
            for i, tokens in enumerate(token_lists):
                for gram, c in Counter(ngrams(tokens, n)).items():
                    rows.append(i)
                    cols.append(vocab.setdefault(gram, len(vocab)))
                    vals.append(c)
            state[n] = (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64),
                        np.asarray(vals, dtype=np.float64), len(vocab))
        return state

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        out = {}
        w = np.asarray(weights, dtype=np.float64)
        for n, (rows, cols, vals, size) in state.items():
            counts = np.bincount(cols, weights=vals * w[rows], minlength=size) if size else np.zeros(0)
            total = counts.sum()
            present = counts[counts > 0]
            if n == "responses":
                out["distinct_responses"] = float(present.size / total) if total > 0 else float("nan")
                continue
            if total <= 0:
                out[f"distinct_{n}"] = out[f"entropy_{n}"] = float("nan")
                continue
            p = present / total
            out[f"distinct_{n}"] = float(present.size / total)
            out[f"entropy_{n}"] = float(-(p * np.log(p)).sum())
        return out
