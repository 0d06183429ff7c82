"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = llama`) tokenize exactly as
transformers' tokenizer built from the same file: Llama-2 style (merges in the file or
rebuilt from scores) and Gemma style (spaces normalized, merges rebuilt in file order),
on a small vocabulary the test makes and on Gemma 3's own 262,144 pieces; the built
tokenizer.json streams through the detokenizer like its one-shot decode."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import gguf_sp_reference as sp_reference
import pytest
from gguf_sp_files import write_sentencepiece_gguf

from pdserve.checkpoints import wheels as model_wheels
from pdserve.checkpoints.gguf import convert as gguf_convert
from pdserve.checkpoints.gguf import tokenizer as gguf_tokenizer
from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.tokenizer import byte_piece_ids

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space",
    "trailing spaces   ", "  two  spaces,   three,    four.", "a\tb\t\tc", "\n", "\n\nx\n\n\ny",
    "line one\r\nline two", "Numbers: 3.14159, 2718, 1,000,000, -42, 0x1F, 1e-9.",
    "def add(a, b):\n    return a + b  # sum\n", "for i in range(10):\n\tprint(i * 2)",
    "Café, naïve, résumé, Ærøskøbing, straße, Ωμέγα, Привет.", "日本語のテキスト、中文。",
    "emoji 😀 👍🏽 🇫🇷 🎉 🦀!", "a\u00a0b\u200bc", "<s> and </s> and <unk> inline",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<|user|>hey<|end|>",
    "", " ", "x" * 40 + " " * 9 + "y",
]  # fmt: skip


def _ours(path: Path):
    meta = gguf_convert.read_metadata(gguf.GGUFReader(str(path)))
    return meta, gguf_tokenizer.build_tokenizer(meta)


def _assert_same(meta, ours, theirs: dict) -> None:
    """`ours` against transformers' answers (tests/gguf_sp_reference.py's `facts`)."""
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special).ids
            assert ids == theirs["ids"][text][str(special)], (text, special)
        for skip in (True, False):
            assert (
                ours.decode(ids, skip_special_tokens=skip) == theirs["decoded"][text][str(skip)]
            ), (text, skip)
    cfg = gguf_convert.tokenizer_config(meta, 256)
    assert cfg["add_bos_token"] is theirs["add_bos_token"]
    for name in sp_reference.NAMED:
        assert cfg[name] == theirs["named"][name], name
    mine, hf = json.loads(ours.to_str()), theirs["backend"]
    assert mine["model"] == hf["model"]  # vocab, merges, byte fallback, unknown token
    for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert mine[part] == hf[part], part
    key = lambda a: (a["id"], a["content"], a["special"], a["normalized"])  # noqa: E731
    assert sorted(map(key, mine["added_tokens"])) == sorted(map(key, hf["added_tokens"]))


@pytest.mark.parametrize(
    "arch, kw",
    [("llama", {"merges": True}), ("llama", {}), ("gemma3", {}), ("gemma2", {}),
     ("llama", {"add_bos": False, "space_prefix": False}),  # no BOS; a flag only llama.cpp reads
     ("llama", {"add_bos": None})],  # no flag: a SentencePiece vocabulary adds BOS
)  # fmt: skip
def test_small_vocabulary_equals_transformers(tmp_path, arch, kw):
    path = write_sentencepiece_gguf(tmp_path / f"sp-{arch}.gguf", arch, **kw)
    meta, ours = _ours(path)
    _assert_same(meta, ours, sp_reference.facts(sp_reference.load(path), TEXTS))
    # the vocabulary really is exercised: byte fallback and the space marker both occur
    pieces = ours.encode("crab 🦀 and  spaces").tokens
    assert any(p.startswith("<0x") for p in pieces) and any("\u2581" in p for p in pieces)


def _streamed(decode, ids: list[int], held: frozenset[int]) -> str:
    d = IncrementalDetokenizer(decode, held)
    return "".join(d.add([i]) for i in ids) + d.flush()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_detokenizer_streams_sentencepiece_one_token_at_a_time(tmp_path, arch):
    tok = gguf_tokenizer.build_tokenizer(
        gguf_convert.read_metadata(
            gguf.GGUFReader(str(write_sentencepiece_gguf(tmp_path / "sp.gguf", arch)))
        )
    )

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    for text in TEXTS:
        ids = tok.encode(text).ids  # with BOS, as a prompt would be
        assert _streamed(decode, ids, byte_piece_ids(tok)) == decode(ids), text


def test_gemma3_vocabulary_equals_transformers():
    """Gemma 3 270M's own vocabulary (262,144 pieces, no merges in the file): most of the
    time is gguf's reader on the 262,144 strings; transformers' answers are made once
    and cached (tests/gguf_sp_reference.py)."""
    spec = model_wheels.GEMMA3_270M
    if model_wheels._installed_chunk(*spec.parts[0]) is None:
        pytest.skip(f"Gemma 3 wheels not installed: {spec.install_hint()}")
    path = model_wheels.assembled_gguf(spec)
    meta, ours = _ours(path)
    _assert_same(meta, ours, sp_reference.cached_facts(path, spec.sha256, TEXTS))
    assert ours.get_vocab_size() == 262144

    def decode(ids: list[int]) -> str:
        return ours.decode(ids, skip_special_tokens=True)

    for text in TEXTS:
        ids = ours.encode(text).ids
        assert _streamed(decode, ids, byte_piece_ids(ours)) == decode(ids), text


def test_converted_folder_tokenizes_like_transformers(tmp_path, monkeypatch):
    """The served folder (tokenizer.json, tokenizer_config.json, config.json) as pdserve's
    frontend reads it: prompts with BOS, special tokens, EOS ids."""
    import transformers

    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.server.tokenizer import Tokenizer

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf", "llama", weights=True)
    ours = Tokenizer(resolve_model(str(path)).path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_ids == [theirs.eos_token_id] and ours.bos_token == "<s>"
