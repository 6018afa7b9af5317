"""LLM-as-judge (and reward-model-as-judge): ``judge(model=URL#NAME, rubric=FILE, mode=pointwise|pairwise)``.

The judge is a model behind an OpenAI-compatible URL (our service, vLLM, any provider): a chat model that reads a
rubric, or a reward model (``kind: reward`` in the service's ``/v1/models``, scored on ``/classify`` with the text
the trainer sends a reward model: the prompt, then the answer).

- **pointwise**: each answer alone; the judge ends its reply with ``Score: N`` (or MT-bench's ``[[N]]``) on the
  rubric's scale (``scale=1;10``), mapped to [0, 1]. A reward model's probability is the score.
- **pairwise**: each answer against a reference model's answer to the same prompt (``reference=URL#NAME``,
  generated here greedily), judged **in both orders** (the candidate as A, then as B); the verdict ``[[A]]``,
  ``[[B]]`` or ``[[C]]`` (a tie) gives the candidate 1, 0 or 0.5 per order, and its score is the mean of the two.

Answers are data, not instructions (the protocol, rubrics and client: ``verl.rewards.judge``, shared with the
trainer's and the service's judges): an answer cannot close its block early (it does not know the nonce) or speak
for the judge.

A reply with no readable verdict is **missing** (NaN: ``judge_missing``), never a 0. Where labels exist — the rule's
strict correctness against the ground truth — the result carries the judge's calibration (``judge_agreement``,
Cohen's ``judge_kappa``), and always its correlation with answer length (``judge_length_corr``, Spearman) and, in
pairwise mode, ``judge_swap_consistency`` (the share of pairs whose two orders agree: 1 - position bias). With
``labels=FILE`` (answers people labelled: prompt, response, label), the judge is asked on those too and compared
with the people (``judge_human_agreement``, ``judge_human_kappa``).

Judging both orders is MT-bench's and AlpacaEval's convention against position bias.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from verl.errors import ConfigError
from verl.evaluators.accuracy import strict_answer, strict_correct
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator
from verl.evaluators.stats import Metric
from verl.rewards.judge import Endpoint, JudgeClient, PointwiseRubric, load_rubric, markers, parse_verdict


def cohen_kappa(a: np.ndarray, b: np.ndarray) -> float:
    """Cohen's kappa of two binary raters: (p_o - p_e) / (1 - p_e); NaN when chance agreement is total."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.size == 0:
        return math.nan
    observed = float(np.mean(a == b))
    expected = float(a.mean() * b.mean() + (1 - a.mean()) * (1 - b.mean()))
    return math.nan if expected >= 1.0 else (observed - expected) / (1.0 - expected)


def read_labelled(path: str) -> list[tuple[str, str, float]]:
    """Human-labelled answers for a judge's calibration: a parquet or JSONL file whose rows have ``prompt``,
    ``response`` and ``label`` (1 / 0, true / false, or a score in [0, 1]; >= 0.5 is a good answer)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"judge: labels={path} is not a file (parquet or JSONL rows of prompt, response, label)")
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415  (a labelled file only)

            rows = pq.read_table(file).to_pylist()
        else:
            rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    except Exception as exc:  # noqa: BLE001 - an unreadable file is one line, naming it
        raise ConfigError(f"judge: labels={path} cannot be read as parquet or JSONL: {exc}") from None
    out = []
    for number, row in enumerate(rows):
        where = f"judge: labels={path} row {number}"
        if not isinstance(row, dict) or not all(k in row for k in ("prompt", "response", "label")):
            have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"{where}: needs prompt, response and label (it has: {have})")
        label = row["label"]
        if isinstance(label, bool) or (isinstance(label, (int, float)) and 0.0 <= float(label) <= 1.0):
            out.append((str(row["prompt"]), str(row["response"]), float(label)))
        else:
            raise ConfigError(f"{where}: label {label!r} must be 1/0, true/false or a score in [0, 1]")
    if not out:
        raise ConfigError(f"judge: labels={path} has no rows")
    return out


class Judge(Evaluator):
    """See the module docstring."""

    name = "judge"
    needs = frozenset({"generations", "ground_truth"})
    directions = {"judge_score": True, "judge_win_rate": True, "judge_missing": False, "judge_agreement": True,
                  "judge_kappa": True, "judge_length_corr": None, "judge_swap_consistency": True,
                  "judge_human_agreement": True, "judge_human_kappa": True}

    def __init__(self, model: str | None = None, rubric: str | None = None, mode: str = "pointwise",
                 reference: str | None = None, scale: list[float] | None = None, max_tokens: int = 256,
                 api_key_env: str | None = None, timeout_s: float = 60.0, max_retries: int = 2,
                 concurrency: int = 4, labels: str | None = None):
        if model is None:
            raise ConfigError("judge needs model=URL#NAME: the judge's service and model, e.g. "
                              "judge(model=http://127.0.0.1:8000#judge)")
        if mode not in ("pointwise", "pairwise"):
            raise ConfigError(f"judge: mode must be pointwise or pairwise (got {mode!r})")
        if mode == "pairwise" and reference is None:
            raise ConfigError("judge(mode=pairwise) needs reference=URL#NAME: the model whose answers the "
                              "candidate's are judged against")
        if labels is not None and mode != "pointwise":
            raise ConfigError("judge: labels=FILE holds answers judged one at a time; use it with mode=pointwise")
        self.labelled = read_labelled(labels) if labels is not None else None
        low, high = (float(x) for x in (scale or [1, 10]))
        if not low < high:
            raise ConfigError(f"judge: scale must be LOW;HIGH with LOW < HIGH (got {scale})")
        self.endpoint = Endpoint.parse(model, "model")
        self.reference = Endpoint.parse(reference, "reference") if reference is not None else None
        self.rubric = load_rubric(rubric, mode)
        self.mode, self.low, self.high, self.max_tokens = mode, low, high, int(max_tokens)
        self.api_key_env, self.timeout_s = api_key_env, float(timeout_s)
        self.max_retries, self.concurrency = int(max_retries), int(concurrency)
        self.options = {k: v for k, v in {"model": model, "rubric": rubric, "mode": mode, "reference": reference,
                                          "scale": scale, "labels": labels}.items() if v is not None}

    def _client(self, endpoint: Endpoint) -> JudgeClient:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return JudgeClient(endpoint, key, self.timeout_s, self.max_retries, self.concurrency)

    # ------------------------------------------------------------ evaluate

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        client = self._client(self.endpoint)
        try:
            kind = client.kind()
            if self.mode == "pointwise":
                scores, extra = self._pointwise(client, kind, batch.prompts, batch.responses), {}
            else:
                scores, extra = self._pairwise(client, kind, batch)
            human = (self._pointwise(client, kind, [r[0] for r in self.labelled], [r[1] for r in self.labelled])
                     if self.labelled is not None else None)
        finally:
            client.close()
        result = self._result(batch, scores, extra, kind)
        if human is not None:
            self._human_calibration(result, human)
        return result

    def _human_calibration(self, result: EvalResult, scores: np.ndarray) -> None:
        """The judge against people: its verdicts (score >= 0.5) on the human-labelled answers of ``labels=FILE``
        against their labels (>= 0.5 is good), over the answers it gave a verdict on."""
        labels = np.array([r[2] for r in self.labelled], dtype=np.float64)
        valid = ~np.isnan(scores)
        if not valid.any():
            result.notes.append(f"judge: no verdict on any of the {len(labels)} human-labelled answers")
            return
        said, truth = scores[valid] >= 0.5, labels[valid] >= 0.5
        n = int(valid.sum())
        result.metrics["judge_human_agreement"] = _scalar("judge_human_agreement", float(np.mean(said == truth)), n,
                                                          self.spec)
        result.metrics["judge_human_kappa"] = _scalar("judge_human_kappa", cohen_kappa(said, truth), n, self.spec)
        result.notes.append(f"judge: calibrated against {len(labels)} human-labelled answers "
                            f"({self.options['labels']}); {len(labels) - n} without a verdict")

    def _pointwise(self, client: JudgeClient, kind: str, prompts: list[str], responses: list[str]) -> np.ndarray:
        """One score in [0, 1] per (prompt, response); NaN where the judge gave none."""
        # The client the trainer and the live scorer use (docs/architecture.md §13): NaN where missing.
        if kind == "reward":
            from verl.rewards.remote import RemoteRewardModel  # noqa: PLC0415

            key = os.environ.get(self.api_key_env) if self.api_key_env else None
            remote = RemoteRewardModel(self.endpoint.url, model=self.endpoint.model, score="probability",
                                       timeout_s=self.timeout_s, max_retries=self.max_retries,
                                       max_concurrency=self.concurrency, api_key=key)
            try:
                values, _ = remote.score([p + r for p, r in zip(prompts, responses, strict=True)])
            finally:
                remote.close()
            return np.asarray(values, dtype=np.float64)

        rubric = PointwiseRubric(self.rubric, self.low, self.high, self.max_tokens)
        return np.asarray(client.map(lambda i: rubric.ask(client, prompts[i], responses[i]),
                                     list(range(len(prompts)))), dtype=np.float64)

    def _pairwise(self, client: JudgeClient, kind: str, batch: EvalBatch) -> tuple[np.ndarray, dict]:
        if kind == "reward":
            raise ConfigError("judge(mode=pairwise): a reward model scores answers one at a time; use "
                              "mode=pointwise with it")
        assert self.reference is not None
        ref_client = self._client(self.reference)
        try:
            unique = sorted(set(batch.prompts))
            answers = dict(zip(unique, ref_client.map(lambda p: ref_client.complete(p, batch.max_new_tokens),
                                                      unique), strict=True))
        finally:
            ref_client.close()

        def verdict(question: str, first: str, second: str) -> str | None:
            (open_a, close_a), (open_b, close_b) = markers("answer-a"), markers("answer-b")
            system = self.rubric.format(open_a=open_a, close_a=close_a, open_b=open_b, close_b=close_b)
            user = (f"[Question]\n{question}\n\n[Answer A]\n{open_a}\n{first}\n{close_a}\n\n[Answer B]\n{open_b}\n"
                    f"{second}\n{close_b}")
            reply = client.chat([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                self.max_tokens)
            return None if reply is None else parse_verdict(reply)

        def one(i: int) -> tuple[str | None, str | None, str | None]:
            reference = answers[batch.prompts[i]]
            if reference is None:
                return None, None, None
            as_a = verdict(batch.prompts[i], batch.responses[i], reference)
            as_b = verdict(batch.prompts[i], reference, batch.responses[i])
            return as_a, as_b, reference

        results = client.map(one, list(range(len(batch))))
        first = np.array([{"A": 1.0, "B": 0.0, "C": 0.5}.get(a, math.nan) for a, _, _ in results])
        second = np.array([{"B": 1.0, "A": 0.0, "C": 0.5}.get(b, math.nan) for _, b, _ in results])
        scores = np.where(np.isnan(first) | np.isnan(second), math.nan, (first + second) / 2)
        both = ~np.isnan(first) & ~np.isnan(second)
        consistent = (first == second)[both]
        references = [r for _, _, r in results]
        return scores, {"swap_consistency": consistent, "references": references}

    # ------------------------------------------------------------ the result

    def _labels(self, batch: EvalBatch, references: list[str | None] | None) -> np.ndarray | None:
        """Per sample: 1/0 by the rule's strict correctness (pairwise: 1 when only the candidate is right, 0 when
        only the reference is, NaN otherwise); None without ground truth."""
        if not batch.ground_truth or any(t is None for t in batch.ground_truth):
            return None

        def right(i: int, text: str) -> bool:
            source = batch.data_sources[i]
            return strict_correct(source, strict_answer(source, text), batch.ground_truth[i])

        if references is None:
            return np.array([float(right(i, r)) for i, r in enumerate(batch.responses)])
        out = np.full(len(batch), math.nan)
        for i, ref in enumerate(references):
            if ref is not None:
                mine, theirs = right(i, batch.responses[i]), right(i, ref)
                if mine != theirs:
                    out[i] = float(mine)
        return out

    def _result(self, batch: EvalBatch, scores: np.ndarray, extra: dict, kind: str) -> EvalResult:
        name = "judge_score" if self.mode == "pointwise" else "judge_win_rate"
        valid = ~np.isnan(scores)
        result = EvalResult(per_sample={name: scores})
        missing = (~valid).astype(np.float64)
        result.metrics["judge_missing"] = self.mean("judge_missing", missing, batch, binary=True)
        if not valid.any():
            result.notes.append(f"judge: no readable verdict from {self.endpoint.url} (model "
                                f"{self.endpoint.model or 'default'}): every score is missing")
            return result
        result.metrics[name] = self.mean(name, scores, batch, column=name)  # over the verdicts given (NaN dropped)
        lengths = np.asarray(batch.response_lengths, dtype=np.float64)
        if valid.sum() >= 3 and np.ptp(scores[valid]) > 0 and np.ptp(lengths[valid]) > 0:
            from scipy.stats import spearmanr  # noqa: PLC0415  (eval extra)

            corr = float(spearmanr(scores[valid], lengths[valid]).statistic)
            result.metrics["judge_length_corr"] = _scalar("judge_length_corr", corr, int(valid.sum()), self.spec)
        labels = self._labels(batch, extra.get("references"))
        if labels is not None:
            both = valid & ~np.isnan(labels)
            if both.any():
                said, truth = scores[both] >= 0.5, labels[both] >= 0.5
                agree = (said == truth).astype(np.float64)
                result.metrics["judge_agreement"] = _scalar("judge_agreement", float(agree.mean()), int(both.sum()),
                                                            self.spec)
                result.metrics["judge_kappa"] = _scalar("judge_kappa", cohen_kappa(said, truth), int(both.sum()),
                                                        self.spec)
        if "swap_consistency" in extra and len(extra["swap_consistency"]):
            consistent = np.asarray(extra["swap_consistency"], dtype=np.float64)
            result.metrics["judge_swap_consistency"] = _scalar("judge_swap_consistency", float(consistent.mean()),
                                                               int(consistent.size), self.spec)
        result.notes.append(f"judge: {kind} model {self.endpoint.model or '(default)'} at {self.endpoint.url}, "
                            f"{self.mode}; {int((~valid).sum())} of {len(scores)} verdicts missing")
        return result


def _scalar(name: str, value: float, n: int, evaluator: str) -> Metric:
    """A statistic of the whole set (agreement, kappa, a correlation) without an error bar; ``verl compare`` does
    not pair it (it has no per-sample column)."""
    return Metric(value, math.nan, math.nan, math.nan, n, "none", aggregate="summary", higher_is_better=
                  Judge.directions.get(name), evaluator=evaluator)
