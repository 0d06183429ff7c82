"""Incremental detokenization and stop-string matching for streamed output.

    token ids ──IncrementalDetokenizer──▶ complete characters ──StopMatcher──▶ text to emit

IncrementalDetokenizer: a byte-level BPE token can end in the middle of a UTF-8
character; decoding then yields U+FFFD. We decode a small window twice,

    ids:  [ ... prefix_offset ........ read_offset ........ len(ids) ]
                └── already emitted ──┘└── not yet emitted ─┘

and emit the new suffix except a trailing run of U+FFFD (an incomplete
character: its bytes are held back until the tokens completing it arrive).
The emitted context (prefix_offset..read_offset) always decodes to some text, so
tokens decoded after it are never treated as the start of the sequence.
`flush()` emits whatever is left at the end of the request.

Not tokenizers' `decoders.DecodeStream`: it streams most vocabularies the same way,
but raises on a SentencePiece byte-fallback run that turns invalid after a byte that
was valid alone ('A' <0xC3> ...: the one-shot decode makes the whole run U+FFFD), and it
has no flush, so an incomplete character at the end is lost. benchmarks/detokenize.py
compares the two.

StopMatcher: text is held back while its tail could be the start of a stop
string, so a stop string split across chunks is still found; on a match the
output is cut right before it.

TextStream: the two in a row, one call per engine event (what a sample streams).
"""

from __future__ import annotations

from collections.abc import Callable, Collection


class IncrementalDetokenizer:
    def __init__(
        self, decode: Callable[[list[int]], str], byte_pieces: Collection[int] = frozenset()
    ) -> None:
        self._decode = decode
        # Byte-fallback pieces (`<0xE2>`, and the skipped special tokens a run spans): a
        # SentencePiece decoder turns a run of them into text as one unit, and an invalid
        # run into one U+FFFD per byte even where a byte alone is valid, so a run's text
        # is final only once the run has ended (tokenizer.byte_piece_ids).
        self._byte_pieces = byte_pieces
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the re-decoded window
        self._read_offset = 0  # ids before this are fully emitted
        self._emitted = 0  # characters of ids[read_offset:] already emitted

    def _window(self, end: int) -> tuple[int, str]:
        """(chars of the emitted context, decoded window up to `end`)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return len(prefix), self._decode(self.ids[self._prefix_offset : end])

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly "")."""
        self.ids.extend(token_ids)
        end = len(self.ids)
        while end > self._read_offset and self.ids[end - 1] in self._byte_pieces:
            end -= 1  # a byte run still open: held back whole
        n_prefix, full = self._window(end)
        # trailing U+FFFD: bytes of a character whose remaining bytes have not come yet
        stable = len(full.rstrip("\ufffd"))
        start = n_prefix + self._emitted
        new = full[start:stable] if stable > start else ""
        if stable == len(full):  # all complete: the unread part becomes the next context
            # NOTE: only a context that decodes to text moves the window. A context of
            # skipped special tokens alone decodes to "", and a SentencePiece decoder then
            # treats the next token as the first one and drops its leading space
            # ([▁hello, <s>, ▁world] would stream "helloworld").
            if len(full) > n_prefix:
                self._prefix_offset = self._read_offset
            self._read_offset = end
            self._emitted = 0
        else:
            self._emitted += len(new)
        return new

    def flush(self) -> str:
        """Everything not emitted yet (an incomplete trailing character decodes to U+FFFD)."""
        n_prefix, full = self._window(len(self.ids))
        out = full[n_prefix + self._emitted :]
        self._prefix_offset = self._read_offset = len(self.ids)
        self._emitted = 0
        return out


class StopMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._held = ""  # text not emitted yet because it may begin a stop string
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit. After a match, `matched` is set and
        nothing more is emitted."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        hit = self._first_match(buf)
        if hit is not None:
            pos, self.matched = hit
            self._held = ""
            return buf[:pos]
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not match."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


class TextStream:
    """A sample's text: token ids in, the text to emit out, cut at a stop string.
    `matched` is the stop string found (None while there is none)."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        byte_pieces: Collection[int] = frozenset(),
        stop: list[str] | None = None,
    ) -> None:
        self._detok = IncrementalDetokenizer(decode, byte_pieces)
        self._stop = StopMatcher(stop or [])
        self.matched: str | None = None

    def step(self, token_ids: list[int], last: bool) -> str:
        """The text these tokens complete; with `last` (the engine ended the sample) also
        all that was held back. Nothing more once a stop string matched."""
        text = self._stop.feed(self._detok.add(token_ids))
        if last and self._stop.matched is None:
            text += self._stop.feed(self._detok.flush())
            text += self._stop.flush()
        self.matched = self._stop.matched
        return text
