"""SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model = "llama"`) as BPE.

llama.cpp stores a SentencePiece model as its pieces (ids are list positions), a score
per piece, a type per piece and, in newer files, the merges. transformers' GGUF loader
turns that into a byte-fallback BPE, and so does this module, part for part, so both
tokenize the same text to the same ids:

- Llama 2, Mistral, TinyLlama (every architecture but the Gemma family): `▁` marks a
  space, prepended to the first word only (Metaspace, "first"); the decoder maps `▁`
  back to spaces, joins byte-fallback pieces (`<0xE2>`) into UTF-8 and strips the one
  leading space it added.
- Gemma, Gemma 2, Gemma 3: spaces become `▁` in a normalizer, nothing is prepended and
  nothing stripped; pieces made only of spaces are stored as real spaces in the file
  and are spelled back with `▁`. The file has no merges: they are rebuilt from the
  vocabulary in file order (Gemma's scores do not follow its merge order).
- Merges missing from any other file are rebuilt the same way ranked by score.

Phi-3 (a different prefix-space rule) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # ▁, SentencePiece's visible space
GEMMA_FAMILY = ("gemma", "gemma2", "gemma3")
REFUSED_ARCHES = {"phi3": "Phi-3 prepends the space marker in a normalizer"}


class SentencePieceError(ValueError):
    """A SentencePiece GGUF vocabulary that cannot be rebuilt exactly."""


def rebuilt_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a piece into two pieces of the
    vocabulary, best-ranked piece first.

    Within one piece, splits go by the ids of their halves; across pieces, by rank, then
    by the lengths of the halves (longer first); ties keep the order of `rank`. This is
    the order transformers derives, so the BPE merges pieces in the same sequence.
    """
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        splits = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, score) for left, right in splits)
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # stable: ties keep their order
    return [(left, right) for left, right, _ in found]


def _file_merges(meta: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    out = []
    for m in raw:
        parts = str(m).split(" ")
        if len(parts) != 2:
            raise SentencePieceError(f"GGUF merge {m!r} is not two tokens")
        out.append((parts[0], parts[1]))
    return out


def gemma_spelling(tokens: list[str]) -> list[str]:
    """Gemma files store pieces of only whitespace that hold a space as real spaces;
    the BPE looks them up as `▁` runs of the same length."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def build(meta: Mapping[str, Any], tokens: list[str]) -> tuple[Tokenizer, list[str]]:
    """The BPE and the token spellings it uses (Gemma respells some), without added
    tokens or post-processor (gguf_tokenizer.py adds those for every vocabulary)."""
    arch = str(meta.get("general.architecture"))
    if arch in REFUSED_ARCHES:
        raise SentencePieceError(
            f"GGUF SentencePiece vocabulary of architecture {arch!r} is not supported "
            f"({REFUSED_ARCHES[arch]})"
        )
    gemma = arch in GEMMA_FAMILY
    spelled = gemma_spelling(tokens) if gemma else tokens
    vocab = {t: i for i, t in enumerate(spelled)}  # a repeated piece keeps its last id
    merges = None if gemma else _file_merges(meta)
    if merges is None:
        if gemma:
            rank: dict[str, float] = {t: -i for i, t in enumerate(spelled)}
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise SentencePieceError(
                    "GGUF SentencePiece vocabulary has neither tokenizer.ggml.merges nor a "
                    "tokenizer.ggml.scores entry per token"
                )
            rank = dict(zip(spelled, (float(s) for s in scores)))
        merges = rebuilt_merges(vocab, rank)
    try:
        bpe = models.BPE(
            vocab,
            merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token="<unk>" if gemma else None,
        )
    except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise SentencePieceError(f"GGUF tokenizer.ggml.merges: {e}") from e
    tok = Tokenizer(bpe)
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace(SPACE, " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return tok, spelled
