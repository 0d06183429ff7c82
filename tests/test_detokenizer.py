"""Incremental detokenization (UTF-8 split across tokens) and stop strings across chunks."""

from __future__ import annotations

import random

import pytest
from fake_engine import make_model_dir

from pdserve.server.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from pdserve.server.tokenizer import Tokenizer

TEXTS = [
    "plain ascii text, nothing special",
    "héllo wörld — naïve café",
    "emoji 😀🎉 and family 👨‍👩‍👧 mixed with 中文字符 and ✓",
    "🙂",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(make_model_dir(tmp_path_factory.mktemp("model")))


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok.decode)
    out, i = [], 0
    for k in chunk_sizes:
        out.append(d.add(ids[i : i + k]))
        i += k
    out.append(d.add(ids[i:]))
    out.append(d.flush())
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_text_and_never_emits_broken_utf8(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_characters_really_are_split_across_tokens(tok):
    # guards the test above: with this small vocabulary an emoji spans several tokens
    ids = tok.encode("😀")
    assert len(ids) > 1
    assert "\ufffd" in tok.decode(ids[:1])


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_gives_the_same_text(tok, seed):
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    rng = random.Random(seed)
    sizes = [rng.randint(0, 4) for _ in range(len(ids) // 2)]
    pieces = stream(tok, ids, sizes)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok):
    ids = tok.encode("ok 😀")
    d = IncrementalDetokenizer(tok.decode)
    assert d.add(ids[:-1]) == "ok "
    assert d.flush() == "\ufffd"


def test_special_tokens_are_skipped(tok):
    eos = tok.hf.token_to_id("<|endoftext|>")
    d = IncrementalDetokenizer(tok.decode)
    text = d.add(tok.encode("done")) + d.add([eos]) + d.flush()
    assert text == "done"


def feed_all(stop: list[str], chunks: list[str]) -> tuple[str, str | None]:
    m = StopMatcher(stop)
    out = "".join(m.feed(c) for c in chunks)
    return out + m.flush(), m.matched


@pytest.mark.parametrize(
    "chunks",
    [["hello STOP world"], ["hello ST", "OP world"], ["hello S", "T", "O", "P", " world"]],
)
def test_stop_string_found_across_chunk_boundaries(chunks):
    assert feed_all(["STOP"], chunks) == ("hello ", "STOP")


def test_stop_prefix_is_held_back_then_released():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "  # "ST" may start STOP
    assert m.feed("art") == "STart"  # it did not
    assert m.matched is None


def test_earliest_of_several_stop_strings_wins():
    assert feed_all(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", "lo w")


def test_no_match_flushes_held_text():
    assert feed_all(["STOP"], ["the end ST"]) == ("the end ST", None)


def test_nothing_after_a_match():
    m = StopMatcher(["x"])
    assert m.feed("abxcd") == "ab"
    assert m.feed("more") == ""
    assert m.flush() == ""


def test_stop_string_inside_multibyte_stream(tok):
    text = "café 😀 END more"
    ids = tok.encode(text)
    d, m = IncrementalDetokenizer(tok.decode), StopMatcher(["😀 END"])
    out = "".join(m.feed(d.add([t])) for t in ids)
    assert (out, m.matched) == ("café ", "😀 END")


@pytest.mark.parametrize("text", TEXTS)
def test_text_stream_without_stops_equals_one_shot_decode(tok, text):
    ids = tok.encode(text)
    s = TextStream(tok.decode, tok.byte_piece_ids)
    out = "".join(s.step([t], last=False) for t in ids) + s.step([], last=True)
    assert (out, s.matched) == (tok.decode(ids), None)


def test_text_stream_cuts_at_a_stop_and_releases_a_held_prefix_at_the_end(tok):
    ids = tok.encode("café 😀 END more")
    s = TextStream(tok.decode, tok.byte_piece_ids, ["😀 END"])
    out = "".join(s.step([t], last=False) for t in ids)
    assert (out, s.matched) == ("café ", "😀 END")
    assert s.step(tok.encode(" later"), last=True) == ""  # nothing after a match
    held = TextStream(tok.decode, tok.byte_piece_ids, ["STOP"])
    assert held.step(tok.encode("the end ST"), last=False) == "the end "  # may start STOP
    assert (held.step([], last=True), held.matched) == ("ST", None)  # the sample ended
