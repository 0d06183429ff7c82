"""The tool-call grammars (pdserve/server/tool_grammar.py), run by llguidance's matcher
on the tiny tokenizer (tags as text) and on one that holds the tags as added tokens
(Qwen2.5's), as the engines run them."""

from __future__ import annotations

import json

import llguidance
import pytest
from fake_engine import make_model_dir

from pdserve.server.request_fields import FieldRefused
from pdserve.server.tokenizer import Tokenizer
from pdserve.server.tool_grammar import auto_tool_grammar, tool_grammar, tool_tags

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip
ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, ADD]


def call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


GOOD_ADD, BAD_ADD = call("add", {"a": 1, "b": 2}), call("add", {"a": "x", "b": 2})
LOOSE_WEATHER = call("get_weather", {"town": "Oslo"})  # not strict: any object


@pytest.fixture(scope="module", params=["text tags", "added tokens"])
def tok(request, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = make_model_dir(tmp_path_factory.mktemp("m"))
    if request.param == "added tokens":
        spec = json.loads((path / "tokenizer.json").read_text())
        n = 1 + max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])])
        for i, tag in enumerate(("<tool_call>", "</tool_call>")):
            spec["added_tokens"].append({"id": n + i, "content": tag, "single_word": False,
                "lstrip": False, "rstrip": False, "normalized": False, "special": False})  # fmt: skip
        (path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(path)
    assert (tool_tags(tok) is None) == (request.param == "text tags")
    return tok


def accepts(tok: Tokenizer, grammar: str, text: str) -> bool:
    """Whether the matcher takes `text` token by token and may end after it."""
    ll = llguidance.LLTokenizer(tok.hf.to_str(), eos_token=0)
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_forced_call_may_end_after_its_newline(tok) -> None:
    """The model writes a newline after the call and then wants the end of its turn:
    the grammar lets it end there, and never forces a second call."""
    required = tool_grammar(TOOLS, "required", None, tool_tags(tok))
    for text in (GOOD_ADD, GOOD_ADD + "\n", GOOD_ADD + "\n" + GOOD_ADD + "\n"):
        assert accepts(tok, required, text), text
    one = tool_grammar(TOOLS, "required", False, tool_tags(tok))
    assert accepts(tok, one, GOOD_ADD + "\n")
    assert not accepts(tok, one, GOOD_ADD + "\n" + GOOD_ADD)
    assert not accepts(tok, one, GOOD_ADD + "\n\n")


def test_auto_strict_constrains_the_call_only(tok) -> None:
    g = auto_tool_grammar(TOOLS, None, tool_tags(tok))
    assert g is not None
    for text in ("Plain text, no call.", "", "Let me add. " + GOOD_ADD,
                 GOOD_ADD + "\n" + LOOSE_WEATHER + "\nDone.", "<tool_ and more"):  # fmt: skip
        assert accepts(tok, g, text), text
    assert not accepts(tok, g, "Let me add. " + BAD_ADD)  # strict: the schema holds
    assert not accepts(tok, g, call("nope", {}))  # a call names a tool of the request


def test_auto_single_call(tok) -> None:
    """parallel_tool_calls false: text, or text and one call; then only the end."""
    g = auto_tool_grammar([WEATHER], False, tool_tags(tok))
    assert g is not None
    for text in ("Hello", "Sure. " + LOOSE_WEATHER, LOOSE_WEATHER + "\n"):
        assert accepts(tok, g, text), text
    assert not accepts(tok, g, LOOSE_WEATHER + "\n" + LOOSE_WEATHER)
    assert not accepts(tok, g, LOOSE_WEATHER + " more text")


def test_auto_without_strict_or_single_call_needs_no_grammar() -> None:
    assert auto_tool_grammar([WEATHER], None) is None
    assert auto_tool_grammar([WEATHER], True) is None


def test_strict_refusals_name_the_tool() -> None:
    bad = {"type": "function", "function": {"name": "f", "strict": "yes"}}
    with pytest.raises(FieldRefused) as e:
        auto_tool_grammar([WEATHER, bad], None)
    assert e.value.param == "tools[1].function.strict"
    ref = {"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}  # fmt: skip
    with pytest.raises(FieldRefused) as e:
        auto_tool_grammar([ref], None)
    assert e.value.param == "tools[0].function.strict"


def test_auto_bare_calls_are_constrained_too(tok) -> None:
    """Qwen2.5-Coder-0.5B answers with bare call objects, no tags: an answer that opens
    with `{` is calls, and strict arguments hold there as well."""
    g = auto_tool_grammar(TOOLS, None, tool_tags(tok))
    good = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
    bad = json.dumps({"name": "add", "arguments": {"a": "x", "b": 2}})
    for text in (good, "\n" + good + "\n", good + "\n" + good, "Sure: " + bad):
        assert accepts(tok, g, text), text
    for text in (bad, '{"a": 1}', good + " and text"):
        assert not accepts(tok, g, text), text
    one = auto_tool_grammar(TOOLS, False, tool_tags(tok))
    assert accepts(tok, one, good + "\n") and not accepts(tok, one, good + "\n" + good)
