"""Diversity metrics against the published definitions and hand-computed values (REFERENCES.md)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tests.eval.helpers import make_batch
from verl.evaluators.diversity import Diversity, distinct_n, ngram_entropy, self_bleu_scores, seq_rep_n, tokenize

VECTOR = ["the cat sat on the mat", "the cat sat on the hat", "a dog ran"]


def test_distinct_entropy_seq_rep_match_reference_vector():
    tokens = [tokenize(s) for s in VECTOR]
    assert distinct_n(tokens, 1) == pytest.approx(0.6)
    assert distinct_n(tokens, 2) == pytest.approx(0.6667, abs=1e-4)
    assert ngram_entropy(tokens, 1) == pytest.approx(2.06111, abs=1e-5)
    assert ngram_entropy(tokens, 2) == pytest.approx(2.02281, abs=1e-5)
    assert [seq_rep_n(t, 1) for t in tokens] == pytest.approx([1 / 6, 1 / 6, 0.0])


def test_self_bleu_hand_computed():
    # "a b c" vs the only other sentence "a b d": p1 = 2/3, p2 = 1/2, p3 = 0 -> smoothed 0.1/1; equal lengths, BP 1.
    expected = (2 / 3 * 1 / 2 * 0.1) ** (1 / 3)
    scores = self_bleu_scores([["a", "b", "c"], ["a", "b", "d"]], 3)
    assert scores == pytest.approx([expected, expected])
    # Brevity: hypothesis "a b" (2 tokens) against "a b c d" (4): p1 = p2 = 1, p3: no trigram, 0/1 -> 0.1;
    # BP = exp(1 - 4/2). The 4-token sentence scores p1 = 2/4, p2 = 1/3, p3 = 0 -> 0.1/2, BP 1.
    scores = self_bleu_scores([["a", "b"], ["a", "b", "c", "d"]], 3)
    assert scores[0] == pytest.approx(math.exp(1 - 2) * (1 * 1 * 0.1) ** (1 / 3))
    assert scores[1] == pytest.approx((0.5 * (1 / 3) * 0.05) ** (1 / 3))
    # No unigram match at all gives 0, and a lone sentence has no references.
    assert self_bleu_scores([["x"], ["y"]], 3).tolist() == [0.0, 0.0]
    assert np.isnan(self_bleu_scores([["x"]], 3)).all()


def test_self_bleu_matches_nltk_sentence_bleu():
    bleu = pytest.importorskip("nltk.translate.bleu_score")
    rng = random.Random(0)
    for _ in range(50):
        sents = [[rng.choice("abcde") for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(2, 5))]
        expected = [bleu.sentence_bleu([s for j, s in enumerate(sents) if j != i], h, weights=(1 / 3,) * 3,
                                       smoothing_function=bleu.SmoothingFunction().method1)
                    for i, h in enumerate(sents)]
        assert self_bleu_scores(sents, 3) == pytest.approx(expected, abs=1e-12)


def test_evaluator_reports_metrics_and_jackknife_ci_contains_estimate():
    batch = make_batch(VECTOR * 4)
    result = Diversity().evaluate(batch)
    m = result.metrics
    # The corpus repeated 4 times: every n-gram count x4, so distinct-1 = 9 / 60.
    assert m["distinct_1"].value == pytest.approx(9 / 60)
    assert m["entropy_1"].value == pytest.approx(2.06111, abs=1e-5)
    assert m["seq_rep_1"].value == pytest.approx((1 / 6 + 1 / 6 + 0) / 3)
    assert m["distinct_1"].method == "jackknife"
    for name in ("distinct_1", "distinct_2", "entropy_1", "entropy_2"):
        assert m[name].ci_low <= m[name].value <= m[name].ci_high
    assert result.per_sample["self_bleu"].shape == (12,)


def test_chars_tokenization_and_options_round_trip():
    ev = Diversity(ngrams=[1, 3], tokenize="chars")
    assert ev.spec == "diversity(ngrams=1;3, tokenize=chars)"
    result = ev.evaluate(make_batch([">> 12", ">> 13"]))
    # characters > > 1 2 and > > 1 3: 8 unigrams, distinct {>, 1, 2, 3} = 4
    assert result.metrics["distinct_1"].value == pytest.approx(4 / 8)
    assert "distinct_3" in result.metrics and "distinct_2" not in result.metrics
    with pytest.raises(TypeError):
        Diversity(tokenize="bpe")
