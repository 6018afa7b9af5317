"""Turning a request body into sequences for the engine: unsupported-parameter and model checks, tokenization off the
event loop (prompts, chats, echo), token budgets, logit bias, sampling options."""

from __future__ import annotations

from typing import Any

from serve.engines.base import Engine, SamplingOptions
from serve.errors import ApiError
from serve.pumps import SequenceSpec
from serve.schemas import ChatCompletionRequest, CompletionRequest
from serve.service import Service
from serve.tool_calling import ToolPlan, template_messages, uses_tools
from verl.errors import ConfigError
from verl.tools.templates import tool_chat_template

SEED_MODULUS = 2**63  # torch generators take 64-bit seeds; seed + i for n > 1 must stay in range


def check_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Parameters of the OpenAI API we accept only at their neutral value: say so instead of ignoring them."""
    problems: dict[str, bool] = {}
    if isinstance(body, CompletionRequest):
        problems.update(best_of=(body.best_of or 1) > 1, suffix=body.suffix is not None)
    else:
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    for name, bad in problems.items():
        if bad:
            raise ApiError(400, f"'{name}' is not supported by this server; leave it unset", param=name,
                           code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed together with 'stream': true", param="stream_options")


# No tokenizer packs more characters than this into one token on ordinary text: a prompt longer than the context
# times this is rejected by its length alone, before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 32


def encode_texts(engine: Engine, texts: list[str], add_special_tokens: bool = True,
                  param: str = "prompt") -> list[list[int]]:
    """Token ids of ``texts``. Runs in a worker thread (``asyncio.to_thread``): never on the event loop."""
    if not texts:
        return []
    limit = engine.max_model_len * MAX_CHARS_PER_TOKEN
    longest = max(len(t) for t in texts)
    if longest > limit:
        raise ApiError(400, f"the prompt has {longest} characters; this model's context is {engine.max_model_len} "
                       f"tokens, so at most {limit} characters are looked at", param=param,
                       code="context_length_exceeded")
    return [list(ids) for ids in engine.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return encode_texts(engine, [prompt])
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return encode_texts(engine, list(prompt))
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


def echo_texts(engine: Engine, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """What ``echo`` repeats for each prompt: the text as sent, or the decoded ids (special tokens included) when
    ids were sent."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    # Special tokens stay: logprobs.tokens lists them, and text_offset must index into this text.
    return [engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def chat_prompt(engine: Engine, messages: list, add_generation_prompt: bool, plan: ToolPlan | None = None) -> list[int]:
    """The prompt's ids; with tools (or calls in the history) through a template that renders them: the model's
    own when it does, else the project's Hermes template for a ChatML vocabulary (``verl.tools.templates``)."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                       param="messages")
    plan = plan or ToolPlan()
    conversation = template_messages(messages, answering=add_generation_prompt)
    extra: dict[str, Any] = {}
    if uses_tools(messages, plan):
        try:
            extra["chat_template"] = tool_chat_template(tokenizer)
        except ConfigError:
            raise ApiError(400, "this model's chat template renders no tools or tool messages (and the model has "
                           "no ChatML tokens for the Hermes tool template); serve a tool-aware model such as "
                           "builtin:tiny-agent", param="tools" if plan.tools else "messages") from None
        extra["tools"] = plan.tools or None
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **extra)
    except Exception as exc:  # jinja TemplateError / raise_exception in the template: the messages are at fault
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    # The template already contains the special tokens (bos, role markers); do not add them twice.
    return encode_texts(engine, [text], add_special_tokens=False, param="messages")[0]


def plan_tokens(service: Service, engine: Engine, prompts: list[list[int]], requested: int | None,
                 param: str, prompt_param: str) -> int:
    """Check prompt lengths and token ids; return the ``max_tokens`` every sequence gets."""
    settings, context = service.settings, engine.max_model_len
    prompt_limit = min(settings.max_prompt_tokens or context - 1, context - 1)
    vocab = len(engine.tokenizer)
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", param=prompt_param)
        if len(ids) > prompt_limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {prompt_limit}",
                           param=prompt_param, code="context_length_exceeded")
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param=prompt_param)
    longest = max(len(ids) for ids in prompts)
    if requested is None:
        return max(1, min(settings.default_max_tokens, settings.max_output_tokens, context - longest))
    if requested > settings.max_output_tokens:
        raise ApiError(400, f"'{param}' is {requested}; this server allows at most {settings.max_output_tokens}",
                       param=param)
    if longest + requested > context:
        raise ApiError(400, f"this model's context is {context} tokens, but the request needs {longest + requested} "
                       f"({longest} in the prompt, {requested} in the completion); lower '{param}' or shorten the "
                       "prompt", param=param, code="context_length_exceeded")
    return requested


def logit_bias_ids(engine: Engine, given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` -> ``{id: bias}``, each id in the vocabulary and each bias in [-100, 100]."""
    out: dict[int, float] = {}
    vocab = len(engine.tokenizer)
    # ASCII digits only: '²' passes str.isdigit() but not int(). Every bad key is named, not just the first.
    bad = [key for key in (given or {}) if not (key.isascii() and key.isdigit()) or int(key) >= vocab]
    if bad:
        named = ", ".join(repr(k) for k in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ApiError(400, f"logit_bias key(s) {named} are not token ids of this model (0..{vocab - 1})",
                       param="logit_bias")
    for key, bias in (given or {}).items():
        if not -100.0 <= bias <= 100.0:
            raise ApiError(400, f"logit_bias for token {key} is {bias}; biases must be within [-100, 100]",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out


def sampling_options(body: Any, max_tokens: int, seed: int | None, logit_bias: dict[int, float],
                     grammar: str | None = None) -> SamplingOptions:
    temperature = body.temperature if body.temperature > 1e-5 else 0.0
    if isinstance(body, CompletionRequest):
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
    else:
        logprobs, prompt_logprobs = (body.top_logprobs or 0) if body.logprobs else None, None
    # top_k beyond any vocabulary (1e29 arrives as a huge int) keeps every token, as -1 does; never an overflow.
    top_k = body.top_k if 0 < body.top_k < 2**31 else -1
    return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=top_k, seed=seed,
                           stop=list(body.stop or []), stop_token_ids=list(body.stop_token_ids or []),
                           ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                           logit_bias=logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar)


def sequence_specs(engine: Engine, prompts: list[list[int]], body: Any, max_tokens: int,
                   grammar: str | None = None) -> list[SequenceSpec]:
    specs = []
    logit_bias = logit_bias_ids(engine, body.logit_bias)
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % SEED_MODULUS
            options = sampling_options(body, max_tokens, seed, logit_bias, grammar)
            specs.append(SequenceSpec(p * body.n + j, p, ids, options))
    return specs


