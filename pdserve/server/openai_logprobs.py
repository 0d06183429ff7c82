"""The `logprobs` objects of OpenAI responses, from the engine's values.

Completions (`logprobs: k`): parallel lists over the tokens; `top_logprobs[i]` maps the
text of each of the k most likely tokens at position i, and of the token there, to its
logprob (so up to k + 1 entries, as vLLM gives). With `echo` the prompt's tokens come
first, the first one with no logprob (null): it has no context.

Chat (`logprobs: true, top_logprobs: k`): `content` is a list of {token, logprob, bytes,
top_logprobs: [k of {token, logprob, bytes}]}.
"""

from __future__ import annotations

from typing import Any

from pdserve.protocol import PromptLogprobs, TopLogprobs
from pdserve.server.tokenizer import Tokenizer


class TokenTexts:
    """Each token id's text, decoded once per response (top lists repeat tokens)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.memo: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.memo.get(t)
        if s is None:
            s = self.memo[t] = self.tok.decode([t], skip_special_tokens=False)
        return s


def _top_map(text: TokenTexts, top: TopLogprobs | None, token: int, lp: float) -> dict[str, float]:
    out = {text(i): v for i, v in zip(top.ids, top.logprobs)} if top is not None else {}
    out.setdefault(text(token), lp)
    return out


def completion_logprobs(
    tok: Tokenizer,
    ids: list[int],
    lps: list[float],
    tops: list[TopLogprobs],
    offset: int,
    prompt: tuple[list[int], PromptLogprobs | None] | None = None,
) -> dict[str, Any]:
    """The completion choice's logprobs over `ids` (text starting at `offset`), after the
    prompt's tokens when `prompt` is given (echo: its ids and the engine's values)."""
    text = TokenTexts(tok)
    tokens: list[str] = []
    token_lps: list[float | None] = []
    top_lps: list[dict[str, float] | None] = []
    if prompt is not None:
        p_ids, p_lps = prompt
        chosen, p_tops = p_lps.unpack() if p_lps is not None else ([], [])
        tokens += [text(t) for t in p_ids]
        token_lps += [None, *chosen]
        top_lps.append(None)
        top_lps += [_top_map(text, t, i, v) for t, i, v in zip(p_tops, p_ids[1:], chosen)]
    tokens += [text(t) for t in ids]
    token_lps += lps
    top_lps += [_top_map(text, tops[j] if j < len(tops) else None, t, lp)
                for j, (t, lp) in enumerate(zip(ids, lps))]  # fmt: skip
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(
    tok: Tokenizer, ids: list[int], lps: list[float], tops: list[TopLogprobs]
) -> dict[str, Any]:
    text = TokenTexts(tok)

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for j, (t, lp) in enumerate(zip(ids, lps)):
        top = tops[j] if j < len(tops) else None
        alts = [entry(i, v) for i, v in zip(top.ids, top.logprobs)] if top is not None else []
        content.append({**entry(t, lp), "top_logprobs": alts})
    return {"content": content}
