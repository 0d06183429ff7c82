"""Tokenizer and chat template of a Hugging Face model folder (no `transformers` needed).

Reads `tokenizer.json` (the `tokenizers` library), `tokenizer_config.json`
(special tokens), the chat template wherever transformers would find it
(pdserve.server.chat_template), `config.json` and `generation_config.json`
(context length, end-of-sequence ids).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer as HFTokenizer

from pdserve.server.chat_template import (
    ChatTemplateError,
    Templates,
    compile_template,
    load_chat_template,
    plain_messages,
    select_template,
)

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplateError", "Tokenizer", "byte_piece_ids"]

log = logging.getLogger(__name__)

# Used when the model ships no chat template (transformers would refuse): ChatML.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the named special tokens transformers passes to every template (when set)
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(tok: object) -> str | None:
    """tokenizer_config.json holds special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def byte_piece_ids(hf: HFTokenizer) -> frozenset[int]:
    """Ids a run of byte-fallback pieces is made of, for a tokenizer whose model falls back
    to bytes (SentencePiece-style BPE): `<0x00>` .. `<0xFF>`, and the special tokens,
    which decoding skips, so bytes on both sides of one join into one run. Empty for
    any other tokenizer."""
    if not getattr(hf.model, "byte_fallback", False):
        return frozenset()
    ids = {hf.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    ids |= {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return frozenset(i for i in ids if i is not None)


def _as_id_list(v: object) -> list[int]:
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v] if isinstance(v, list) else []


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None) -> None:
        """`chat_template`: a Jinja file that replaces the model's chat template(s)."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():  # the library's own error names no file
            raise FileNotFoundError(
                f"{d}: no tokenizer.json (a model folder needs its fast tokenizer)"
            )
        self.hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        self.byte_piece_ids = byte_piece_ids(self.hf)  # the detokenizer holds their runs
        tcfg = _read_json(d / "tokenizer_config.json")
        mcfg = _read_json(d / "config.json")
        gcfg = _read_json(d / "generation_config.json")
        self.model_config = mcfg  # config.json as read (architectures, model_type, ...)
        legacy = _read_json(d / "special_tokens_map.json")
        self.special_tokens = {
            name: tok
            for name in SPECIAL_TOKEN_NAMES
            if (tok := _token_content(tcfg.get(name, legacy.get(name)))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token", "")
        self.eos_token = self.special_tokens.get("eos_token", "")
        self.vocab_size: int = int(mcfg.get("vocab_size") or self.hf.get_vocab_size())
        self.max_position_embeddings: int | None = mcfg.get("max_position_embeddings")
        self.eos_token_ids = self._eos_ids(mcfg, gcfg)
        templates = load_chat_template(d)
        if chat_template is not None:
            templates = Path(chat_template).read_text(encoding="utf-8")
        elif templates is None:
            log.warning("%s has no chat template; chat requests use ChatML", d)
            templates = DEFAULT_CHAT_TEMPLATE
        self.chat_templates: Templates = templates
        self._compiled = {t: compile_template(t) for t in _all_templates(templates)}

    def _eos_ids(self, mcfg: dict[str, Any], gcfg: dict[str, Any]) -> list[int]:
        ids = _as_id_list(gcfg.get("eos_token_id")) + _as_id_list(mcfg.get("eos_token_id"))
        tid = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        if tid is not None:
            ids.append(tid)
        return sorted(set(ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def added_token_id(self, text: str) -> int | None:
        """The id of `text` where the vocabulary holds it as one added token, else None."""
        return next((i for i, t in self.hf.get_added_tokens_decoder().items() if t.content == text), None)  # fmt: skip

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages (each with "role" and "content") as transformers'
        `apply_chat_template(..., tokenize=False)` does; `kwargs` reach the template."""
        template = self._compiled[select_template(self.chat_templates, tools is not None)]
        try:
            return template.render(
                messages=plain_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


def _all_templates(templates: Templates) -> list[str]:
    return [templates] if isinstance(templates, str) else list(templates.values())
