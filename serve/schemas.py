"""Request and response bodies: OpenAI-compatible completions/chat, the simple ``/generate``, errors.

Field names, defaults and shapes follow the OpenAI API (and vLLM's extensions ``top_k``, ``ignore_eos``,
``stop_token_ids``) so the official ``openai`` client and tools built on it work unchanged. Unknown fields are
rejected (400 naming the field) rather than ignored: a misspelt ``max_token`` must not silently become the default.
Fields OpenAI documents that do not change the result here (``store``, ``metadata``, ``service_tier`` ...) are
accepted and ignored. Parameters that exist in the OpenAI API but are not implemented here are accepted only at
their neutral value and otherwise answered with a 400 that says so.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

# Strict bools and ints: `"stream": "yes"` or `"n": 1.5` are client bugs worth a 400, not something to coerce.
TokenId = Annotated[StrictInt, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        """JSON may carry ``"\\ud800"``, which no tokenizer can encode: a 400 naming the field, not a 500."""
        bad = _first_unencodable(data)
        if bad is not None:
            raise ValueError(f"'{bad}' is not valid Unicode text (a lone UTF-16 surrogate such as \\ud800); "
                             "send UTF-8 text")
        return data


def _first_unencodable(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in ``value`` that cannot be UTF-8 encoded, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "text"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _first_unencodable(key) is not None:
            return f"{path}.{key!r}".lstrip(".")
        found = _first_unencodable(item, f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------- shared sampling fields


class StreamOptions(_Strict):
    include_usage: StrictBool = Field(False, description="Send a last chunk with `usage` and empty `choices`.")
    continuous_usage_stats: StrictBool = Field(
        False, description="vLLM's extension: with `include_usage`, every chunk also carries `usage` (the choice's "
                           "prompt and completion tokens so far). GuideLLM asks for it by default.")


class VerlExtension(_Strict):
    """The ``verl`` field of a completion or chat request (with the openai client: ``extra_body={"verl": ...}``)."""

    ground_truth: str | int | float | None = Field(
        None, description="The expected answer; the response is scored against it (none: no rule reward).")
    reward: str = Field("gsm8k", max_length=64, description="A registered rule reward (gsm8k, arithmetic, math, "
                        "exact_match) applied to the response text.")
    prompt_id: str | None = Field(None, max_length=256, description="Names the prompt for pairing across models "
                                  "(default: a hash of the prompt tokens).")
    not_for_training: bool = Field(False, description="Never export this request or its answer for training "
                                   "(`verl data from-records` leaves it out).")
    episode_id: str | None = Field(None, min_length=1, max_length=256, description="Training traffic: the episode "
                                   "this call belongs to (as the `X-Session-ID` header); needs the training key.")


class _SamplingFields(_Strict):
    model: str | None = Field(None, description="Model id from /v1/models (optional: this server serves one model).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="vLLM extension: keep the k most likely tokens (-1 or 0: all).")
    n: StrictInt = Field(1, ge=1, description="Completions per prompt.")
    stop: str | list[str] | None = Field(None, description="Up to 16 strings; generation stops before the first match.")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension: token ids that end generation.")
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63,
                                   description="Makes sampling reproducible (completion i uses seed + i); int64.")
    stream: StrictBool = Field(False, description="Server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = Field(False, description="vLLM extension: keep generating past the end-of-text token.")
    return_token_ids: StrictBool = Field(False, description="vLLM extension: the response carries the prompt's ids "
                                         "as rendered (`prompt_token_ids`) and each choice's sampled ids "
                                         "(`token_ids`), so a client can train on them without re-tokenizing.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from the logit of every "
                                    "token already generated.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit per time "
                                     "it was generated.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM extension: divides positive (multiplies "
                                      "negative) logits of tokens in the prompt or output; 1 = off.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100] "
                                                "added to its logit before sampling.")
    user: str | None = Field(None, max_length=256, description="Opaque end-user id: keeps one user on one variant "
                             "of a route (hashed, never logged or stored).")
    verl: VerlExtension | None = Field(None, description="verl extension: score the response with a rule reward, "
                                       "recorded per model for the online A/B report.")
    # OpenAI fields that do not change what this server generates: accepted and ignored (docs/serving.md).
    store: StrictBool | None = Field(None, description="Ignored: this server stores no completions.")
    metadata: dict[str, str] | None = Field(None, description="Ignored: tags for OpenAI's stored completions.")
    service_tier: str | None = Field(None, description="Ignored: one tier here.")
    parallel_tool_calls: StrictBool | None = Field(None, description="Chat with tools: allow several calls in one "
                                                   "turn (default true). Ignored by /v1/completions.")
    reasoning_effort: str | None = Field(None, description="Ignored: for reasoning models; ours answer directly.")
    prompt_cache_key: str | None = Field(None, description="Ignored: prefix caching needs no key here.")
    safety_identifier: str | None = Field(None, description="Ignored: an opaque end-user id, like `user`.")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops


# ---------------------------------------------------------------- /v1/completions


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="Text, a list of texts, token ids, or a list of token-id lists."
    )
    max_tokens: StrictInt | None = Field(None, ge=1, description="Tokens to generate at most (default: server's).")
    echo: StrictBool = Field(False, description="Return the prompt before the completion (with its tokens' "
                             "log-probs when `logprobs` is set; the first token has none).")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Log-prob of each generated token and of the "
                                       "k most likely alternatives (raw model distribution).")
    best_of: StrictInt | None = Field(None, ge=1, description="Not implemented: only null/1 is accepted.")
    suffix: str | None = Field(None, description="Not implemented: only null is accepted.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: str | int | None = Field(None, description="The stop string or token id that ended the choice.")
    prompt_token_ids: list[int] | None = Field(None, description="With `return_token_ids`: the prompt's ids.")
    token_ids: list[int] | None = Field(None, description="With `return_token_ids`: the sampled ids.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- /v1/chat/completions


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON string (OpenAI's transport).")


class MessageToolCall(_Strict):
    """A call in an assistant message of the history (what an earlier response returned)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="Assistant messages: the calls it made.")
    tool_call_id: str | None = Field(None, description="Tool messages: the call this is the result of.")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content or [])


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="a-z, A-Z, 0-9, _ and -, at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: StrictBool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="Tokens to generate at most.")
    add_generation_prompt: StrictBool = Field(True, description="vLLM extension: end the prompt with the "
                                              "assistant header so the model answers.")
    logprobs: StrictBool = Field(False, description="Return the log-prob of each generated token.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="With `logprobs`: also the k most likely "
                                           "alternatives at each position.")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema: the "
                                                   "JSON ones are guaranteed by constrained decoding.")
    tools: list[ToolDefinition] | None = Field(None, max_length=128, description="Functions the model may call "
                                               "(the client runs them).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required (at least one call, guaranteed), or "
        "{type: function, function: {name}} (that call, guaranteed).")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # required by OpenAI's schema (null: this server never refuses)
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # required by OpenAI's schema


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(None, description="With `return_token_ids`: the sampled ids.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="With `return_token_ids`: the rendered prompt's "
                                               "ids (the chat template applied).")


# ---------------------------------------------------------------- /generate (the tutorial-style endpoint)


class GenerateRequest(_Strict):
    prompt: str = Field(..., min_length=1, description="Raw text (no chat template applied).")
    max_new_tokens: StrictInt | None = Field(None, ge=1, description="Tokens to generate at most (default: server's).")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 (default) = greedy, as model.generate does.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None
    stop: list[str] | None = Field(None, max_length=16)


class TokenGenerateRequest(_Strict):
    """vLLM's token-in, token-out ``POST /inference/v1/generate`` (what verifiers' and prime-rl's clients call)."""

    model: str | None = Field(None, description="Model id from /v1/models (optional).")
    token_ids: list[TokenId] = Field(..., min_length=1, description="The prompt's ids, as the client rendered them.")
    sampling_params: dict[str, Any] = Field(default_factory=dict, description="vLLM's SamplingParams fields: "
                                            "max_tokens, temperature, top_p, top_k, n, seed, stop, stop_token_ids, "
                                            "ignore_eos, logprobs, penalties, logit_bias.")
    stream: StrictBool = Field(False, description="Only false: token-in, token-out answers are whole.")
    request_id: str | None = Field(None, max_length=256, description="Echoed back; one is made up when absent.")


class GenerateResponse(BaseModel):
    response: str = Field(..., description="The generated text (without the prompt).")
    finish_reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    completion_tokens: int


# ---------------------------------------------------------------- models, tokenize, version, health


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verl-suite"
    root: str
    parent: str | None = Field(None, description="A LoRA adapter's base model (vLLM's field); null otherwise.")
    max_model_len: int
    source: str = Field(description="Where the served model was chosen: env VERL_SERVE_MODEL, a serve.yaml, "
                        "an argument, or default (the built-in model).")
    kind: Literal["chat", "reward"] = Field("chat", description="chat: answers completions and chat "
                                            "completions; reward: scores texts on /classify and /pooling.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Strict):
    prompt: str | None = Field(None, description="Raw text to tokenize.")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages (the chat template is applied).")
    add_generation_prompt: StrictBool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Strict):
    tokens: list[TokenId] = Field(..., max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
    engine: str
    model: str


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "draining", "dead"]
    engine: str | None = None
    detail: str | None = None
    model: str | None = Field(None, description="The served model's id.")
    model_source: str | None = Field(None, description="Where the model was chosen (env, serve.yaml, default).")
    version: int | None = Field(None, description="The models-and-routes version this process serves.")
    replicas: int | None = Field(None, description="verl serve --replicas: live replicas (those polling the "
                                 "control plane).")
    replica_versions: list[int] | None = Field(None, description="The versions the live replicas serve (one "
                                               "entry once a change has reached all of them).")


# ---------------------------------------------------------------- reward models (vLLM's pooling API)


class ScoreRequest(_Strict):
    """vLLM's classification / pooling request: texts or token ids in ``input``, or a conversation in ``messages``
    (rendered as the prompt through the chat template, then the last assistant message's text)."""

    model: str | None = Field(None, description="A reward model (kind: reward); default: the first one served.")
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = Field(
        None, description="A text, texts, token ids, or lists of token ids: one score each.")
    messages: list[ChatMessage] | None = Field(None, description="One conversation to score (its last message the "
                                               "assistant answer being judged).")
    user: str | None = None
    use_activation: StrictBool | None = Field(None, description="Sigmoid (one class) or softmax (several) on the "
                                              "logits; default true. false: the raw logits.")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="Keep only the last N tokens of each input.")
    add_special_tokens: StrictBool | None = Field(None, description="Add the tokenizer's special tokens to texts "
                                                  "(default: true for `input`, false for `messages`).")
    priority: int = Field(0, description="Accepted for vLLM compatibility; requests are scored in arrival order.")
    encoding_format: Literal["float"] | None = Field(None, description="/pooling: only float lists.")
    task: Literal["classify"] | None = Field(None, description="/pooling: the pooling task (reward models "
                                             "classify).")


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float] = Field(description="Per class: probabilities (or logits with use_activation=false).")
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: ScoreUsage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float]


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: ScoreUsage


class FeedbackRequest(_Strict):
    """A user's verdict on one answer (``POST /v1/feedback``): a score in [0, 1] or thumbs up (1) / down (0)."""

    id: str = Field(..., min_length=1, max_length=128, description="The completion's `id`, as the response gave it.")
    index: StrictInt = Field(0, ge=0, description="The choice index (requests with n > 1).")
    score: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description="The score, 0 (bad) to 1 "
                                "(good); give this or `thumbs`.")
    thumbs: Literal["up", "down"] | None = Field(None, description="Thumbs up (score 1) or down (score 0).")
    comment: str | None = Field(None, description="Free text (at most feedback_max_comment_chars characters).")
    source: str = Field("user", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$",
                        description="Who gives it (a UI, a labelling team): one feedback per answer per source.")

    @model_validator(mode="after")
    def _one_verdict(self) -> FeedbackRequest:
        if (self.score is None) == (self.thumbs is None):
            raise ValueError("give either 'score' (0.0 to 1.0) or 'thumbs' ('up' or 'down'), exactly one of them")
        return self

    @property
    def value(self) -> float:
        return self.score if self.score is not None else (1.0 if self.thumbs == "up" else 0.0)


class FeedbackResponse(BaseModel):
    object: Literal["feedback"] = "feedback"
    id: str
    index: int
    source: str
    score: float = Field(description="The score recorded (thumbs: 1 or 0).")
    model: str | None = Field(description="The model that gave the answer.")
    duplicate: bool = Field(description="This feedback had been recorded before (sending it again changes nothing).")
