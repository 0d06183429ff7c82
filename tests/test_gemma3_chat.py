"""Gemma 3's chat template rendered like transformers' `apply_chat_template`: the system
message folded into the first user turn, "assistant" spoken as "model", content given as
a string or as parts, and a conversation whose roles do not alternate refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.server.tokenizer import ChatTemplateError, Tokenizer
from tests.test_chat_template import _hf, _saved_by_transformers

# Gemma 3's own chat template (google/gemma-3-*-it, tokenizer_config.json): test data
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "  Which river flows through Paris?  "},
        {"role": "assistant", "content": "The Seine."},
        {"role": "user", "content": [{"type": "text", "text": "And through Rome?"}]},
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Ünïcödé ✓ 你好"}]},
    ],
]


def test_renders_like_transformers(tmp_path: Path) -> None:
    path = _saved_by_transformers(tmp_path, "gemma3", GEMMA3_TEMPLATE)
    ours = Tokenizer(path)
    for chat in CHATS:
        text = ours.apply_chat_template(chat)
        assert text == _hf(path, chat)
        assert ours.encode(text, add_special_tokens=False) == _hf(path, chat, tokenize=True)
    assert "<start_of_turn>user\nAnswer in one sentence.\n\nWhich river" in text_of(ours, 1)
    assert "<start_of_turn>model\nThe Seine.<end_of_turn>" in text_of(ours, 1)


def text_of(tok: Tokenizer, i: int) -> str:
    return tok.apply_chat_template(CHATS[i])


def test_roles_that_do_not_alternate_are_refused(tmp_path: Path) -> None:
    path = _saved_by_transformers(tmp_path, "gemma3-bad", GEMMA3_TEMPLATE)
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        Tokenizer(path).apply_chat_template(chat)
