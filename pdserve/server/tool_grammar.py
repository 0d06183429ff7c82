r"""Tool calls as an llguidance grammar (the engines enforce it token by token), in the
Hermes form the chat templates of Qwen2.5 and its kin write: `<tool_call>\n{json}\n</tool_call>`.

    tool_choice "required" / named   calls and nothing else   start: block ("\n" block)* "\n"?
    tool_choice "auto" (or unset)    text, or calls           start: block* TEXT | bare
      only with a `strict` tool or parallel_tool_calls false; else no grammar at all

    block: <tool_call> "\n" call "\n" </tool_call>      bare: BLANK call ("\n" call)* "\n"?

parallel_tool_calls false allows exactly one call, after which only the end may come
(auto: `TEXT | block "\n"? | BLANK call "\n"?`). A forced answer may end after any
complete call, and after the one newline the model writes there (it wants the end of
the turn next, not another call).

Under "auto" the call's JSON is constrained once the model writes the opening tag: the
tag is a lazy lexeme (it ends the free text at its first appearance), or, where the
vocabulary holds it as one added token, that token by id. Small models of the family
often leave the tags out and answer with bare call objects (which tool_calls.py reads
as calls too): an answer that opens with `{` is such calls, one per line, so free text
may not open with `{`. A call's arguments follow its tool's `parameters` schema when
the tool is `strict` (and always when the call is forced), else any JSON object.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from pdserve.server.request_fields import FieldRefused

# the separators the chat templates write calls with (`tojson`), and no free whitespace
# (a small model is not left free to emit whitespace forever)
_CALL_JSON: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# free text, which may not open with "{" (an answer that does is bare calls)
_TEXT = "TEXT: /\\s*([^{\\s](.|\\n)*)?/\nBLANK: /\\s*/"


def tool_tags(tok: Any) -> tuple[int, int] | None:
    """The ids of `<tool_call>` and `</tool_call>` where the vocabulary holds each as one
    added token (Qwen2.5's), else None."""
    ids = tok.added_token_id("<tool_call>"), tok.added_token_id("</tool_call>")
    return None if None in ids else ids


def _function(tool: Any, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldRefused(f"tools[{i}] needs function.name", f"tools[{i}].function.name")
    if fn.get("strict") not in (None, True, False):
        raise FieldRefused(f"tools[{i}].function.strict must be a boolean",
                           f"tools[{i}].function.strict")  # fmt: skip
    return fn


def strict_tools(tools: list[Any] | None) -> list[int]:
    """The indices of the tools marked `strict: true`."""
    return [i for i, t in enumerate(tools or []) if _function(t, i).get("strict") is True]


def _call_schema(fn: dict[str, Any], constrain: bool) -> dict[str, Any]:
    params = (fn.get("parameters") or {"type": "object"}) if constrain else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def _calls_schema(tools: list[Any], choice: Any, forced: bool) -> dict[str, Any]:
    fns = {fn["name"]: fn for fn in (_function(t, i) for i, t in enumerate(tools))}
    if isinstance(choice, dict):  # a named function
        name = choice.get("function", {}).get("name")
        if name not in fns:
            raise FieldRefused(f"tool_choice names no tool of the request: {name!r}", "tool_choice")
        schema = _call_schema(fns[name], True)
    else:
        schema = {"anyOf": [_call_schema(fn, forced or fn.get("strict") is True)
                            for fn in fns.values()]}  # fmt: skip
    return {**schema, "x-guidance": _CALL_JSON}


def _tags(tags: tuple[int, int] | None) -> tuple[str, str]:
    """The opening and closing tag as grammar terms. Where each is one added token,
    llguidance reads it as a special token, which a quoted "<tool_call>" never matches
    (its mask would offer the token, and consuming it would put the matcher in error),
    so the grammar names them by id."""
    if tags is None:
        return '"<tool_call>"', '"</tool_call>"'
    return f"<[{tags[0]}]>", f"<[{tags[1]}]>"


def _compiled(lark: str, param: str) -> str:
    """The grammar of `lark`, or FieldRefused naming the problem (often a schema of a
    tool's `parameters` that llguidance cannot compile)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception as e:
        raise FieldRefused(f"{param}: {e}", param) from None
    if is_error:
        raise FieldRefused(f"{param}: the grammar does not compile: {'; '.join(messages)}", param)
    return grammar


def tool_grammar(
    tools: list[Any], choice: Any, parallel: bool | None, tags: tuple[int, int] | None = None
) -> str:
    """`tool_choice` "required" (some tool) or {"type": "function", "function": {"name"}}
    (that one): one call, or several when parallel_tool_calls is not false. `tags`: the
    tags' token ids when each is one added token (tool_tags)."""
    open_, close = _tags(tags)
    schema = _calls_schema(tools, choice, forced=True)
    repeat = "" if parallel is False else ' ("\\n" block)*'
    lark = (f'start: block{repeat} "\\n"?\nblock: {open_} "\\n" call "\\n" {close}\n'
            f"call: %json {json.dumps(schema)}")  # fmt: skip
    return _compiled(lark, "tool_choice")


def auto_tool_grammar(
    tools: list[Any], parallel: bool | None, tags: tuple[int, int] | None = None
) -> str | None:
    """tool_choice "auto": text, and calls after it, constrained from their opening tag
    on; None where nothing needs it (no strict tool, parallel calls allowed)."""
    strict = strict_tools(tools)
    if not strict and parallel is not False:
        return None
    open_, close = _tags(tags)
    # text up to the tag: a lazy lexeme where the tag is text (it ends at the tag's first
    # appearance); the free text never holds a special token, so an id ends it anyway
    lead = f"lead: TEXT {open_}" if tags is not None else f"lead[lazy]: TEXT {open_}"
    if parallel is False:
        start = 'start: TEXT | block "\\n"? | BLANK call "\\n"?'
    else:
        start = 'start: block* TEXT | BLANK call ("\\n" call)* "\\n"?'
    schema = _calls_schema(tools, None, forced=False)
    lark = (f'%llguidance {{}}\n{start}\nblock: lead "\\n" call "\\n" {close}\n{lead}\n'
            f"{_TEXT}\ncall: %json {json.dumps(schema)}")  # fmt: skip
    param = f"tools[{strict[0]}].function.strict" if strict else "parallel_tool_calls"
    return _compiled(lark, param)
