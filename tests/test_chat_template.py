"""Chat prompts rendered like transformers' `apply_chat_template(tokenize=False)` on
the same folder: template sources in transformers' order, and the same Jinja
environment (loop controls, strftime_now, tojson, namespace, raise_exception)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.server.tokenizer import ChatTemplateError, Tokenizer
from tests.conftest import model_path

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEMPLATES = {
    # SmolLM2-Instruct's shape: a default system prompt when the chat has none
    "smollm2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" + SMOL_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # loopcontrols, whitespace control (trim_blocks / lstrip_blocks), bos_token
    "continue": (
        "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}"
        "{% endif %}\n  [{{ m.role | upper }}] {{ m.content }}\n{% if loop.index > 3 %}"
        "{% break %}{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    ),
    # Llama-3.2 style date line, namespace, dict, generation tag
    "date-namespace": (
        "{% set ns = namespace(n=0) %}Today: {{ strftime_now('%d %b %Y') }}\n"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
        "{{ dict(count=ns.n) | tojson }}{{ eos_token }}"
    ),
    # tools through tojson: no HTML escaping, non-ASCII kept, indent; tool_calls
    "tools": (
        "{% if tools is not none %}TOOLS {{ tools | tojson(indent=2) }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content | default('') }}"
        "{% if m.tool_calls is defined %} CALLS {{ m.tool_calls | tojson }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    ),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "météo",
            "description": "Weather <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": 'Ünïcödé ✓ 你好 <tag> & "quotes"'},
        {"role": "assistant", "content": "Sure.", "tool_calls": None},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Last"},
    ],
]


def _folder(root: Path, name: str) -> Path:
    """The tiny preset's tokenizer files in a fresh folder."""
    path = root / name
    path.mkdir()
    src = model_path("tiny")
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / f, path / f)
    return path


def _saved_by_transformers(root: Path, name: str, template: str) -> Path:
    """transformers 5 writes the template to chat_template.jinja."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_path("tiny"))
    tok.chat_template = template
    path = root / name
    tok.save_pretrained(path)
    assert (path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    shutil.copy(model_path("tiny") / "config.json", path / "config.json")
    return path


def _hf(path: Path, chat: list[dict[str, Any]], tokenize: bool = False, **kw: Any) -> Any:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(chat, tokenize=tokenize, add_generation_prompt=True, **kw)
    return list(out["input_ids"]) if tokenize and not isinstance(out, list) else out


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_like_transformers(tmp_path: Path, name: str) -> None:
    path = _saved_by_transformers(tmp_path, name, TEMPLATES[name])
    ours = Tokenizer(path)
    for chat in CHATS:
        tools = TOOLS if name == "tools" else None
        want = _hf(path, chat, tools=tools)
        text = ours.apply_chat_template(chat, tools=tools)
        assert text == want
        # the server's prompt ids (pdserve.server.openai_routes.chat_prompt_ids)
        assert ours.encode(text, add_special_tokens=False) == _hf(
            path, chat, tokenize=True, tools=tools
        )
    if name == "smollm2":
        assert SMOL_SYSTEM in ours.apply_chat_template(CHATS[0])


def test_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    path = _folder(tmp_path, "both")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "CONFIG {{ messages[0].content }}"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(path).apply_chat_template(CHATS[0]) == _hf(path, CHATS[0])
    (path / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    got = Tokenizer(path).apply_chat_template(CHATS[0])
    assert got == _hf(path, CHATS[0]) == "JINJA Hi there"


def test_named_templates_pick_tool_use_with_tools(tmp_path: Path) -> None:
    path = _folder(tmp_path, "named")
    (path / "chat_template.jinja").write_text("DEFAULT {{ messages | length }}")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | length }}")
    ours = Tokenizer(path)
    assert ours.apply_chat_template(CHATS[0]) == _hf(path, CHATS[0]) == "DEFAULT 1"
    got = ours.apply_chat_template(CHATS[0], tools=TOOLS)
    assert got == _hf(path, CHATS[0], tools=TOOLS) == "TOOLS 1"


def test_list_of_named_templates_in_tokenizer_config(tmp_path: Path) -> None:
    path = _folder(tmp_path, "listed")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(path)
    assert ours.apply_chat_template(CHATS[1]) == _hf(path, CHATS[1]) == "D6"
    assert ours.apply_chat_template(CHATS[1], tools=TOOLS) == _hf(path, CHATS[1], tools=TOOLS)


def test_legacy_chat_template_json_is_the_last_resort(tmp_path: Path) -> None:
    path = _folder(tmp_path, "legacy")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.json").write_text(
        json.dumps({"chat_template": "LEGACY {{ bos_token }}"})
    )
    assert Tokenizer(path).apply_chat_template(CHATS[0]) == "LEGACY <|bos|>"


def test_raise_exception_and_sandbox(tmp_path: Path) -> None:
    path = _folder(tmp_path, "raising")
    (path / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{% set ns = namespace() %}{% set ns._x = 1 %}ok"
    )
    ours = Tokenizer(path)
    with pytest.raises(ChatTemplateError, match="first must be user"):
        ours.apply_chat_template(CHATS[1])
    with pytest.raises(Exception, match="_x"):
        ours.apply_chat_template(CHATS[0])
