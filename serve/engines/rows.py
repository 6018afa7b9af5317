"""A running sequence of the transformers engine (``serve/engines/hf_engine.py``) and how each step chooses its next
token: penalties, grammar masks, greedy or sampled rows (a private generator per seeded request, so a seed
reproduces the same text whatever else is in the batch), top-k / top-p, and the log-probs a request asked for."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from serve.constrained import GrammarMatcher
from serve.engines.base import EngineOutput, EngineRequest, SamplingOptions, StopChecker, TokenLogprob
from verl.rollout.sampler import draw_categorical

log = logging.getLogger("uvicorn.error.serve.engine")


@dataclass(eq=False)
class RunningSequence:
    """One request's sequence in the engine; fields written by the engine thread, ``aborted`` also by the event loop."""

    request: EngineRequest
    queue: asyncio.Queue
    stop: StopChecker
    stop_ids: set[int]
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    scheduled_time: float | None = None
    aborted: bool = False
    finished: bool = False
    # Non-streamed sequences: text and token times collected here and delivered once, at the end.
    text_parts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # non-streamed sequences that asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # computed at admission when asked for
    failure: BaseException | None = None  # this sequence alone could not be computed (see RowSampler.sample)
    matcher: GrammarMatcher | None = None  # constrained decoding: the tokens its grammar allows next
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each generated token

    @property
    def sampling(self) -> SamplingOptions:
        return self.request.sampling

    def advance(self, token: int, now: float, max_model_len: int, logprob: TokenLogprob | None = None,
                version: int = 0) -> EngineOutput | None:
        """One token (sampled by weights ``version``): a delta (streamed), the aggregated result (non-streamed, at
        the end) or None."""
        self.generated.append(token)
        self.versions.append(version)
        sampling = self.sampling
        finish, stop_reason = None, None
        if self.matcher is not None:
            self.matcher.advance(token)
        if token in self.stop_ids:
            finish, stop_reason = "stop", token
        elif len(self.generated) >= sampling.max_tokens or (
            len(self.request.prompt_token_ids) + len(self.generated) >= max_model_len
        ):
            finish = "length"
        text = ""
        # Text is needed per step only to stream it or to look for stop strings; otherwise once, at the end.
        if self.request.stream or sampling.stop or finish is not None:
            # The stop token itself is not text (vLLM convention); it still counts as a generated token.
            text_ids = self.generated[:-1] if finish == "stop" else self.generated
            text, matched = self.stop.update(text_ids, final=finish is not None)
            if matched is not None:
                finish, stop_reason = "stop", matched
        self.finished = finish is not None
        first = len(self.generated) == 1
        if self.request.stream:
            return EngineOutput(text=text, token_ids=[token], num_generated_tokens=len(self.generated),
                                finish_reason=finish, stop_reason=stop_reason,
                                scheduled_time=self.scheduled_time if first else None,
                                logprobs=[logprob] if logprob is not None else None,
                                prompt_logprobs=self.prompt_logprobs if first else None, weight_versions=[version])
        self.text_parts.append(text)
        self.token_times.append(now)
        if logprob is not None:
            self.logprobs.append(logprob)
        if finish is None:
            return None
        return EngineOutput(text="".join(self.text_parts), token_ids=list(self.generated),
                            num_generated_tokens=len(self.generated), finish_reason=finish, stop_reason=stop_reason,
                            scheduled_time=self.scheduled_time, token_times=self.token_times,
                            logprobs=self.logprobs if self.sampling.logprobs is not None else None,
                            prompt_logprobs=self.prompt_logprobs, weight_versions=list(self.versions))


class RowSampler:
    """The next token of every row of one forward; ``shared``: the generator of requests without a seed."""

    def __init__(self, seed: int):
        self.shared = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[RunningSequence]) -> torch.Tensor:
        """Next token per row; a row that cannot be sampled gets ``seq.failure`` set (token 0) instead of failing
        the others: the batch is sampled at once, and row by row only after an error."""
        try:
            return self.sample_rows(logits, seqs)
        except Exception:
            tokens = torch.zeros(len(seqs), dtype=torch.long)
            for i, seq in enumerate(seqs):
                try:
                    tokens[i] = self.sample_rows(logits[i : i + 1], [seq])[0]
                except Exception as exc:
                    log.warning("sampling failed for one request (%r); it fails alone", exc)
                    seq.failure = exc
            return tokens

    def sample_rows(self, logits: torch.Tensor, seqs: list[RunningSequence]) -> torch.Tensor:
        """Next token per row (``logits``: (rows, vocab) float32 on CPU): penalties first, then greedy rows take
        the argmax and the others sample after temperature/top-k/top-p."""
        penalized = [i for i, seq in enumerate(seqs) if seq.sampling.penalized]
        if penalized:
            logits = logits.clone()  # the raw logits stay untouched for the log-probs
            for i in penalized:
                apply_penalties(logits[i], seqs[i].request.prompt_token_ids, seqs[i].generated, seqs[i].sampling)
            # Extreme penalties (repetition_penalty=1e-300 divides a logit into inf) must not become NaN
            # probabilities: +inf -> the largest float, NaN -> never chosen.
            logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if constrained:
            logits = logits.clone() if not penalized else logits
            for i in constrained:
                seqs[i].matcher.mask_logits(logits[i])
        tokens = logits.argmax(-1)
        sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
        if not sampled:
            return tokens
        rows = [seqs[i].sampling for i in sampled]
        index = torch.tensor(sampled)
        scores = logits.index_select(0, index) / torch.tensor([[s.temperature] for s in rows])
        if any(s.top_k > 0 or s.top_p < 1.0 for s in rows):
            scores = filter_top_k_top_p(scores, [s.top_k for s in rows], [s.top_p for s in rows])
        probs = scores.softmax(-1)
        shared = [j for j, i in enumerate(sampled) if seqs[i].generator is None]
        if shared:
            tokens[index[shared]] = draw_categorical(probs[shared], self.shared)
        for j, i in enumerate(sampled):
            generator = seqs[i].generator
            if generator is not None:
                tokens[i] = draw_categorical(probs[j : j + 1], generator)[0]
        return tokens


def apply_penalties(row: torch.Tensor, prompt: list[int], generated: list[int], sampling: SamplingOptions) -> None:
    """vLLM's penalties on one row of logits ``(vocab,)``, in place: repetition over prompt and output tokens,
    then frequency (per occurrence) and presence (once) over output tokens, then OpenAI's ``logit_bias``."""
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        values = row[seen]
        penalty = sampling.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if generated and (sampling.frequency_penalty or sampling.presence_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=row.shape[0]).to(row.dtype)
        row -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).to(row.dtype)
    if sampling.logit_bias:
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(sampling.logit_bias.values()), dtype=row.dtype)


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """``logits`` (rows, vocab) and the chosen ``tokens`` (rows,) -> each row's log-prob and its ``tops[r]`` best."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    k = max(tops, default=0)
    best_values, best_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    entries = []
    for r, (token, value) in enumerate(zip(tokens.tolist(), chosen, strict=True)):
        top = [] if not tops[r] else list(zip(best_ids[r, : tops[r]].tolist(), best_values[r, : tops[r]].tolist(),
                                              strict=True))
        entries.append(TokenLogprob(int(token), float(value), top))
    return entries


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[RunningSequence]) -> dict[int, TokenLogprob]:
    """Row -> the sampled token's raw log-prob (+ alternatives), for the rows that asked (others cost nothing)."""
    wanted = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted)
    entries = logprob_entries(logits.index_select(0, index), tokens.index_select(0, index),
                               [seqs[i].sampling.logprobs for i in wanted])
    return dict(zip(wanted, entries, strict=True))


def filter_top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf what falls outside each row's top-k and nucleus (top-p); the best token always survives.

    ``scores``: (rows, vocab) temperature-scaled logits.
    """
    vocab = scores.shape[-1]
    ordered, order = scores.sort(-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k]).unsqueeze(-1)  # top_k=1e29 is "all"
    ordered = ordered.masked_fill(ranks >= k, float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(-1)
    # The most likely token always stays, so a tiny top_p (5e-324 rounds to 0 in float32) means greedy, not NaN.
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
