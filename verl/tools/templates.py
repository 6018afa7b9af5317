"""Chat templates that render tools, and conversations as token ids built turn by turn (token-in, token-out).

**Which template.** A tokenizer whose own chat template renders ``tools`` keeps it. One that does not (SmolLM2's
renders no tools) gets ``HERMES_TOOL_TEMPLATE``, the project's documented ChatML template in the Hermes 2 Pro
style: the tools' JSON schemas inside ``<tools></tools>`` in the system turn, the assistant's calls as
``<tool_call>`` blocks, tool results as ``tool`` turns holding ``<tool_response>`` blocks. Training, ``verl eval``
and the service use the same choice (``tool_chat_template``), as vLLM's ``--chat-template`` would. It needs a
ChatML vocabulary (``<|im_start|>``/``<|im_end|>``); another model names a template of its own
(``rollout.multi_turn.chat_template``).

**Token-in, token-out.** A trajectory's ids are the prompt's, then what the model generated, then for each tool
turn only the ids the template adds for it, computed from the template once (``ConversationTokens``). Generated
text is never decoded and re-tokenized: the same text can tokenize differently from how it was sampled, and the
policy loss must score the tokens the policy actually drew (verl's AgentLoop documentation makes the same point).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.tools.calls import format_assistant_turn
from verl.tools.registry import ToolSet, build_tool_set

# Written without whitespace-control dashes; a newline that must follow a block tag is an expression ({{ nl }}),
# since Hugging Face renders templates with trim_blocks (the first newline after a block tag is dropped).
HERMES_TOOL_TEMPLATE = (
    "{% set nl = '\n' %}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions are given in JSON Schema inside <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n"
    "For each call, write a JSON object with the function name and its arguments inside <tool_call></tool_call> "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>{{ nl }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call['function'] if 'function' in call else call %}"
    "<tool_call>\n{\"name\": {{ function['name'] | tojson }}, \"arguments\": "
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}"
    "{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ nl }}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>tool\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>{{ nl }}"
    "{% elif message['role'] != 'system' %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def renders_tools(template: str | None) -> bool:
    return isinstance(template, str) and "tools" in template


def tool_chat_template(tokenizer: Any, override: str | None = None) -> str:
    """The template tool conversations are rendered with: ``override`` (a template, or ``hermes``), the
    tokenizer's own when it renders tools, else ``HERMES_TOOL_TEMPLATE`` for a ChatML vocabulary."""
    if override:
        return HERMES_TOOL_TEMPLATE if override == "hermes" else override
    own = getattr(tokenizer, "chat_template", None)
    if renders_tools(own):
        return own
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return HERMES_TOOL_TEMPLATE
    raise ConfigError(
        "this tokenizer's chat template renders no tools and it has no ChatML tokens for the Hermes tool template; "
        "give a template that renders `tools` and `tool` messages (rollout.multi_turn.chat_template=PATH)"
    )


def load_template(value: str | None) -> str | None:
    """A ``chat_template`` setting: None, ``hermes``, or a path to a Jinja file (its text)."""
    if value is None or value == "hermes":
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"rollout.multi_turn.chat_template: file '{value}' does not exist (or use 'hermes')")
    return path.read_text()


@dataclass
class ToolPrompting:
    """What rendering prompts with tools needs: the configured tools and the template that renders them.
    ``template`` is the run's; a run without configured tools keeps the model's own (``tokenizer``'s), and
    ``template_for`` gives the tool template to the rows whose environment brings tools (an ``env:`` class)."""

    tool_set: ToolSet
    template: str
    tokenizer: Any = None
    override: str | None = None

    @classmethod
    def from_config(cls, multi_turn: Any, tokenizer: Any) -> ToolPrompting | None:
        """From ``rollout.multi_turn`` (None when multi-turn rollouts are off)."""
        if not multi_turn.enable:
            return None
        tool_set = build_tool_set(multi_turn.tools, multi_turn.tool_config_path)
        override = load_template(multi_turn.chat_template)
        own = getattr(tokenizer, "chat_template", None)
        if not tool_set.names() and not override and own:  # an environment without tools: the model's own turns
            return cls(tool_set, own, tokenizer, override)
        return cls(tool_set, tool_chat_template(tokenizer, override), tokenizer, override)

    def template_for(self, schemas: Sequence[dict[str, Any]] | None) -> str:
        """The template a conversation with ``schemas`` (its tools) renders with."""
        if not schemas or self.tool_set.names() or self.tokenizer is None:
            return self.template
        return tool_chat_template(self.tokenizer, self.override)


def as_openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` in the shape templates read (``content`` always a string)."""
    return [{**m, "content": m.get("content") or ""} for m in messages]


class ConversationTokens:
    """Token ids of a tool conversation, turn by turn, for one tokenizer, template and tool list.

    ``prompt_ids(messages)``: the conversation so far with the assistant's generation prompt;
    ``turn_ids(messages)``: for messages that follow an assistant turn the model ended with eos (tool results, or
    a user's reply), only the ids the template adds: what follows that eos, up to the next generation prompt.
    """

    MARK = "\u2063verl-turn\u2063"  # text no conversation contains

    def __init__(self, tokenizer: Any, template: str, tools: list[dict[str, Any]] | None = None):
        self.tokenizer, self.template, self.tools = tokenizer, template, tools or None
        self.eos = tokenizer.eos_token
        if not self.eos:
            raise ConfigError("multi-turn rollouts need a tokenizer with an eos token that ends assistant turns")
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.MARK}]
        text = self.render(probe, add_generation_prompt=False)
        end = text.find(self.MARK)
        if end < 0 or not text[end + len(self.MARK):].startswith(self.eos):
            raise ConfigError(f"the chat template does not end an assistant turn with the eos token '{self.eos}': "
                              "turns cannot be joined token by token")
        self._probe, self._prefix = probe, text[: end + len(self.MARK) + len(self.eos)]

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(as_openai_messages(messages), tools=self.tools,
                                                  chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def turn_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = self.render([*self._probe, *messages], add_generation_prompt=True)
        if not text.startswith(self._prefix):
            raise ConfigError("the chat template renders earlier turns differently once tool messages follow: "
                              "turns cannot be joined token by token")
        return self.encode(text[len(self._prefix):])

    def conversation(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a whole conversation built as the agent loop builds a trajectory: the prompt
        (everything before the first assistant turn), then each assistant turn as the model writes it
        (content, ``<tool_call>`` blocks, eos; mask 1), and the template's ids for the turns in between (mask 0).
        What supervised fine-tuning on tool-use demonstrations trains on."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ConfigError("a conversation to train on needs at least one assistant message")
        ids = self.prompt_ids(messages[:first])
        mask = [0] * len(ids)
        i = first
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                turn = self.encode(assistant_text(messages[i])) + [self.tokenizer.eos_token_id]
                ids += turn
                mask += [1] * len(turn)
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            between = self.turn_ids(messages[i:j]) if j < len(messages) else []  # nothing after the last answer
            ids += between
            mask += [0] * len(between)
            i = j
        return ids, mask


def assistant_text(message: dict[str, Any]) -> str:
    """An assistant message as the model writes it: content, then its tool calls as Hermes blocks."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        calls.append((function["name"], arguments))
    return format_assistant_turn(message.get("content") or "", calls)
