"""Contamination: evaluation prompts that the training data holds too (docs/architecture.md §14).

A prompt of an evaluation set is **contaminated** when the training data holds it (exact match after
normalisation: lower case, punctuation as a word break, runs of whitespace as one) or shares one word 13-gram with a
training prompt — lm-evaluation-harness's definition (from GPT-3's Appendix C: any N-gram overlap; N = 13). Prompts
shorter than N words can only match exactly. Chat prompts are their messages' contents, joined, system messages
left out: a task's instructions (reasoning-gym's system prompts run to 13 words and more) are shared by every
prompt of it, train and test alike, and would make every item of the task look contaminated.

``TrainingIndex`` holds the training side once (normalised texts and the hashes of their n-grams);
``overlaps(texts)`` says, per evaluation prompt, ``"exact"``, ``"13-gram"`` or None. ``verl eval`` reports the count
and scores the clean subset beside the whole (``--strict`` refuses); ``verl data decontaminate`` removes the
overlapping rows from training data.

**Template n-grams do not count.** A generated task writes every item in one template ("… to its lowest terms. Give
only the simplified fraction as your final answer." is 13 words), so an n-gram that more than ``TEMPLATE_SHARE`` of
the training prompts hold (and at least ``TEMPLATE_MIN`` of them) is the task's wording, not an item, and is left
out of the index; exact matches still count.
"""

from __future__ import annotations

import collections
import json
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.data.dataset import get_nested, read_rows

NGRAM = 13  # lm-evaluation-harness's decontamination n
TEMPLATE_SHARE = 0.05  # an n-gram in more than this share of the training prompts is template (module docstring)
TEMPLATE_MIN = 20  # ... and in at least this many: a small training set keeps every n-gram
# Punctuation breaks words rather than vanishing (lm-evaluation-harness deletes it): deleted, "47+385" and "473+85"
# would both read "47385", and the built-in task's disjoint splits would look a third contaminated.
_PUNCTUATION = str.maketrans(string.punctuation, " " * len(string.punctuation))


def text_of(prompt: Any) -> str:
    """A dataset prompt's words: a text, or chat messages' contents (also as a JSON string) joined by newlines,
    system messages left out (the module docstring)."""
    if isinstance(prompt, str) and prompt.lstrip().startswith("["):
        try:
            prompt = json.loads(prompt)
        except ValueError:
            return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in prompt
                         if not (isinstance(m, dict) and m.get("role") == "system"))
    return str(prompt)


def normalise(text: str) -> list[str]:
    """Lower case, punctuation as whitespace, split on whitespace."""
    return text.lower().translate(_PUNCTUATION).split()


def ngram_hashes(words: Sequence[str], n: int) -> set[int]:
    """The (process-local) hashes of ``words``' n-grams: both sides are hashed in the same process."""
    return {hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}


@dataclass
class TrainingIndex:
    """The training prompts, normalised, and the hashes of their word n-grams."""

    n: int = NGRAM
    exact: set[str] = field(default_factory=set)
    grams: set[int] = field(default_factory=set)
    size: int = 0
    template: int = 0  # n-grams left out as the task's wording (module docstring)

    @classmethod
    def of(cls, texts: Iterable[str], n: int = NGRAM) -> TrainingIndex:
        index = cls(n)
        counts: collections.Counter[int] = collections.Counter()  # prompts holding each n-gram
        for text in texts:
            words = normalise(text)
            index.exact.add(" ".join(words))
            counts.update(ngram_hashes(words, n))
            index.size += 1
        limit = max(TEMPLATE_MIN, TEMPLATE_SHARE * index.size)
        index.grams = {gram for gram, count in counts.items() if count < limit}
        index.template = len(counts) - len(index.grams)
        return index

    def overlap(self, text: str) -> str | None:
        """``"exact"``, ``"13-gram"`` (any shared n-gram) or None for one evaluation prompt."""
        words = normalise(text)
        if " ".join(words) in self.exact:
            return "exact"
        if not self.grams.isdisjoint(ngram_hashes(words, self.n)):
            return f"{self.n}-gram"
        return None

    def overlaps(self, texts: Sequence[str]) -> list[str | None]:
        return [self.overlap(t) for t in texts]

    def overlaps_rows(self, rows: Sequence[dict], prompt_key: str) -> list[str | None]:
        """``overlaps`` of dataset rows' prompts (``prompt_key``, dotted for nested columns)."""
        return self.overlaps([text_of(get_nested(row, prompt_key)) for row in rows])


def prompts_of(files: Sequence[str], prompt_key: str = "prompt", config_key: str = "data.train_files") -> list[str]:
    """Every prompt of ``files`` (parquet or builtin:TASK/SPLIT) as text."""
    return [text_of(get_nested(row, prompt_key)) for row in read_rows(list(files), config_key)]


def summary(kinds: Sequence[str | None], train_files: Sequence[str], n: int = NGRAM) -> dict:
    """What ``verl eval`` records: how many evaluation prompts overlap, and how."""
    return {"checked": len(kinds), "overlapping": sum(k is not None for k in kinds),
            "exact": sum(k == "exact" for k in kinds), "ngram": sum(k is not None and k != "exact" for k in kinds),
            "n": n, "against": list(train_files)}

