"""Tokenizer and chat template of a Hugging Face model folder (no `transformers` needed).

Reads `tokenizer.json` (the `tokenizers` library), `tokenizer_config.json`
(chat template, special tokens), `config.json` and `generation_config.json`
(context length, end-of-sequence ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Used when the model ships no chat template: ChatML.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(tok: object) -> str | None:
    """tokenizer_config.json holds special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_id_list(v: object) -> list[int]:
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v] if isinstance(v, list) else []


def _chat_template(cfg: dict[str, Any]) -> str:
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else DEFAULT_CHAT_TEMPLATE


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        tcfg = _read_json(d / "tokenizer_config.json")
        mcfg = _read_json(d / "config.json")
        gcfg = _read_json(d / "generation_config.json")
        self.model_config = mcfg  # config.json as read (architectures, model_type, ...)
        self.bos_token = _token_content(tcfg.get("bos_token")) or ""
        self.eos_token = _token_content(tcfg.get("eos_token")) or ""
        self.vocab_size: int = int(mcfg.get("vocab_size") or self.hf.get_vocab_size())
        self.max_position_embeddings: int | None = mcfg.get("max_position_embeddings")
        self.eos_token_ids = self._eos_ids(mcfg, gcfg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(_chat_template(tcfg))

    def _eos_ids(self, mcfg: dict[str, Any], gcfg: dict[str, Any]) -> list[int]:
        ids = _as_id_list(gcfg.get("eos_token_id")) + _as_id_list(mcfg.get("eos_token_id"))
        tid = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        if tid is not None:
            ids.append(tid)
        return sorted(set(ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render messages (each with "role" and "content") ending in the assistant prompt."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)
