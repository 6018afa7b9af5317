"""Users' feedback on answers (``POST /v1/feedback``): checked against the completion index, recorded as a reward
row (``reward_source: "feedback"``) beside its request, once per (answer, source).

``accept`` is the decision, a pure function of the records so a fleet's control plane can run it: the answer
must be known (its id recorded within ``records_retention_s``; an id forgotten for age or the index's size gets
410, one never seen 404), the choice index must exist, and a second feedback from the same source is a duplicate
(the same score: 200, nothing new recorded) or a conflict (another score: 409). The route adds the API key, a
per-key rate limit and the comment's size cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve.errors import ApiError
from serve.records import FEEDBACK_SOURCE, OnlineRecords
from serve.schemas import FeedbackRequest, FeedbackResponse
from verl.data.records import reward_row

if TYPE_CHECKING:
    from serve.service import Service


@dataclass
class Verdict:
    """What became of one feedback: ``status`` 200 (``row`` recorded, or a duplicate) or the 4xx and its why."""

    status: int
    outcome: str  # recorded, duplicate, conflict, unknown_id, expired, invalid
    message: str = ""
    model: str | None = None
    row: dict | None = None


def accept(records: OnlineRecords, completion_id: str, index: int, score: float, source: str,
           comment: str | None = None, known: dict | None = None) -> Verdict:
    """Record a feedback on ``records`` (see the module docstring). ``known`` is the answer's request row as the
    replica that answered holds it (a fleet: the control plane may not have received it yet)."""
    entry = records.index.get(completion_id)
    if entry is None and known is not None:
        records.index.note(known)
        entry = records.index.get(completion_id)
    if entry is None:
        if records.index.was_expired(completion_id):
            return Verdict(410, "expired", f"the answer '{completion_id}' is past the records' retention "
                           f"({duration(records.retention_s)}) or was forgotten to keep the index within its size "
                           "limit: feedback on it is no longer accepted")
        return Verdict(404, "unknown_id", f"no answer with id '{completion_id}' was given by this service (or it "
                       "is older than the service's records); send the `id` of a completion or chat completion "
                       "response")
    if index >= entry.choices:
        return Verdict(400, "invalid", f"the answer '{completion_id}' has {entry.choices} choice(s); 'index' "
                       f"{index} does not exist", model=entry.model)
    previous = entry.feedback.get((index, source))
    if previous is not None:
        if previous == score:
            return Verdict(200, "duplicate", model=entry.model)
        return Verdict(409, "conflict", f"source '{source}' already gave answer '{completion_id}' (choice {index}) "
                       f"the score {previous:g}; feedback is recorded once per answer and source (send another "
                       "`source` for a second opinion)", model=entry.model)
    row = reward_row(completion_id, index, score, FEEDBACK_SOURCE, model=entry.model, route=entry.route,
                     feedback_source=source, comment=comment, answered=entry.time, **entry.lineage)
    records.add(row)
    return Verdict(200, "recorded", model=entry.model, row=row)


def duration(seconds: float) -> str:
    """``seconds`` as a person reads it: 90 s, 45 min, 36 h, 7 days."""
    for unit, size in (("days", 86_400.0), ("h", 3_600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


async def take(service: Service, body: FeedbackRequest, key: str) -> FeedbackResponse:
    """``POST /v1/feedback``: the rate limit of ``key`` (the caller's API key or address), the comment's size, then
    ``accept`` here or, in a fleet, on the control plane (any replica takes feedback on any replica's answer)."""
    settings, metrics = service.settings, service.metrics
    if not service.feedback_limiter.allow(key):
        metrics.feedback.labels("unknown", "rate_limited").inc()
        raise ApiError(429, f"too much feedback from this key: at most {settings.feedback_rate_limit:g} per second "
                       f"(bursts of {settings.feedback_burst}); retry later", type="rate_limit_error",
                       code="rate_limited", headers={"Retry-After": str(max(1, settings.retry_after_s))})
    if body.comment is not None and len(body.comment) > settings.feedback_max_comment_chars:
        metrics.feedback.labels("unknown", "invalid").inc()
        raise ApiError(400, f"'comment' has {len(body.comment)} characters; at most "
                       f"{settings.feedback_max_comment_chars} are accepted", param="comment", code="comment_too_long")
    score = body.value
    if service.fleet is not None:
        known = service.records.find(body.id, body.index)
        verdict = Verdict(**await service.fleet.feedback(body.id, body.index, score, body.source, body.comment, known))
    else:
        verdict = accept(service.records, body.id, body.index, score, body.source, body.comment)
    metrics.feedback.labels(verdict.model or "unknown", verdict.outcome).inc()
    if verdict.status != 200:
        param = "index" if verdict.outcome == "invalid" else ("score" if verdict.outcome == "conflict" else "id")
        raise ApiError(verdict.status, verdict.message, param=param, code=verdict.outcome,
                       type="not_found_error" if verdict.status in (404, 410) else "invalid_request_error")
    if verdict.outcome == "recorded":
        metrics.feedback_score.labels(verdict.model or "unknown").observe(score)
    return FeedbackResponse(id=body.id, index=body.index, source=body.source, score=score, model=verdict.model,
                            duplicate=verdict.outcome == "duplicate")
