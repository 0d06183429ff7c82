"""A `tokenizers` tokenizer rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json; llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`,
ids are list positions), the BPE merges, a type per token (1 normal, 3 control, 4 user
defined) and a pre-tokenizer name (`tokenizer.ggml.pre`). Byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) is rebuilt here, SentencePiece (`"llama"`) in
gguf_sentencepiece.py, both as transformers' GGUF loader builds them; any other model
or an unknown pre-tokenizer name is refused: guessing would tokenize prompts
differently from the model's training and nothing would say so.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.checkpoints.gguf import sentencepiece as gguf_sentencepiece

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


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
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
    return tok


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by `meta` (GGUF key -> value, `tokenizer.ggml.*` keys).

    Control tokens become special added tokens (matched whole, skipped when decoding
    with skip_special_tokens); user-defined tokens become plain added tokens; the named
    BOS/EOS/unknown/padding tokens are special too, as transformers makes them.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise GGUFTokenizerError("GGUF tokenizer.ggml.tokens is missing or empty")
    if kind == "gpt2":
        tok, spelled = _byte_level(meta, tokens), tokens
    elif kind == "llama":
        try:
            tok, spelled = gguf_sentencepiece.build(meta, tokens)
        except gguf_sentencepiece.SentencePieceError as e:
            raise GGUFTokenizerError(str(e)) from None
    else:
        raise GGUFTokenizerError(
            f"GGUF tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2' "
            "byte-level BPE, 'llama' SentencePiece); convert the model to a Hugging Face "
            "folder (with tokenizer.json) and serve that"
        )
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # transformers adds a user-defined token only under its stored spelling (a Gemma
    # piece of spaces, respelled with ▁, is left to the BPE)
    known = set(spelled) | set(control)
    user = [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED and t in known]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    named = [special_token(meta, k) for k in ("bos", "eos", "unknown", "padding")]
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in dict.fromkeys(named)
            if t and t not in added
        ]
    )
    _add_bos_eos(tok, meta, tokens)
    return tok


def adds_bos(meta: dict[str, Any]) -> bool:
    """Whether encoding prepends BOS: the file's flag; a SentencePiece file without one
    does (llama.cpp's and transformers' default)."""
    flag = meta.get("tokenizer.ggml.add_bos_token")
    if flag is None:
        return meta.get("tokenizer.ggml.model") == "llama"
    return bool(flag)


def _add_bos_eos(tok: Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    """The add_bos/add_eos flags as transformers' post-processor (a pair repeats them;
    with neither flag it only sets the pair's type ids)."""
    bos = special_token(meta, "bos") if adds_bos(meta) else None
    eos = special_token(meta, "eos") if meta.get("tokenizer.ggml.add_eos_token") else None
    single = f"{bos}:0 $A:0" if bos else "$A:0"
    single += f" {eos}:0" if eos else ""
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    pieces = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=pieces
    )


def special_token(meta: dict[str, Any], key: str) -> str | None:
    """The text of special token `key` ("bos", "eos", "unknown", "padding"), if set."""
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if tid is None else str(meta["tokenizer.ggml.tokens"][int(tid)])
