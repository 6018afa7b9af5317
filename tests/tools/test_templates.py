"""Chat templates that render tools, and conversations built token by token (token-in, token-out)."""

from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from verl.errors import ConfigError
from verl.models.tiny import CHAT_TEMPLATE, build_char_tokenizer
from verl.tools.calculator import SCHEMA
from verl.tools.templates import HERMES_TOOL_TEMPLATE, ConversationTokens, tool_chat_template

CONVERSATION = [
    {"role": "user", "content": "What is 37*412?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "37*412"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "15244"},
    {"role": "assistant", "content": ">> 15244"},
]


def chatml_tokenizer(template: str | None = None) -> PreTrainedTokenizerFast:
    """A character tokenizer with ChatML's special tokens and no tool template (as SmolLM2's renders none)."""
    special = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special + [c for c in string.printable if c not in "\r\x0b\x0c"])}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(special)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>",
                                        bos_token=None)
    tokenizer.chat_template = template or ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                           "<|im_end|>\n{% endfor %}")
    return tokenizer


def test_a_chatml_model_without_a_tool_template_gets_the_hermes_one():
    tokenizer = chatml_tokenizer()
    template = tool_chat_template(tokenizer)
    assert template == HERMES_TOOL_TEMPLATE
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[SCHEMA], chat_template=template, tokenize=False)
    tool_json = ('{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
                 'expression (numbers, + - * / // % **, parentheses).", "parameters": {"type": "object", '
                 '"properties": {"expression": {"type": "string", "description": "e.g. 37*412"}}, "required": '
                 '["expression"], "additionalProperties": false}}}')
    assert text == (
        "<|im_start|>system\nYou are a function calling AI model. You may call one or more functions to assist with "
        "the user query. The functions are given in JSON Schema inside <tools></tools>:\n<tools>\n" + tool_json +
        "\n</tools>\nFor each call, write a JSON object with the function name and its arguments inside "
        "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhat is 37*412?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"37*412\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n15244\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n>> 15244<|im_end|>\n"
    )


def test_a_template_that_renders_tools_is_kept_and_others_are_refused_with_the_fix():
    own = build_char_tokenizer(512, tools=True)
    assert tool_chat_template(own) == own.chat_template
    assert tool_chat_template(own, "hermes") == HERMES_TOOL_TEMPLATE
    plain = build_char_tokenizer()  # tiny-arith: no tools in its template, no ChatML tokens
    assert plain.chat_template == CHAT_TEMPLATE
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.chat_template=PATH"):
        tool_chat_template(plain)


def test_the_tiny_agent_template_renders_tools_in_one_line():
    tokenizer = build_char_tokenizer(512, tools=True)
    text = tokenizer.apply_chat_template(CONVERSATION[:1], tools=[SCHEMA], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>tools: calculator(expression)\n<|user|>What is 37*412?\n<|assistant|>"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<tool_call>x</tool_call>", add_special_tokens=False)) \
        == ["<tool_call>", "x", "</tool_call>"]
    # Tool tags are whole tokens but not special: decoding without special tokens keeps them.
    ids = tokenizer.encode("<|tool|><tool_call>{}</tool_call>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


@pytest.mark.parametrize("make", [chatml_tokenizer, lambda: build_char_tokenizer(512, tools=True)])
def test_a_conversation_built_turn_by_turn_is_the_rendered_one(make):
    tokenizer = make()
    tokens = ConversationTokens(tokenizer, tool_chat_template(tokenizer), [SCHEMA])
    ids, mask = tokens.conversation(CONVERSATION)
    rendered = tokenizer.encode(tokens.render(CONVERSATION, add_generation_prompt=False), add_special_tokens=False)
    assert rendered[: len(ids)] == ids and len(rendered) - len(ids) <= 1  # at most a newline after the last eos
    learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    eos = tokenizer.eos_token
    assert learned == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*412"}}\n</tool_call>'
                       + eos + ">> 15244" + eos)
    # The tool turn alone: exactly what follows the assistant's eos, up to the next generation prompt.
    turn = tokens.turn_ids([CONVERSATION[2]])
    start = ids.index(tokenizer.eos_token_id, len(tokens.prompt_ids(CONVERSATION[:1]))) + 1
    assert ids[start : start + len(turn)] == turn and not any(mask[start : start + len(turn)])


def test_a_template_whose_assistant_turns_do_not_end_with_eos_cannot_join_turns():
    tokenizer = chatml_tokenizer("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                 "{{ tools }}")
    with pytest.raises(ConfigError, match="does not end an assistant turn with the eos token"):
        ConversationTokens(tokenizer, tokenizer.chat_template, [SCHEMA])
