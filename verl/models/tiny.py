"""The built-in tiny models: character-level Llamas that are normal Hugging Face models in every respect.

``build_char_tokenizer()`` makes a ``PreTrainedTokenizerFast`` over printable ASCII plus bos/eos/pad/unk and
chat-role tokens, with a chat template, so ``apply_chat_template``, ``save_pretrained`` and
``AutoTokenizer.from_pretrained`` all work as for any hub model. ``build_tiny_model()`` makes a randomly
initialised ``LlamaForCausalLM`` sized by a ``TinySpec``.

The agent models (``TinySpec(tools=True)``: ``builtin:tiny-agent-base`` and its warm start ``builtin:tiny-agent``)
add a ``<|tool|>`` role and the Hermes tags (``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``) as whole tokens, a 512-character context, and a chat template that renders tools compactly
(``tools: calculator(expression)``): a JSON schema of a few hundred characters would not leave a character-level
model room for the conversation. Tool calls themselves are written in full Hermes form.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
TOOL_ROLE_TOKENS = ["<|tool|>"]
# Whole tokens, but not special: decoding with skip_special_tokens keeps them, so a turn's text still parses.
TOOL_TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Every printable ASCII character plus newline and tab: the task, the chat template and gsm8k-style
# answers (`#### 42`, `>> 42`, `$1,234.`) must all be representable without <unk>.
CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]

# One turn per message; the assistant turn ends with eos so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The agent models' template: tools as one compact line, calls in full Hermes form, tool results as `tool` turns.
# A newline after a block tag is an expression (nl): Hugging Face renders with trim_blocks.
AGENT_CHAT_TEMPLATE = (
    "{% set nl = '\n' %}{{ bos_token }}"
    "{% if tools %}<|system|>tools: {% for tool in tools %}"
    "{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ f['name'] }}({{ ((f.get('parameters') or {}).get('properties') or {}) | list | join(', ') }})"
    "{% if not loop.last %}; {% endif %}{% endfor %}{{ nl }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call['function'] if 'function' in call else call %}"
    "<tool_call>{{ nl }}{\"name\": {{ function['name'] | tojson }}, \"arguments\": "
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}"
    "{% endif %}}{{ nl }}</tool_call>{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<|tool|>{{ message['content'] }}{{ nl }}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}{{ nl }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of a built-in Llama. Defaults: ~1M parameters (hidden 128, 4 layers)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tools: bool = False  # the agent vocabulary and template (tool role, Hermes tags)


# Named specs reachable as ``builtin:<name>``; the ``tiny-arith`` warm start is trained from ``tiny-arith-base``.
BUILTIN_SPECS: dict[str, TinySpec] = {
    "tiny-arith-base": TinySpec(),
    # ~25M parameters: big enough that engines, not Python overhead, dominate (benchmarks).
    "small-arith-base": TinySpec(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                                 intermediate_size=1536),
    # The tool-using agent's initialisation: room for a call, its result and the answer (builtin:tiny-agent).
    "tiny-agent-base": TinySpec(max_position_embeddings=512, tools=True),
}


def build_char_tokenizer(model_max_length: int = 256, tools: bool = False) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character, special tokens matched whole; with ``tools``
    the agent vocabulary and template (see the module docstring)."""
    special = SPECIAL_TOKENS + (TOOL_ROLE_TOKENS if tools else [])
    tags = TOOL_TAG_TOKENS if tools else []
    vocab = {tok: i for i, tok in enumerate(special + tags + CHARACTERS)}
    # BPE with no merges over a character vocabulary is exactly a character tokenizer, and it
    # serialises to a standard tokenizer.json that every HF-compatible runtime (vLLM included) reads.
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.add_special_tokens(special)
    if tags:
        backend.add_tokens(tags)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        unk_token=UNK,
                                        additional_special_tokens=ROLE_TOKENS + (TOOL_ROLE_TOKENS if tools else []),
                                        model_max_length=model_max_length, padding_side="left",
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return tokenizer


def build_spec_tokenizer(spec: TinySpec) -> PreTrainedTokenizerFast:
    """The tokenizer a built-in spec's model is made with."""
    return build_char_tokenizer(spec.max_position_embeddings, tools=spec.tools)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, spec: TinySpec | None = None,
                     seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` (fp32) whose special-token ids match ``tokenizer``."""
    spec = spec or TinySpec()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                         num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                         num_key_value_heads=spec.num_key_value_heads, intermediate_size=spec.intermediate_size,
                         max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, max_new_tokens=32, do_sample=False)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
