"""Streamed detokenization with a SentencePiece-style tokenizer (Metaspace `▁` spaces,
the first token's leading space dropped) and skipped special tokens: whatever the ids and
however they are split into chunks, the streamed text equals the one-shot decode."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.tokenizer import byte_piece_ids

SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = ["hello world", "the quick brown fox", "héllo wörld café", "日本語 のテキスト",
          "a b c d e", "jumps over the lazy dog", "emoji 😀 ok"] * 20  # fmt: skip


@cache
def sp_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )  # the Llama-2 / Mistral SentencePiece decoder chain
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + byte_tokens)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def decode(ids: list[int]) -> str:
    return sp_tokenizer().decode(ids, skip_special_tokens=True)


def streamed(ids: list[int], cuts: list[int]) -> str:
    d = IncrementalDetokenizer(decode)
    out, i = [], 0
    for k in cuts:
        out.append(d.add(ids[i : i + k]))
        i += k
    out.append(d.add(ids[i:]))
    return "".join(out) + d.flush()


def test_special_token_between_words_keeps_the_space() -> None:
    tok = sp_tokenizer()
    hello, world = tok.token_to_id("▁hello"), tok.token_to_id("▁world")
    bos = tok.token_to_id("<s>")
    assert None not in (hello, world, bos)
    ids = [hello, bos, world]
    assert decode(ids) == "hello world"
    assert streamed(ids, [1, 1, 1]) == "hello world"


ids_st = st.lists(st.integers(0, 399), max_size=24)


@settings(max_examples=300, deadline=None)
@given(ids=ids_st, cuts=st.lists(st.integers(0, 4), max_size=12))
def test_streamed_text_equals_one_shot_decode(ids: list[int], cuts: list[int]) -> None:
    assert streamed(ids, cuts) == decode(ids)


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.sampled_from(CORPUS[:7]), min_size=1, max_size=4),
       specials=st.lists(st.sampled_from([0, 1, 2]), max_size=6), seed=st.integers(0, 99))  # fmt: skip
def test_text_with_special_tokens_streams_like_one_shot(words, specials, seed) -> None:
    ids = sp_tokenizer().encode(" ".join(words), add_special_tokens=False).ids
    for j, s in enumerate(specials):  # special tokens spliced in anywhere
        pos = (seed * 31 + j * 17) % (len(ids) + 1)
        ids.insert(pos, s)
    assert streamed(ids, [1] * len(ids)) == decode(ids)


@cache
def gemma_style_tokenizer() -> Tokenizer:
    """A Gemma-style vocabulary rebuilt from a GGUF the way pdserve converts one (spaces
    normalized to ▁, nothing stripped, byte fallback, control and user-defined tokens)."""
    import tempfile
    from pathlib import Path

    import gguf
    from gguf_sp_files import write_sentencepiece_gguf

    from pdserve.checkpoints.gguf import convert as gguf_convert
    from pdserve.checkpoints.gguf import tokenizer as gguf_tokenizer

    with tempfile.TemporaryDirectory() as d:
        path = write_sentencepiece_gguf(Path(d) / "g.gguf", "gemma3")
        meta = gguf_convert.read_metadata(gguf.GGUFReader(str(path)))
    return gguf_tokenizer.build_tokenizer(meta)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 599), max_size=24), cuts=st.lists(st.integers(0, 4), max_size=12)
)
def test_gemma_style_streamed_text_equals_one_shot_decode(ids, cuts) -> None:
    tok = gemma_style_tokenizer()
    ids = [i % tok.get_vocab_size() for i in ids]  # ids a model of this vocabulary emits

    def gdecode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True)

    d = IncrementalDetokenizer(gdecode, byte_piece_ids(tok))
    out, i = [], 0
    for k in cuts:
        out.append(d.add(ids[i : i + k]))
        i += k
    out.append(d.add(ids[i:]))
    assert "".join(out) + d.flush() == gdecode(ids)
