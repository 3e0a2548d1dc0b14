"""A random-weight checkpoint that chats as Qwen3.5 does: the bundled model's BPE vocabulary plus
Qwen's added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`, `<tool_call>`, ...), and a
chat template in the format of Qwen3.5's (ChatML turns, tools as JSON lines in the system turn,
calls as `<tool_call><function=...><parameter=...>` blocks, tool results as `<tool_response>`
in a user turn, a generation prompt that opens `<think>` unless `enable_thinking` is false).
Tests of tool calls and reasoning use it; its weights are random, so its text is not language.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

BUNDLED_TOKENIZER = Path(__file__).resolve().parent.parent / "bundled" / "tokenizer.json"
# (text, special): as in Qwen's tokenizers, the markers of reasoning and tool calls are not special
ADDED_TOKENS = [("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False), ("</think>", False),
                ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
                ("</tool_response>", False)]

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}{%- for part in content -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:'
        '\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1'
        '\\n</parameter>\\n</function>\\n</tool_call>' -}}
    {%- if first_system -%}{{- '\\n\\n' + text(messages[0].content) -}}{%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- elif first_system -%}
    {{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first -%}{{- '\\n' -}}{%- elif text(message.content) -%}{{- '\\n\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n<function=' + fn.name + '>\\n' -}}
            {%- for key, value in (fn.arguments or {}).items() -%}
                {{- '<parameter=' + key + '>\\n' -}}
                {{- value if value is string else (value | tojson) -}}
                {{- '\\n</parameter>\\n' -}}
            {%- endfor -%}
            {{- '</function>\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}
        {{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def chat_tokenizer() -> dict:
    """The bundled tokenizer.json with ADDED_TOKENS after its vocabulary."""
    tokenizer = json.loads(BUNDLED_TOKENIZER.read_text())
    base = len(tokenizer["model"]["vocab"])
    tokenizer["added_tokens"] += [{"id": base + i, "content": text, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": special}
                                  for i, (text, special) in enumerate(ADDED_TOKENS)]
    return tokenizer


def write_chat_model(path: str | Path, seed: int = 0, mtp: bool = True, **config_overrides) -> Path:
    """A tiny random checkpoint at `path` with the chat tokenizer and template; `<|im_end|>` and
    `<|endoftext|>` end the text."""
    path = Path(path)
    tokenizer = chat_tokenizer()
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    config = tiny_config(vocab_size=len(tokenizer["model"]["vocab"]) + len(ADDED_TOKENS),
                         eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], **config_overrides)
    write_random_checkpoint(path, config, seed=seed, dtype=torch.float32, mtp=mtp)
    write_chat_files(path, tokenizer)
    return path


def write_chat_files(path: str | Path, tokenizer: dict | None = None) -> None:
    """The chat tokenizer (tokenizer.json) and template (tokenizer_config.json) into the folder `path`:
    a checkpoint's weights beside them then chat in Qwen3.5's format (bench/gpu.sh: the 9B-class
    weights, whose prompts then split at the added tokens as a real Qwen3.5's do)."""
    path = Path(path)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or chat_tokenizer()))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE}, indent=1))
