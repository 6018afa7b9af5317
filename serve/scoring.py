"""Scoring requests for reward models: ``POST /classify`` (also ``/v1/classify``) and ``POST /pooling``, with vLLM's
request and response fields (``serve.schemas.ScoreRequest``, ``ClassificationResponse``, ``PoolingResponse``).

A scoring request names a reward model (``kind: reward``; default: the first one), never a route: routes split
generation traffic between models, and a score must come from the model the caller chose. Scoring holds no
generation queue slot; the reward model's own thread takes the requests in turn (``serve.engines.reward``).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Literal

from serve.engines.reward import RewardScorer
from serve.errors import ApiError
from serve.schemas import ScoreRequest
from verl.errors import DataError

if TYPE_CHECKING:
    from serve.service import Service


def pick_scorer(service: Service, requested: str | None) -> tuple[str, RewardScorer]:
    """The reward model a scoring request names (the first one served when it names none)."""
    service.admission.ready()
    scorers = service.lifecycle.scorers
    if requested is None:
        if not scorers:
            raise ApiError(400, "this service serves no reward model; add one with kind: reward in serve.yaml's "
                           "models (a `verl rm` checkpoint or export)", param="model", code="model_not_found")
        requested = next(iter(scorers))
    scorer = scorers.get(requested)
    if scorer is not None:
        return requested, scorer
    registry = service.lifecycle.registry
    if requested in registry.models or requested in registry.routes:
        raise ApiError(400, f"'{requested}' is a chat model or route, not a reward model; reward models here: "
                       f"{', '.join(scorers) or 'none'}", param="model", code="wrong_model_kind")
    raise ApiError(404, f"The model '{requested}' does not exist (reward models: {', '.join(scorers) or 'none'}; see "
                   "/v1/models)", type="invalid_request_error", param="model", code="model_not_found")


def score_inputs(scorer: RewardScorer, body: ScoreRequest, limit: int) -> list[list[int]]:
    """Token ids of every input of ``body`` (checked: one of input / messages, the count, the vocabulary)."""
    if (body.input is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of 'input' (texts or token ids) or 'messages' (a conversation)",
                       param="input")
    if body.messages is not None:
        if not body.messages:
            raise ApiError(400, "'messages' must not be empty", param="messages")
        texts: list = [scorer.render([{"role": m.role, "content": m.text()} for m in body.messages])]
        special = bool(body.add_special_tokens)  # the chat template already placed them
    else:
        value = body.input
        texts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
        special = body.add_special_tokens is not False
    if not texts:
        raise ApiError(400, "'input' must not be empty", param="input")
    if len(texts) > limit:
        raise ApiError(400, f"{len(texts)} inputs in one request; the limit is {limit} (max_score_inputs)",
                       param="input")
    vocab = len(scorer.tokenizer)
    for i, item in enumerate(texts):
        bad = [t for t in item if not 0 <= t < vocab] if isinstance(item, list) else []
        if bad:
            raise ApiError(400, f"input[{i}]: token id {bad[0]} is outside the vocabulary (size {vocab})",
                           param="input")
    try:
        return scorer.encode(texts, special, body.truncate_prompt_tokens)
    except DataError as exc:
        raise ApiError(400, str(exc), param="input") from None


async def score_request(service: Service, body: ScoreRequest, endpoint: Literal["classify", "pooling"]) -> dict:
    """The response body of one ``/classify`` or ``/pooling`` request."""
    name, scorer = pick_scorer(service, body.model)
    ids = score_inputs(scorer, body, service.settings.max_score_inputs)
    scored = await scorer.score(ids, body.use_activation)
    service.metrics.prompt_tokens.labels(name).inc(scored.prompt_tokens)
    usage = {"prompt_tokens": scored.prompt_tokens, "total_tokens": scored.prompt_tokens, "completion_tokens": 0,
             "prompt_tokens_details": None}
    created = int(time.time())
    if endpoint == "classify":
        data = [{"index": i, "label": label, "probs": values, "num_classes": len(values)}
                for i, (values, label) in enumerate(zip(scored.values, scored.labels, strict=True))]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": created, "model": name,
                "data": data, "usage": usage}
    data = [{"index": i, "object": "pooling", "data": values} for i, values in enumerate(scored.values)]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": created, "model": name, "data": data,
            "usage": usage}
