"""Tool calls parsed out of the answer (Qwen2.5 / Hermes `<tool_call>` JSON), whole and
streamed, unit by unit and through a frontend with the fake engine (which echoes the
prompt, so the "model" writes whatever the prompt holds)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import ServerProc, make_model_dir

from pdserve.server.tokenizer import Tokenizer
from pdserve.server.tool_calls import ToolCallStream, parse_tool_calls, parser_for_template
from pdserve.server.tool_grammar import tool_grammar

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"Let me check. {CALL}\n{CALL.replace('Paris', 'Oslo')} done <tool_ca"


def test_whole_answer() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check. \n done "  # a tail that may begin a tag is dropped
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                       {"city": "Oslo"}]  # fmt: skip
    assert [c["index"] for c in calls] == [0, 1] and calls[0]["id"] != calls[1]["id"]


def test_not_a_call_stays_content() -> None:
    for text in ["<tool_call>not json</tool_call>", "<tool_call>[1, 2]</tool_call>"]:
        assert parse_tool_calls(text) == (text, [])


def test_unclosed_call_is_dropped() -> None:
    """A call the token budget cut leaves no tag text in the content, whole or streamed."""
    cut = 'Sure. <tool_call>\n{"name": "get_weather", "argu'
    assert parse_tool_calls(cut) == ("Sure. ", [])
    assert parse_tool_calls(CALL + "\n" + cut)[0] == "\nSure. "
    for seed in range(5):
        assert streamed(cut, frozenset(), seed) == ("Sure. ", [])


def test_max_calls_keeps_the_first() -> None:
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    for names in (frozenset(), NAMES):
        content, calls = parse_tool_calls(two, names, max_calls=1)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    bare = BARE + "\n" + BARE.replace("Paris", "Oslo")
    assert len(parse_tool_calls(bare, NAMES, max_calls=1)[1]) == 1


def test_streamed_in_any_pieces_equals_whole() -> None:
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(TEXT)), 8))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        s = ToolCallStream()
        content, calls = "", []
        for p in pieces:
            c, new = s.feed(p)
            assert "<tool_call>" not in c and "</tool_call>" not in c
            content, calls = content + c, calls + new
        rest, more = s.flush()
        content, calls = content + rest, calls + more
        want_content, want_calls = parse_tool_calls(TEXT)
        assert content == want_content
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]


NAMES = frozenset({"get_weather", "add"})
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def streamed(text: str, names: frozenset[str], seed: int = 0) -> tuple[str, list]:
    """(content, calls) of `text` fed in random pieces, with the content of each piece
    checked to show no tag."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    s = ToolCallStream(names)
    content, calls = "", []
    for p in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
        c, new = s.feed(p)
        assert "<tool_call>" not in c
        content, calls = content + c, calls + new
    rest, more = s.flush()
    return content + rest, calls + more


def test_bare_and_fenced_calls_naming_a_tool() -> None:
    """Qwen2.5-Coder-0.5B answers `{"name": ..., "arguments": ...}` without the tags (or
    in a ```json fence); only an answer made of such calls to the request's tools is
    read as calls, and only when the names are given."""
    two = BARE + "\n" + BARE.replace("Paris", "Oslo")
    for text in [BARE, f"  {BARE}\n", f"```json\n{BARE}\n```", f"```\n{BARE}```", two]:
        for seed in range(5):
            content, calls = streamed(text, NAMES, seed)
            assert content == "", text
            args = [json.loads(c["function"]["arguments"]) for c in calls]
            assert args[0] == {"city": "Paris"} and [c["index"] for c in calls] == list(
                range(len(args))
            )
        assert parse_tool_calls(text) == (text, [])  # no names: tags only
    for text in [BARE.replace("get_weather", "nope"), BARE + " done", "Sure: " + BARE,
                 '{"name": "Bob", "age": 3}', "```python\nprint(1)\n```", BARE[:-1]]:  # fmt: skip
        assert parse_tool_calls(text, NAMES) == (text, []), text
        assert streamed(text, NAMES) == (text, []), text


def test_answers_that_cannot_be_bare_calls_stream_at_once() -> None:
    for text in ["Hello there", "```python\nprint(1)", '{"city": "x"', "[1, 2"]:
        s = ToolCallStream(NAMES)
        assert s.feed(text) == (text, []), text
    s = ToolCallStream(NAMES)
    assert s.feed('{"na') == ("", [])  # not known yet: held


def test_parser_from_template() -> None:
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("{{ messages }}") is None


# ---- through a frontend ------------------------------------------------------------------
TEMPLATE = (
    "{# the model writes <tool_call> JSON #}{% if tools %}Tools:{% for t in tools %} "
    "{{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = make_model_dir(tmp_path_factory.mktemp("model"), max_positions=512)
    template = tmp_path_factory.mktemp("tpl") / "t.jinja"
    template.write_text(TEMPLATE)
    s = ServerProc(model, "decode", "--served-model-name", "m", "--chat-template", str(template))
    try:
        s.wait_healthy()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        body = {"messages": [{"role": "user", "content": CALL + EOS}], "tools": TOOLS}
        c.prompt_len = httpx.post(s.url + "/tokenize", json=body).json()["count"]  # type: ignore[attr-defined]
        yield c
    finally:
        s.stop()


EOS = "<|endoftext|>"  # the model's end: the echo stops there, as a model's answer would


def ask(client: openai.OpenAI, **kw):  # type: ignore[no-untyped-def]
    """The echo of the prompt, once: the template's line, then the call, then the end."""
    msgs = [{"role": "user", "content": CALL + EOS}]
    kw.setdefault("max_tokens", client.prompt_len)  # type: ignore[attr-defined]
    return client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, **kw)


def test_tool_calls_answer(client) -> None:
    r = ask(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")


def test_tool_calls_streamed(client) -> None:
    chunks = list(ask(client, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and "get_weather" in text  # the template's own line
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_cut_by_max_tokens_says_length(client) -> None:
    """The budget ends inside the call: finish_reason "length", and no tag text in the
    content, whole or streamed."""
    cut = client.prompt_len - 6  # type: ignore[attr-defined]
    choice = ask(client, max_tokens=cut).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == "Tools: get_weather", choice
    chunks = list(ask(client, max_tokens=cut, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Tools: get_weather" and chunks[-1].choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_under_auto(client) -> None:
    """Accepted in every tool_choice mode (openai-agents sends it with tool_choice unset)."""
    for choice in ("auto", None):
        kw = {"tool_choice": choice} if choice else {}
        r = ask(client, parallel_tool_calls=False, **kw).choices[0]
        assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1


def test_strict_schema_refused_by_name(client) -> None:
    """A strict tool whose parameters llguidance cannot compile: a 400 naming the tool."""
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       tools=[*TOOLS, bad], max_tokens=2)  # fmt: skip
    assert e.value.param == "tools[1].function.strict", e.value


def test_tool_choice_none_leaves_the_text(client) -> None:
    r = ask(client, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_forcing_an_unknown_tool_is_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, max_tokens=3, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"


# ---- tool_choice required / named: the grammar accepts calls and nothing else -------------
TWO = [*TOOLS, {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}]  # fmt: skip


def accepts(grammar: str, text: str, model) -> bool:  # type: ignore[no-untyped-def]
    import llguidance

    tok = llguidance.LLTokenizer((model / "tokenizer.json").read_text(), eos_token=0)
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ids = Tokenizer(model).encode(text, add_special_tokens=False)
    return m.consume_tokens(ids) and m.is_accepting()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("m2"))


def test_required_and_named_grammars(model_dir) -> None:
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    required = tool_grammar(TWO, "required", None)
    assert accepts(required, add, model_dir) and accepts(required, weather, model_dir)
    assert accepts(required, add + "\n" + weather, model_dir)  # parallel calls
    assert not accepts(required, "Sure! " + add, model_dir)  # a call, nothing else
    assert not accepts(tool_grammar(TWO, "required", False), add + "\n" + add, model_dir)
    named = tool_grammar(TWO, {"type": "function", "function": {"name": "add"}}, None)
    assert accepts(named, add, model_dir) and not accepts(named, weather, model_dir)
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>'
    assert not accepts(named, bad, model_dir)  # the parameters' schema holds


def test_tags_held_as_added_tokens_are_forced_by_id(model_dir, tmp_path) -> None:
    """Qwen2.5's vocabulary holds `<tool_call>` / `</tool_call>` as added tokens, which
    llguidance reads as special: a quoted tag offers the token, then refuses it once
    consumed (the answer ended at `<tool_call>`). Named by id, the call goes through."""
    import shutil

    shutil.copytree(model_dir, tmp_path / "m", dirs_exist_ok=True)
    path = tmp_path / "m" / "tokenizer.json"
    spec = json.loads(path.read_text())
    n = 1 + max(
        [*spec["model"]["vocab"].values(), *(t["id"] for t in spec.get("added_tokens", []))]
    )
    for i, tag in enumerate(("<tool_call>", "</tool_call>")):
        spec.setdefault("added_tokens", []).append({"id": n + i, "content": tag, "single_word": False,
            "lstrip": False, "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    path.write_text(json.dumps(spec))
    tok = Tokenizer(tmp_path / "m")
    tags = (tok.added_token_id("<tool_call>"), tok.added_token_id("</tool_call>"))
    assert tags == (n, n + 1)
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert tok.encode(add, add_special_tokens=False)[0] == n  # the tag is one token
    assert not accepts(tool_grammar(TWO, "required", None), add, tmp_path / "m")
    assert accepts(tool_grammar(TWO, "required", None, tags), add, tmp_path / "m")


def test_call_arguments_reach_the_template_as_an_object() -> None:
    """OpenAI sends `arguments` as JSON text; Qwen2.5's template writes it with `tojson`,
    which quoted it a second time (`"{\"city\": ...}"`), and the model's answer after
    the tool's result went wrong. transformers and vLLM expect an object there."""
    from pdserve.server.chat_template import compile_template
    from pdserve.server.openai_api import ChatMessage
    from pdserve.server.openai_parse import template_message

    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]  # fmt: skip
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": calls})
    t = compile_template("{% for c in messages[0].tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}")  # fmt: skip
    assert t.render(messages=[template_message(msg)]) == '{"city": "Paris"};"not json";'
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is left as sent
