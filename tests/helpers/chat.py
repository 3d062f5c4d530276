"""Chat templates written out in the tests, the way real models render tools and tool messages, and a
tiny chat model whose end-of-turn token is ChatML's ``<|im_end|>`` (its EOS), built locally."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5 / Hermes style: the tools' JSON schemas go into the system message inside <tools></tools>, the
# model calls them with <tool_call>{json}</tool_call>, each tool result is a <tool_response> block inside a
# `user` turn (consecutive tool messages share one turn). Prefix-preserving: an earlier turn always renders
# the same way whatever follows it.
QWEN_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3 style, reduced to what matters here: an assistant turn's <think>...</think> block is dropped once
# another message follows it. NOT prefix-preserving: adding a tool result rewrites the turn before it.
DROPS_THINK = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_chat(out: Path, tiny_gpt2: Path, template: str = QWEN_TOOLS) -> Path:
    """The tiny GPT-2's tokenizer with ChatML's ``<|im_start|>`` / ``<|im_end|>`` as special tokens
    (``<|im_end|>`` = EOS, as in SmolLM2 / Qwen) and ``template``, and a fresh 2-layer GPT-2 over it."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    return out
