"""The HTTP routes: operational (health, metrics, version), OpenAI (models, completions, chat) and native
(generate, tokenize, detokenize)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from serve import __version__
from serve.admission import Responder
from serve.auth import is_training_key, require_api_key
from serve.engines.base import EngineOutput, SamplingOptions
from serve.errors import ERROR_RESPONSES, SSE_DOC, ApiError
from serve.feedback import take as take_feedback
from serve.logprobs import CompletionLogprobs, chat_logprobs, token_texts
from serve.metrics import CONTENT_TYPE
from serve.pumps import SequenceSpec
from serve.requests import (
    chat_prompt,
    check_unsupported,
    completion_prompts,
    echo_texts,
    encode_texts,
    plan_tokens,
    sequence_specs,
)
from serve.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FeedbackRequest,
    FeedbackResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    PoolingResponse,
    ScoreRequest,
    TokenGenerateRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from serve.scoring import score_request
from serve.service import Service
from serve.streaming import run_to_completion, stream_response, usage_block
from serve.tool_calling import ToolCallStream, plan_request, response_message, uses_tools
from verl.errors import ConfigError
from verl.tools.templates import tool_chat_template


def add_routes(app: FastAPI, service: Service) -> None:
    """Mount the five routers on ``app``."""
    for router in (ops_router(service), openai_router(service), native_router(service), scoring_router(service),
                   feedback_router(service)):
        app.include_router(router)


def ops_router(service: Service) -> APIRouter:
    """Health (open, for probes), Prometheus metrics and version."""
    router = APIRouter()
    protected = [Depends(require_api_key)]


    @router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}}, tags=["ops"])
    async def health() -> JSONResponse:
        """200 when serving; 503 while loading, draining or when the engine died (no API key needed)."""
        lifecycle, fleet = service.lifecycle, service.fleet
        status, detail = lifecycle.health()
        engine = lifecycle.engine.name if lifecycle.engine else None
        body = HealthResponse(status=status, engine=engine, detail=detail, model=lifecycle.model_name,
                              model_source=service.settings.model_source, version=lifecycle.config_version,
                              replicas=fleet.live if fleet is not None else None,
                              replica_versions=fleet.versions if fleet is not None else None).model_dump()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    # /metrics needs the key when one is set, unless metrics_public (a scraper that cannot send headers).
    metrics_guard = [] if service.settings.metrics_public else protected

    @router.get("/metrics", tags=["ops"], response_class=Response, dependencies=metrics_guard,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        """Prometheus metrics (``verl:`` prefix, vLLM's names); in a fleet, every replica's, labelled ``replica``."""
        page = service.metrics.exposition()
        if service.fleet is not None:
            page = await service.fleet.metrics_page(page)
        return Response(page, media_type=CONTENT_TYPE)

    @router.get("/version", response_model=VersionResponse, tags=["ops"], dependencies=protected)
    async def version() -> VersionResponse:
        engine = service.lifecycle.engine
        return VersionResponse(version=__version__, engine=engine.name if engine else "loading",
                               model=service.lifecycle.model_name)

    return router


def openai_router(service: Service) -> APIRouter:
    """OpenAI's models, completions and chat completions."""
    router = APIRouter()
    protected = [Depends(require_api_key)]

    @router.get("/v1/models", response_model=ModelList, dependencies=protected, responses=ERROR_RESPONSES,
             tags=["openai"])
    async def models() -> dict:
        """Every served model (LoRA adapters name their base in ``parent``; ``kind`` says whether it generates,
        ``chat``, or scores, ``reward``), then every route (``parent`` null, ``root`` the route's name): a client may
        send either in ``model``."""
        service.admission.ready()
        registry = service.lifecycle.registry
        source = "serve.models" if service.settings.models else service.settings.model_source
        cards = []
        for name in registry.names():
            m = registry.models[name]
            cards.append({"id": name, "object": "model", "created": m.created, "owned_by": "verl-suite",
                          "root": m.base, "parent": m.base if m.kind == "adapter" else None,
                          "max_model_len": m.engine.max_model_len, "source": source,  # never a local path
                          "kind": "chat"})
        for name, scorer in service.lifecycle.scorers.items():
            cards.append({"id": name, "object": "model", "created": scorer.created, "owned_by": "verl-suite",
                          "root": name, "parent": None, "max_model_len": scorer.max_model_len, "source": source,
                          "kind": "reward"})
        for route in registry.routes:
            cards.append({"id": route, "object": "model", "created": service.created, "owned_by": "verl-suite",
                          "root": route, "parent": None, "max_model_len": service.lifecycle.engine.max_model_len,
                          "source": "serve.routes", "kind": "chat"})
        return {"object": "list", "data": cards}

    @router.get("/v1/models/{model_id}", response_model=ModelCard, dependencies=protected, responses=ERROR_RESPONSES,
             tags=["openai"])
    async def model(model_id: str) -> dict:
        """One served model or route by id (OpenAI's retrieve-model); an unknown id is a 404."""
        for card in (await models())["data"]:
            if card["id"] == model_id:
                return card
        raise ApiError(404, f"The model '{model_id}' does not exist", type="not_found_error", param="model",
                       code="model_not_found")

    @router.post("/v1/completions", dependencies=protected, tags=["openai"],
              responses={200: {"model": CompletionResponse, **SSE_DOC}, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI-compatible text completion (``prompt`` may be text, texts, token ids or lists of them)."""
        return await create_completion(service, body, request)

    @router.post("/v1/chat/completions", dependencies=protected, tags=["openai"],
              responses={200: {"model": ChatCompletionResponse, **SSE_DOC}, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI-compatible chat completion (the model's chat template is applied)."""
        return await create_chat_completion(service, body, request)

    return router


def native_router(service: Service) -> APIRouter:
    """The simple /generate and the tokenizer utilities."""
    router = APIRouter()
    protected = [Depends(require_api_key)]

    @router.post("/generate", response_model=GenerateResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["simple"])
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        """The tutorial-style endpoint: raw prompt in, generated text out (greedy unless ``temperature`` > 0); served
        by the `default` route when there is one, else the first model."""
        target = service.admission.target(None, request.headers.get(USER_HEADER))
        engine = target.model.engine
        prompts = await asyncio.to_thread(encode_texts, engine, [body.prompt])
        max_tokens = plan_tokens(service, engine, prompts, body.max_new_tokens, "max_new_tokens", "prompt")
        temperature = body.temperature if body.temperature > 1e-5 else 0.0
        sampling = SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, seed=body.seed,
                                   stop=list(body.stop or []))
        request_id = f"gen-{uuid.uuid4().hex}"
        service.admission.admit(1, target, request_id)
        [result] = await run_to_completion(service, request, request_id, [SequenceSpec(0, 0, prompts[0], sampling)],
                                           target)
        return JSONResponse({"response": "".join(result.text), "finish_reason": result.finish_reason,
                             "prompt_tokens": len(prompts[0]), "completion_tokens": result.tokens},
                            headers=target.headers())


    @router.post("/inference/v1/generate", dependencies=protected, responses=ERROR_RESPONSES, tags=["simple"])
    async def generate_tokens(body: TokenGenerateRequest, request: Request) -> JSONResponse:
        """vLLM's token-in, token-out generation: the prompt's ids in; per choice the sampled ``token_ids`` and, with
        ``sampling_params.logprobs``, their log-probs (named ``token_id:<id>``, as vLLM's
        ``return_tokens_as_token_ids`` names them). Nothing is rendered or re-tokenized."""
        if body.stream:
            raise ApiError(400, "'stream' is not supported on /inference/v1/generate by this server; send false",
                           param="stream", code="unsupported_parameter")
        completion = token_completion(body)
        target = pick_target(service, completion, request)
        engine = target.model.engine
        max_tokens = plan_tokens(service, engine, [body.token_ids], completion.max_tokens, "sampling_params.max_tokens",
                                 "token_ids")
        specs = sequence_specs(engine, [body.token_ids], completion, max_tokens)
        record_token_logprobs(specs, target)
        request_id = body.request_id or f"gen-{uuid.uuid4().hex}"
        service.admission.admit(len(specs), target, request_id)
        results = await run_to_completion(service, request, request_id, specs, target)
        choices = [{"index": spec.index, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    "logprobs": None if completion.logprobs is None else {"content": [
                        {"token": f"token_id:{e.token_id}", "logprob": e.logprob,
                         "top_logprobs": [{"token": f"token_id:{t}", "logprob": v} for t, v in e.top]}
                        for e in r.logprobs]}} for spec, r in zip(specs, results, strict=True)]
        return JSONResponse({"request_id": request_id, "model": target.name, "choices": choices,
                             "prompt_logprobs": None, "usage": usage_block(len(body.token_ids), results)},
                            headers=target.headers())

    @router.post("/tokenize", response_model=TokenizeResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["utility"])
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a raw prompt, or of chat messages after the chat template."""
        engine = service.admission.ready_engine()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise ApiError(400, "'messages' must not be empty", param="messages")
            ids = await asyncio.to_thread(chat_prompt, engine, body.messages, body.add_generation_prompt)
        else:
            ids = (await asyncio.to_thread(encode_texts, engine, [body.prompt]))[0] if body.prompt else []
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @router.post("/detokenize", response_model=DetokenizeResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["utility"])
    async def detokenize(body: DetokenizeRequest) -> dict:
        engine = service.admission.ready_engine()
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return router


def scoring_router(service: Service) -> APIRouter:
    """Reward models on vLLM's pooling API: /classify (also /v1/classify, as SGLang names it) and /pooling."""
    router = APIRouter()
    protected = [Depends(require_api_key)]

    @router.post("/classify", response_model=ClassificationResponse, dependencies=protected,
                 responses=ERROR_RESPONSES, tags=["scoring"])
    async def classify(body: ScoreRequest) -> dict:
        """Score texts, token ids or a conversation with a reward model: per input the class probabilities (a
        reward model's one class: the probability its answer is preferred) or, with use_activation=false, logits."""
        return await score_request(service, body, "classify")

    router.add_api_route("/v1/classify", classify, methods=["POST"], response_model=ClassificationResponse,
                         dependencies=protected, responses=ERROR_RESPONSES, tags=["scoring"], include_in_schema=False)

    @router.post("/pooling", response_model=PoolingResponse, dependencies=protected, responses=ERROR_RESPONSES,
                 tags=["scoring"])
    async def pooling(body: ScoreRequest) -> dict:
        """vLLM's pooling endpoint for reward models: per input its pooled output, the head's values."""
        return await score_request(service, body, "pooling")

    return router


def feedback_router(service: Service) -> APIRouter:
    """Users' feedback on answers (serve/feedback.py)."""
    router = APIRouter()

    @router.post("/v1/feedback", response_model=FeedbackResponse, responses=ERROR_RESPONSES, tags=["feedback"],
                 dependencies=[Depends(require_api_key)])
    async def feedback(body: FeedbackRequest, request: Request) -> FeedbackResponse:
        """Score an answer: ``{"id": "<the completion's id>", "score": 0.0-1.0}`` or ``"thumbs": "up" | "down"``,
        optional ``comment``, ``source`` and ``index``. Recorded once per answer and source, for as long as the
        records are kept (records_retention_s); read back as rewards with ``reward_source: feedback``."""
        given = request.headers.get("authorization")
        key = ("key:" + hashlib.sha256(given.encode()).hexdigest()[:16] if given
               else "addr:" + (request.client.host if request.client else "?"))
        return await take_feedback(service, body, key)

    return router


async def create_completion(service: Service, body: CompletionRequest, request: Request) -> Response:
    """OpenAI-compatible text completion (``prompt`` may be text, texts, token ids or lists of them)."""
    check_unsupported(body)
    target = pick_target(service, body, request)
    engine = target.model.engine
    prompts = await asyncio.to_thread(completion_prompts, engine, body.prompt)
    if len(prompts) > service.settings.max_prompts_per_request:
        raise ApiError(400, f"{len(prompts)} prompts in one request; the limit is "
                       f"{service.settings.max_prompts_per_request}", param="prompt")
    if body.n > service.settings.max_n:
        raise ApiError(400, f"'n' is {body.n}; this server allows at most {service.settings.max_n}", param="n")
    max_tokens = plan_tokens(service, engine, prompts, body.max_tokens, "max_tokens", "prompt")
    specs = sequence_specs(engine, prompts, body, max_tokens)
    record_token_logprobs(specs, target)
    prompt_tokens = sum(len(p) for p in prompts)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    echoes = echo_texts(engine, body.prompt, prompts) if body.echo else None
    text_of = token_texts(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    service.admission.admit(len(specs), target, request_id)
    if body.stream:
        started: dict[int, CompletionLogprobs] = {}
        base = {"id": request_id, "object": "text_completion", "created": created, "model": target.name}

        def chunk(index: int, text: str, out: EngineOutput | None) -> dict | None:
            spec = specs[index]
            first = index not in started
            logprobs = started.setdefault(index, CompletionLogprobs(text_of))
            block = None
            if echoes is not None and first:
                text = echoes[spec.prompt_index] + text
                if body.logprobs is not None and out is not None:
                    block = logprobs.block(spec.prompt_ids, out.prompt_logprobs or [None] * len(spec.prompt_ids))
            if out is not None and out.logprobs and body.logprobs is not None:
                more = logprobs.block(out.token_ids, out.logprobs)
                block = more if block is None else {k: block[k] + more[k] for k in block}
            if not text and block is None and not (out and out.finished) and not (body.return_token_ids and first):
                return None
            choice = {"index": index, "text": text, "logprobs": block,
                      "finish_reason": out.finish_reason if out else None}
            if out is not None and out.finished:
                choice["stop_reason"] = out.stop_reason
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids if out is not None else []
                if first:
                    choice["prompt_token_ids"] = spec.prompt_ids
            return {**base, "choices": [choice]}

        return stream_response(service, request_id, specs, prompt_tokens, chunk, [], body.stream_options, base, target)
    results = await run_to_completion(service, request, request_id, specs, target)
    choices = []
    for spec, r in zip(specs, results, strict=True):
        text, block = "".join(r.text), None
        if body.logprobs is not None:
            ids, entries = r.token_ids, r.logprobs
            if echoes is not None:
                ids = [*spec.prompt_ids, *ids]
                entries = [*(r.prompt_logprobs or [None] * len(spec.prompt_ids)), *entries]
            block = CompletionLogprobs(text_of).block(ids, entries)
        if echoes is not None:
            text = echoes[spec.prompt_index] + text
        choices.append({"index": spec.index, "text": text, "logprobs": block, "finish_reason": r.finish_reason,
                        "stop_reason": r.stop_reason,
                        **({"prompt_token_ids": spec.prompt_ids, "token_ids": r.token_ids}
                           if body.return_token_ids else {})})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": target.name,
                         "choices": choices, "usage": usage_block(prompt_tokens, results)}, headers=target.headers())


async def create_chat_completion(service: Service, body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI-compatible chat completion (the model's chat template is applied)."""
    check_unsupported(body)
    target = pick_target(service, body, request)
    plan = plan_request(body)
    if body.model is None and uses_tools(body.messages, plan) and not renders_tools(target.model.engine.tokenizer):
        target = tool_model_target(service, body, request) or target
    engine = target.model.engine
    if body.n > service.settings.max_n:
        raise ApiError(400, f"'n' is {body.n}; this server allows at most {service.settings.max_n}", param="n")
    if plan.grammar is not None and engine.grammar_problem:
        raise ApiError(400, engine.grammar_problem,
                       param="response_format" if body.response_format is not None else "tool_choice")
    prompt = await asyncio.to_thread(chat_prompt, engine, body.messages, body.add_generation_prompt, plan)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = plan_tokens(service, engine, [prompt], requested, param, "messages")
    specs = sequence_specs(engine, [prompt], body, max_tokens, plan.grammar)
    target.plan = plan
    record_token_logprobs(specs, target)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    text_of = token_texts(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    service.admission.admit(len(specs), target, request_id)
    if body.stream:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": target.name}

        splitters = {s.index: ToolCallStream(plan) for s in specs} if plan.parses_calls else {}

        def chunk(index: int, text: str, out: EngineOutput | None) -> dict | None:
            block = chat_logprobs(out.logprobs, text_of) if out is not None and out.logprobs and body.logprobs else None
            finished = out is not None and out.finished
            splitter = splitters.get(index)
            deltas = splitter.feed(text, final=finished) if splitter else ([{"content": text}] if text else [])
            if not deltas and block is None and not finished and not (body.return_token_ids and out and out.token_ids):
                return None
            delta: dict = {}
            for part in deltas:  # content first, then the calls that finished in this piece of text
                if "content" in part:
                    delta["content"] = delta.get("content", "") + part["content"]
                else:
                    delta.setdefault("tool_calls", []).extend(part["tool_calls"])
            finish = out.finish_reason if finished else None
            if finish == "stop" and splitter is not None and splitter.calls:
                finish = "tool_calls"
            choice = {"index": index, "delta": delta, "logprobs": block, "finish_reason": finish}
            if finished:
                choice["stop_reason"] = out.stop_reason
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids if out is not None else []
            return {**base, "choices": [choice]}

        # vLLM's shape: the rendered prompt's ids on the first chunk, each chunk's sampled ids on its choice.
        first = {"prompt_token_ids": prompt} if body.return_token_ids else {}
        preamble = [{**base, **(first if s.index == 0 else {}), "choices": [{
            "index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} for s in specs]
        return stream_response(service, request_id, specs, len(prompt), chunk, preamble, body.stream_options, base,
                               target)
    results = await run_to_completion(service, request, request_id, specs, target)
    choices = []
    for i, r in enumerate(results):
        message, finish = response_message("".join(r.text), r.finish_reason, plan)
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(r.logprobs, text_of) if body.logprobs else None,
                        "finish_reason": finish, "stop_reason": r.stop_reason,
                        **({"token_ids": r.token_ids} if body.return_token_ids else {})})
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": target.name,
                         "choices": choices, "usage": usage_block(len(prompt), results),
                         **({"prompt_token_ids": prompt} if body.return_token_ids else {})},
                        headers=target.headers())


USER_HEADER = "X-Verl-User"
# vLLM's SamplingParams fields that /inference/v1/generate takes (the completion request's, under their names).
TOKEN_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids",
                         "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "logit_bias")


def token_completion(body: TokenGenerateRequest) -> CompletionRequest:
    """The completion request a token-in request amounts to; its sampling params checked as the completion's are
    (a 400 naming ``sampling_params.<field>``), and a vLLM field not served here refused by name."""
    params = body.sampling_params
    unknown = sorted(set(params) - set(TOKEN_SAMPLING_FIELDS))
    if unknown:
        raise ApiError(400, f"sampling_params.{unknown[0]} is not supported by this server (supported: "
                       f"{', '.join(TOKEN_SAMPLING_FIELDS)})", param=f"sampling_params.{unknown[0]}",
                       code="unsupported_parameter")
    try:
        return CompletionRequest(model=body.model, prompt=body.token_ids, **params)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", "sampling_params", *e["loc"])} for e in exc.errors()
                                      if e["loc"][:1] != ("prompt",)] or exc.errors()) from None


def renders_tools(tokenizer: Any) -> bool:
    """Whether chats with tools can be rendered for this tokenizer (its own template, or the Hermes one)."""
    try:
        tool_chat_template(tokenizer)
    except ConfigError:
        return False
    return True


def tool_model_target(service: Service, body: ChatCompletionRequest, request: Request) -> Responder | None:
    """For a tool-calling request that names no model while the default model cannot render tools: the first
    served model that can (the default service serves builtin:tiny-agent for this), else None."""
    for name in service.lifecycle.registry.names():
        model = service.lifecycle.registry.models[name]
        if model.kind == "model" and renders_tools(model.engine.tokenizer):
            target = service.admission.target(name, body.user or request.headers.get(USER_HEADER), body.verl,
                                              prompt_as_sent(body))
            target.episode = training_episode(service, body, request)
            return target
    return None


def pick_target(service: Service, body: CompletionRequest | ChatCompletionRequest, request: Request) -> Responder:
    """The model that answers: ``body.model`` (a model or a route; none: the default), sticky per ``user`` (else
    the ``X-Verl-User`` header); training traffic is marked with its episode (``training_episode``)."""
    episode = training_episode(service, body, request)
    target = service.admission.target(body.model, body.user or request.headers.get(USER_HEADER), body.verl,
                                      prompt_as_sent(body))
    target.episode = episode
    return target


SESSION_HEADER = "X-Session-ID"  # verifiers' and prime-rl's clients send the episode (rollout) id in it


def training_episode(service: Service, body: CompletionRequest | ChatCompletionRequest, request: Request) -> str | None:
    """The episode id when this request is training traffic: the training key (``training_api_key``) and an episode
    id (``X-Session-ID`` or ``verl.episode_id``), else None. ``verl.episode_id`` without the training key is a 403,
    the training key without an episode id a 400; ``X-Session-ID`` alone is a user's session, not training."""
    given = request.headers.get("authorization", "")
    keyed = given.lower().startswith("bearer ") and is_training_key(service.settings, given[7:].strip())
    marked = body.verl.episode_id if body.verl is not None else None
    episode = marked or request.headers.get(SESSION_HEADER) or None
    if marked is not None and not keyed:
        raise ApiError(403, "verl.episode_id marks training traffic, which needs the training key (the service's "
                       "training_api_key) as 'Authorization: Bearer <key>'", param="verl.episode_id",
                       type="permission_error", code="training_key_required")
    if keyed and episode is None:
        raise ApiError(400, f"training traffic needs an episode id: the '{SESSION_HEADER}' header or verl.episode_id",
                       param="verl.episode_id", code="episode_id_required")
    return episode if keyed else None


def record_token_logprobs(specs: list[SequenceSpec], target: Responder) -> None:
    """Training traffic's records keep each sampled id's log-prob: ask the engine for them (the response shows them
    only when the client asked)."""
    if target.episode is not None:
        for spec in specs:
            if spec.sampling.logprobs is None:
                spec.sampling.logprobs = 0


def prompt_as_sent(body: CompletionRequest | ChatCompletionRequest) -> Any:
    """What the records keep of a request's prompt (with record_texts): the chat messages as JSON objects (without
    unset fields), or the completion prompt."""
    if isinstance(body, ChatCompletionRequest):
        return [m.model_dump(exclude_none=True) for m in body.messages]
    return body.prompt
