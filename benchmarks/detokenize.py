"""Streaming detokenization: pdserve's IncrementalDetokenizer against the tokenizers
library's DecodeStream, on real tokenizers, taking turns.

    python benchmarks/detokenize.py [--models smollm2 gemma3-270m] [--tokens 4000]
                                    [--rounds 7] [--chunk 1] [--json]

A few thousand tokens of mixed text (English prose, code, accented Latin, CJK, emoji,
and characters that SentencePiece vocabularies only hold as byte-fallback pieces) are
fed `--chunk` ids per call, as the engine's events bring them, through each streamer
in turn (A B A B ...); tokens/s is the median over the rounds. Each stream's joined
text is compared with the one-shot decode of all ids, and any difference is printed.

Then, for a byte-fallback (SentencePiece) vocabulary, two endings a model can produce:
a byte run that turns out invalid after a byte that was valid alone ('A' <0xC3>: the
one-shot decode renders the whole run as U+FFFD), and an incomplete character at the
end of a sample. pdserve holds a byte run until it ends and flushes at the end;
DecodeStream has no flush, and raises on the first ("Invalid prefix encountered").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402

from pdserve.checkpoints.resolve import resolve_model  # noqa: E402
from pdserve.server.detokenizer import IncrementalDetokenizer  # noqa: E402
from pdserve.server.tokenizer import byte_piece_ids  # noqa: E402

MIXED = [
    "The quick brown fox jumps over the lazy dog, then naps until the sun sets. ",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Crème brûlée, façade, naïve coöperation, Straße, smørrebrød, Łódź. ",
    "日本語のテキストと中文的句子，还有한국어 문장도 있습니다。",
    "Emoji: 😀🚀👩‍👩‍👧‍👦🏳️‍🌈 and flags 🇫🇷🇯🇵. ",
    # rare symbols and scripts: byte-fallback pieces in a SentencePiece vocabulary
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀𓁐 ꙮ ᚠᛇᚻ ⟁⟂ 𐍈𐌰𐌹 ",
]

Streamer = Callable[[Tokenizer, list[list[int]]], str]


def ours(tok: Tokenizer, chunks: list[list[int]]) -> str:
    d = IncrementalDetokenizer(tok.decode, byte_piece_ids(tok))
    return "".join(d.add(c) for c in chunks) + d.flush()


def decode_stream(tok: Tokenizer, chunks: list[list[int]]) -> str:
    s = DecodeStream(skip_special_tokens=True)
    return "".join(s.step(tok, c) or "" for c in chunks)


STREAMERS: dict[str, Streamer] = {"pdserve": ours, "DecodeStream": decode_stream}


def edge_cases(tok: Tokenizer) -> dict[str, dict[str, str]]:
    """{case: {streamer: "equal" | what differs}} for byte runs a model may end oddly."""
    word = tok.encode(" hello world", add_special_tokens=False).ids
    piece = tok.token_to_id
    cases = {
        "invalid run after a valid byte": [piece("<0x41>"), piece("<0xC3>"), *word],
        "incomplete character at the end": [*word, piece("<0xF0>")],
    }
    out: dict[str, dict[str, str]] = {}
    for case, ids in cases.items():
        want = tok.decode(ids, skip_special_tokens=True)
        out[case] = {}
        for label, fn in STREAMERS.items():
            try:
                got = fn(tok, [[i] for i in ids])
                out[case][label] = "equal" if got == want else f"{got!r} != {want!r}"
            except Exception as e:  # DecodeStream raises on an inconsistent prefix
                out[case][label] = f"raised {type(e).__name__}: {e}"
    return out


def mixed_ids(tok: Tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tok.encode(MIXED[i % len(MIXED)], add_special_tokens=False).ids
        i += 1
    return ids[:n]


def bench_model(name: str, n: int, rounds: int, chunk: int) -> dict:
    path = resolve_model(name).path
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = mixed_ids(tok, n)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    want = tok.decode(ids, skip_special_tokens=True)
    rates: dict[str, list[float]] = {k: [] for k in STREAMERS}
    same: dict[str, bool] = {}
    for _ in range(rounds):
        for label, fn in STREAMERS.items():  # taking turns
            t0 = time.perf_counter()
            got = fn(tok, chunks)
            rates[label].append(len(ids) / (time.perf_counter() - t0))
            same[label] = got == want
            if not same[label]:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                print(f"  {name} {label}: streamed text differs at char {at}: "
                      f"{got[at or 0 : (at or 0) + 12]!r} vs {want[at or 0 : (at or 0) + 12]!r}")  # fmt: skip
    byte_fallback = len(byte_piece_ids(tok)) > 0
    edges = edge_cases(tok) if byte_fallback else {}
    return {
        "edge_cases": edges,
        "model": name,
        "tokens": len(ids),
        "chunk": chunk,
        "byte_fallback": byte_fallback,
        "byte_pieces_in_text": sum(1 for t in ids if t in byte_piece_ids(tok)),
        **{f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()},
        **{f"{k}_equals_one_shot": v for k, v in same.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=1, help="ids per call (an engine event)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [bench_model(m, a.tokens, a.rounds, a.chunk) for m in a.models]
    if a.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}))
        return
    for r in rows:
        ratio = r["DecodeStream_tokens_per_s"] / r["pdserve_tokens_per_s"]
        print(f"{r['model']:>12}  {r['tokens']} tokens, {r['chunk']}/call, "
              f"{r['byte_pieces_in_text']} byte pieces: pdserve "
              f"{r['pdserve_tokens_per_s']:,.0f} tok/s, DecodeStream "
              f"{r['DecodeStream_tokens_per_s']:,.0f} tok/s ({ratio:.2f}x); equal to one-shot "
              f"{r['pdserve_equals_one_shot']} / {r['DecodeStream_equals_one_shot']}")  # fmt: skip
        for case, res in r["edge_cases"].items():
            print(f"{'':>14}{case}: " + "; ".join(f"{k} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
