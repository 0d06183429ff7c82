"""A `tokenizers` tokenizer rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json; llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`,
ids are list positions), the BPE merges, a type per token (1 normal, 3 control, 4 user
defined) and a pre-tokenizer name (`tokenizer.ggml.pre`). Only byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) is rebuilt here; a SentencePiece vocabulary
(`"llama"`) or an unknown pre-tokenizer name is refused: guessing would tokenize
prompts differently from the model's training and nothing would say so.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# Split patterns of llama.cpp's pre-tokenizers (llama-vocab.cpp), by `tokenizer.ggml.pre`.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2}
# GPT-2's own split (ByteLevel's built-in regex); "smollm" first isolates every digit
# (SmolLM's tokenizer.json: Digits(individual_digits) then ByteLevel).
_GPT2_STYLE = ("default", "gpt2", "gpt-2", "smollm")


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer cannot be rebuilt exactly."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_STYLE:
        return byte_level
    known = sorted([*_SPLITS, *_GPT2_STYLE])
    raise GGUFTokenizerError(
        f"GGUF tokenizer.ggml.pre = {pre!r} is not supported (supported: {', '.join(known)})"
    )


def _merges(raw: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFTokenizerError(f"GGUF merge {m!r} is not two tokens")
        out.append((parts[0], parts[1]))
    return out


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by `meta` (GGUF key -> value, `tokenizer.ggml.*` keys).

    Control tokens become special added tokens (matched whole, skipped when decoding
    with skip_special_tokens); user-defined tokens become plain added tokens.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"GGUF tokenizer.ggml.model = {kind!r} is not supported: pdserve rebuilds "
            "byte-level BPE ('gpt2') tokenizers only; convert the model to a Hugging Face "
            "folder (with tokenizer.json) and serve that"
        )
    pre = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError("GGUF tokenizer.ggml.tokens holds duplicate tokens")
    try:
        bpe = models.BPE(vocab, _merges(list(meta.get("tokenizer.ggml.merges", []))))
    except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise GGUFTokenizerError(f"GGUF tokenizer.ggml.merges: {e}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == TOKEN_USER_DEFINED
        ]
    )
    _add_bos_eos(tok, meta, tokens)
    return tok


def _add_bos_eos(tok: Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    """llama.cpp's add_bos/add_eos flags as a post-processor (applied with special tokens)."""
    pieces: list[tuple[str, int]] = []
    single = "$A"
    if meta.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        bos = int(meta["tokenizer.ggml.bos_token_id"])
        pieces.append((tokens[bos], bos))
        single = f"{tokens[bos]} {single}"
    if meta.get("tokenizer.ggml.add_eos_token") and "tokenizer.ggml.eos_token_id" in meta:
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        pieces.append((tokens[eos], eos))
        single = f"{single} {tokens[eos]}"
    if pieces:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B", special_tokens=pieces
        )


def special_token(meta: dict[str, Any], key: str) -> str | None:
    """The text of special token `key` ("bos", "eos", "unknown", "padding"), if set."""
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if tid is None else str(meta["tokenizer.ggml.tokens"][int(tid)])
